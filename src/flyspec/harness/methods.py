"""Method names, one grammar for ``flyspec bench`` and ``flyspec eval``.

``plain``
    flyspec's plain autoregressive decoding: the baseline every method is compared with (always
    run; ``baseline`` is its deprecated bench spelling).
``[DRAFTER+]VERIFIER[+MODIFIER]``
    flyspec's speculative decoding. ``DRAFTER`` is a registry name (``ngram``, ``ngram-cache``,
    ``draft-model`` or its short form ``draft``, ``multilevel``, ``layer-skip``, ``stack``); without
    one the run's speculation config decides (``--drafter``, default ``ngram``). ``VERIFIER`` is a
    registry name (``exact``, ``rejection``, ``fly``, ``margin``, ``typical``). A lossy verifier
    runs with flyspec's default trust guards (``GuardConfig()``, ``verifiers/guard.py``) unless
    ``MODIFIER`` says otherwise:

    ``+bare``: the paper's bare rule (``GuardConfig.bare()``), for ablations;
    ``+guard``: protect digits on every task, and every identifier on code tasks;
    ``+digits`` / ``+names`` / ``+identifiers``: protect only that token class.

    ``@fixed`` / ``@heuristic`` / ``@cost`` at the end: that draft-length policy
    (``DraftLengthConfig.policy``) instead of the run's ``--draft-length``, so one run can compare
    them (``ngram+exact@cost``).
``prediction+[DRAFTER+]VERIFIER[+MODIFIER]``
    the same, given each request's ``prediction`` (OpenAI's predicted output, ``Decoder.generate(...,
    prediction=...)``: drafts from the text the client expects, beside the drafter's own): the edit workload
    (``harness/edits.py``) carries one per item. Its *context twin* is the method without it, the drafter
    named (``prediction+exact`` → ``ngram+exact``, the default drafter's): what the prediction adds.
peers
    other engines on the same prompt ids and weights; which ones a harness runs is its own
    choice (:data:`PEERS`): transformers ``hf-*``, llama.cpp ``llamacpp-*``, vLLM ``vllm-*``
    (``vllm-ngram+fly[+bare]`` is flyspec's n-gram drafter and FLy inside vLLM; ``vllm-fly[+bare]``
    is its deprecated eval spelling; ``vllm-prediction`` is the plugin drafting each request's prediction inside
    vLLM, lossless, its context twin ``vllm-ngram``).

Examples: ``plain``, ``ngram+exact``, ``fly``, ``draft+fly+bare``, ``margin+identifiers``, ``ngram+fly@cost``,
``prediction+exact``, ``hf-lookup``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from flyspec.config import (
    MODEL_DRAFTERS,
    PROTECT_CLASSES,
    ConfigError,
    GuardConfig,
    SpeculationConfig,
)
from flyspec.config.names import DRAFT_LENGTH_POLICIES, DRAFTERS, LOSSLESS_VERIFIERS, VERIFIERS

logger = logging.getLogger(__name__)

PLAIN = "plain"
PREDICTION = "prediction"  # the prefix of a method given each request's prediction
CONTEXT_DRAFTER = SpeculationConfig().drafter  # a prediction method's drafter when it names none
MODIFIERS = ("bare", "guard", *PROTECT_CLASSES)
DRAFTER_ALIASES = {"draft": "draft-model"}
HF_PEERS = ("hf-plain", "hf-lookup", "hf-assisted")
LLAMACPP_PEERS = ("llamacpp-plain", "llamacpp-lookup")
VLLM_PREDICTION = "vllm-prediction"  # vLLM with the plugin, each request given its prediction (its drafts)
VLLM_PEERS = ("vllm-plain", "vllm-ngram", "vllm-ngram+fly", "vllm-ngram+fly+bare", VLLM_PREDICTION)
PEERS = (*HF_PEERS, *LLAMACPP_PEERS, *VLLM_PEERS)
# The plain decoding each peer's own speedup is measured against.
PEER_PLAIN = {
    "hf-lookup": "hf-plain",
    "hf-assisted": "hf-plain",
    "llamacpp-lookup": "llamacpp-plain",
    **{name: "vllm-plain" for name in VLLM_PEERS[1:]},
}
# Old spellings still accepted (with a warning), and what they are now.
DEPRECATED = {"baseline": PLAIN, "vllm-fly": "vllm-ngram+fly", "vllm-fly+bare": "vllm-ngram+fly+bare"}


@dataclass(frozen=True)
class Method:
    """A parsed method name. ``engine``: ``flyspec``, or the peer's (``hf``, ``llamacpp``, ``vllm``)."""

    name: str
    drafter: str | None = None  # registry name; None: plain, a peer, or the run's --drafter
    verifier: str | None = None  # None: plain decoding (flyspec's or a peer's)
    modifier: str | None = None  # one of MODIFIERS
    engine: str = "flyspec"
    draft_length: str | None = None  # a DraftLengthConfig.policy; None: the run's
    prediction: bool = False  # given each request's prediction (``prediction+...``)

    @property
    def is_plain(self) -> bool:
        return self.name == PLAIN

    @property
    def peer(self) -> bool:
        return self.engine != "flyspec"

    @property
    def bare(self) -> bool:
        return self.modifier == "bare"

    @property
    def lossless(self) -> bool:
        return self.verifier is None or self.verifier in LOSSLESS_VERIFIERS

    @property
    def needs_draft_model(self) -> bool:
        return self.drafter in MODEL_DRAFTERS or self.name == "hf-assisted"

    @property
    def context_twin(self) -> str | None:
        """A prediction method's twin without the prediction, its drafter named (``prediction+exact`` →
        ``ngram+exact``); None for every other method."""
        if not self.prediction:
            return None
        if self.name == VLLM_PREDICTION:  # on vLLM: its own n-gram drafts, the context drafts a vLLM user has
            return "vllm-ngram"
        rest = self.name.removeprefix(f"{PREDICTION}+")
        return rest if self.drafter is not None else f"{CONTEXT_DRAFTER}+{rest}"

    def guard_config(self, task_kind: str = "text") -> GuardConfig:
        """The trust guards this method runs with on a task of this kind."""
        if self.modifier == "bare":
            return GuardConfig.bare()
        if self.modifier == "guard":
            return replace(GuardConfig(), protect=("digits", "identifiers") if task_kind == "code" else ("digits",))
        if self.modifier is not None:
            return replace(GuardConfig(), protect=(self.modifier,))
        return GuardConfig()

    def with_draft_length(self, spec: SpeculationConfig) -> SpeculationConfig:
        """``spec`` with this method's ``@policy`` draft length, if it names one."""
        if self.draft_length is None:
            return spec
        return replace(spec, draft_length=replace(spec.draft_length, policy=self.draft_length))

    def speculation(self, base: SpeculationConfig, task_kind: str | None = None) -> SpeculationConfig:
        """What this flyspec method speculates with: ``base`` with its drafter, verifier, guards and draft length.

        ``task_kind`` (eval): the guards of that kind of task; None (bench): ``base``'s guards unless a modifier
        names others."""
        assert self.verifier is not None, f"{self.name} does not speculate"
        guard = base.guard if task_kind is None and self.modifier is None else self.guard_config(task_kind or "text")
        spec = replace(base, drafter=self.drafter or base.drafter, verifier=self.verifier, guard=guard)
        return self.with_draft_length(spec)

    def protect(self, task_kind: str = "text") -> tuple[str, ...]:
        """The token classes protected on a task of this kind (none for lossless methods)."""
        return () if self.lossless else self.guard_config(task_kind).protect


