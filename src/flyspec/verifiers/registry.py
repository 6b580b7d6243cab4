"""Verifier names → instances, and the draft length a verifier needs."""

from __future__ import annotations

from typing import Any

from flyspec.config import ConfigError, SpeculationConfig
from flyspec.config.names import LOSSLESS_VERIFIERS as LOSSLESS_VERIFIERS  # re-exported (config/names.py)
from flyspec.config.names import LOSSY_RULE_FIELDS as LOSSY_RULE_FIELDS  # re-exported: what make_verifier reads
from flyspec.config.names import VERIFIERS
from flyspec.verifiers.adasd import AdasdVerifier
from flyspec.verifiers.base import Verifier
from flyspec.verifiers.bild import BildVerifier
from flyspec.verifiers.block import BlockVerifier
from flyspec.verifiers.cascade import CascadeVerifier
from flyspec.verifiers.exact import ExactVerifier
from flyspec.verifiers.fly import FlyVerifier
from flyspec.verifiers.fsd import FsdVerifier
from flyspec.verifiers.lenience import LenienceVerifier
from flyspec.verifiers.margin import MarginVerifier
from flyspec.verifiers.rejection import RejectionVerifier
from flyspec.verifiers.typical import TypicalVerifier

# name -> the lossy verifier's class, built with the SpeculationConfig field of its name and the guards
LOOSE_RULES = {
    "fly": FlyVerifier,
    "margin": MarginVerifier,
    "typical": TypicalVerifier,
    "bild": BildVerifier,
    "lenience": LenienceVerifier,
    "fsd": FsdVerifier,
    "cascade": CascadeVerifier,
    "adasd": AdasdVerifier,
}


def make_verifier(name: str, spec: SpeculationConfig | None = None) -> Verifier:
    """Build a verifier by name with ``spec``'s component settings (default: the defaults).

    ``spec.guard`` configures the trust guards of the lossy verifiers; the lossless ones never
    loosely accept, so it is a no-op for them.
    """
    spec = spec or SpeculationConfig()
    if name == "exact":
        return ExactVerifier()
    if name == "rejection":
        return RejectionVerifier()
    if name == "block":
        return BlockVerifier()
    if name in LOOSE_RULES:
        return LOOSE_RULES[name](getattr(spec, name), guard=spec.guard)
    raise ConfigError(f"unknown verifier {name!r}; choose one of: {', '.join(VERIFIERS)}")


def rule_mapping(spec: SpeculationConfig) -> dict[str, Any]:
    """The fields of ``spec`` that decide a loose accept, JSON-ready (``SpeculationConfig.from_dict`` reads them
    back): what a request names to get this rule from the vLLM plugin (``flyspec_rule``)."""
    full = spec.to_dict()
    return {name: full[name] for name in LOSSY_RULE_FIELDS}


def verdict_reach(spec: SpeculationConfig) -> int:
    """How many draft tokens, from a mismatch on (itself included), a lossy rule reads to judge that mismatch:
    FLy's deferred window (a mismatch at ``j`` is judged only in a draft of at least ``j + W + 1`` tokens,
    ``verifiers/fly.py``), the loop and copy guards' n-grams (``verifiers/guard.py``: up to ``n - 1`` tokens
    after it); MARS and typical acceptance read the mismatch alone. A draft cut ``reach`` tokens past its first
    mismatch gets the very verdict there the whole draft gets (``flyspec calibrate --engine vllm`` cuts its
    baseline's drafts so: ``flyspec_vllm.reference``)."""
    reach = 1
    if spec.verifier == "fly" and spec.fly.window_size:
        reach = spec.fly.window_size + 1
    return max(reach, spec.guard.repeat_ngram)


def check_draft_length(verifier: Verifier, speculation: SpeculationConfig) -> None:
    """Refuse a draft length the verifier cannot use (needs no model: ``build_decoder`` checks it before loading)."""
    shortest = verifier.min_draft_tokens
    if speculation.num_draft_tokens < shortest:
        raise ConfigError(
            f"num_draft_tokens ({speculation.num_draft_tokens}) is too short for verifier {verifier.name!r}: "
            f"it needs at least {shortest} (FLy: window_size + 1, or no mismatch could ever be judged); "
            "raise --num-draft-tokens or lower --window-size"
        )


def checked_verifier(spec: SpeculationConfig) -> Verifier:
    """``spec``'s verifier, after the checks that need no model: its name, and a draft length it can use
    (``build_decoder`` builds it before loading anything, so these errors never wait for a model)."""
    verifier = make_verifier(spec.verifier, spec)
    check_draft_length(verifier, spec)  # FLy needs window_size + 1 draft tokens
    return verifier
