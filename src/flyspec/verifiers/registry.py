"""Verifier names → instances, and the draft length a verifier needs."""

from __future__ import annotations

from flyspec.config import ConfigError, SpeculationConfig
from flyspec.names import LOSSLESS_VERIFIERS as LOSSLESS_VERIFIERS  # re-exported: the names live in names.py
from flyspec.names import VERIFIERS
from flyspec.verifiers.base import Verifier
from flyspec.verifiers.exact import ExactVerifier
from flyspec.verifiers.fly import FlyVerifier
from flyspec.verifiers.margin import MarginVerifier
from flyspec.verifiers.rejection import RejectionVerifier
from flyspec.verifiers.typical import TypicalVerifier


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
    if name == "fly":
        return FlyVerifier(spec.fly, guard=spec.guard)
    if name == "margin":
        return MarginVerifier(spec.margin, guard=spec.guard)
    if name == "typical":
        return TypicalVerifier(spec.typical, guard=spec.guard)
    raise ConfigError(f"unknown verifier {name!r}; choose one of: {', '.join(VERIFIERS)}")


def check_draft_length(verifier: Verifier, speculation: SpeculationConfig) -> None:
    """Refuse a draft length the verifier cannot use (needs no model: ``build_decoder`` checks it before loading)."""
    shortest = verifier.min_draft_tokens
    if speculation.num_draft_tokens < shortest:
        raise ConfigError(
            f"num_draft_tokens ({speculation.num_draft_tokens}) is too short for verifier {verifier.name!r}: "
            f"it needs at least {shortest} (FLy: window_size + 1, or no mismatch could ever be judged); "
            "raise --num-draft-tokens or lower --window-size"
        )