def _grammar(peers: tuple[str, ...]) -> str:
    drafters = "|".join((*DRAFTERS, *DRAFTER_ALIASES))
    text = (
        f"{PLAIN}, [<{drafters}>+]<{'|'.join(VERIFIERS)}>[+{'|+'.join(MODIFIERS)}][@{'|@'.join(DRAFT_LENGTH_POLICIES)}]"
        f" (after {PREDICTION}+: given each request's prediction)"
    )
    return text + (f", or a peer: {', '.join(peers)}" if peers else "")


def parse_method(name: str, peers: tuple[str, ...] = PEERS) -> Method:
    """One method name; ``ConfigError`` spells out the grammar (``peers``: those the harness runs)."""
    name = name.strip()
    if name in DEPRECATED:
        logger.warning("method name %r is deprecated; use %r", name, DEPRECATED[name])
        name = DEPRECATED[name]
    if name == PLAIN:
        return Method(name)
    if name in peers:  # a vLLM FLy peer is lossy: its verifier and guards are recorded
        verifier = "fly" if name.startswith("vllm-ngram+fly") else None
        modifier = "bare" if name.endswith("+bare") else None
        return Method(name, None, verifier, modifier, engine=name.split("-")[0], prediction=name == VLLM_PREDICTION)
    base, at, policy = name.partition("@")
    if at:
        if policy not in DRAFT_LENGTH_POLICIES or not base:
            raise ConfigError(
                f"unknown draft length @{policy} in method {name!r}; choose @{', @'.join(DRAFT_LENGTH_POLICIES)}"
            )
        method = parse_method(base, ())
        if method.verifier is None:
            raise ConfigError(f"method {name!r}: plain decoding drafts nothing, so @{policy} does nothing")
        return replace(method, name=name, draft_length=policy)
    parts = name.split("+")
    prediction = parts[0] == PREDICTION and len(parts) > 1
    if prediction:
        parts = parts[1:]
    drafter = None
    if parts[0] not in VERIFIERS:
        drafter, parts = DRAFTER_ALIASES.get(parts[0], parts[0]), parts[1:]
    if drafter in (None, *DRAFTERS) and parts and parts[0] in VERIFIERS and len(parts) <= 2:
        verifier, modifier = parts[0], parts[1] if len(parts) == 2 else None
        if modifier is not None and modifier not in MODIFIERS:
            raise ConfigError(f"unknown modifier +{modifier} in method {name!r}; choose +{', +'.join(MODIFIERS)}")
        if modifier is not None and verifier in LOSSLESS_VERIFIERS:
            raise ConfigError(
                f"method {name!r}: {verifier} is lossless and never loosely accepts, so +{modifier} does nothing"
            )
        return Method(name, drafter, verifier, modifier, prediction=prediction)
    raise ConfigError(f"unknown method {name!r}; use {_grammar(peers)}")


def context_twin(name: str) -> str | None:
    """The context twin (``Method.context_twin``) of the method called ``name``; None unless it is given
    predictions."""
    if name == VLLM_PREDICTION:
        return parse_method(name).context_twin
    return parse_method(name, ()).context_twin if name.startswith(f"{PREDICTION}+") else None


def speculations(methods: list[Method], base: SpeculationConfig) -> list[SpeculationConfig]:
    """What each of ``methods`` that flyspec's engine runs speculates with (``Method.speculation``)."""
    return [method.speculation(base) for method in methods if method.engine == "flyspec" and method.verifier]


def parse_methods(text: str, peers: tuple[str, ...] = PEERS) -> list[Method]:
    """Comma-separated names → methods, in order, duplicates dropped (each harness adds ``plain`` itself)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ConfigError("no methods given; give a comma-separated list such as plain,ngram+fly")
    return list({method.name: method for method in (parse_method(name, peers) for name in names)}.values())
