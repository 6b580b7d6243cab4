"""Frozen configuration dataclasses. Every default lives here, and only here (the lossy rules' own settings
in :mod:`flyspec.config.rules`, the drafters' in :mod:`flyspec.config.drafters`; :mod:`flyspec.config` re-exports
them all).

Each dataclass validates itself in ``__post_init__`` and raises :class:`ConfigError` with a
message that says what to change. The CLI turns a ``ConfigError`` into exit code 2.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flyspec.config.drafters import DraftLengthConfig, LayerSkipConfig, NgramCacheConfig, NgramConfig
from flyspec.config.mapping import FLAT_OPTIONS, floats, from_vllm, jsonable, replaced
from flyspec.config.mapping import require as _require
from flyspec.config.names import DISTRIBUTION_DRAFTERS, DISTRIBUTION_VERIFIERS
from flyspec.config.rules import (
    AdasdConfig,
    BildConfig,
    CascadeConfig,
    FlyConfig,
    FsdConfig,
    LenienceConfig,
    MarginConfig,
    TypicalConfig,
)

# FLy reference config (AMD-AGI/FLy): 15 draft tokens, window 6, entropy threshold 0.3 over the
# target's top-3 probabilities.
DEFAULT_NUM_DRAFT_TOKENS = 15
DEFAULT_MAX_NEW_TOKENS = 128
DEFAULT_NUM_PROPOSAL_TOKENS = 6  # tokens a stack level checks per forward (FLy's multi-level drafter)
GREEDY_BELOW = 1e-5  # temperatures below this are greedy (SamplingConfig)
# Where models run and in which dtype (``--device``, ``--dtype``, ``device=``/``dtype=`` of the API). ``auto``
# device: CUDA when available, else the CPU; ``auto`` dtype: bfloat16 on CUDA (float16 where the GPU has no
# bf16), on the CPU bfloat16 only with native bf16 instructions, else float32 (``runtime/loading.resolve_dtype``).
DEFAULT_DEVICE = "auto"
DEFAULT_DTYPE = "auto"


@dataclass(frozen=True)
class SamplingConfig:
    """How the target's next token is chosen. ``temperature=0`` is greedy and draws no random numbers.

    Temperatures below ``GREEDY_BELOW`` are greedy too (as in vLLM): dividing logits by 1e-300
    overflows to infinities and NaN probabilities, and such a temperature means "greedy" anyway.
    """

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter

    def __post_init__(self) -> None:
        _require(
            math.isfinite(self.temperature) and self.temperature >= 0,
            f"temperature must be a finite number >= 0 (got {self.temperature}); use 0 for greedy",
        )
        _require(self.top_k >= 0, f"top_k must be >= 0 (got {self.top_k}); use 0 to disable it")
        _require(0 < self.top_p <= 1, f"top_p must be in (0, 1] (got {self.top_p}); use 1 to disable it")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class SamplingRange:
    """Where a lossy setting's quality was measured: the sampling of the calibration profile that chose it. Its loose
    accepts apply to generations decoded inside the range; outside it they are verified exactly (``exact``), since
    its quality bounds say nothing there. ``measured=False`` (the default, no profile): anywhere.

    ``greedy``: greedy decoding was measured; ``temperature``: the lowest and highest temperature above 0 measured
    (``(0, 0)``: none), every temperature between them taken as measured; ``top_p`` / ``top_k``: the filters measured,
    each as given (a request with another filter is outside); ``predicted``: the calibration's prompts carried their
    prediction (OpenAI's Predicted Outputs: ``flyspec calibrate --data edit``). A generation with a prediction drafts
    what the client expects, where a loose accept keeps text the target would have changed: a profile's loose accepts
    apply to it only where the profile measured predicted work; elsewhere it is verified exactly.
    """

    measured: bool = False
    greedy: bool = True
    temperature: tuple[float, float] = (0.0, 0.0)
    top_p: tuple[float, ...] = (1.0,)
    top_k: tuple[int, ...] = (0,)
    predicted: bool = False

    @classmethod
    def of(cls, samplings: Sequence[SamplingConfig], predicted: bool = False) -> SamplingRange:
        """The range a calibration measured ``samplings`` over (the filters of the sampled ones); ``predicted``: on
        prompts with their prediction."""
        sampled = [sampling for sampling in samplings if not sampling.greedy]
        temperatures = [sampling.temperature for sampling in sampled]
        return cls(
            measured=True,
            greedy=any(sampling.greedy for sampling in samplings),
            temperature=(min(temperatures), max(temperatures)) if temperatures else (0.0, 0.0),
            top_p=tuple(sorted({sampling.top_p for sampling in sampled})) or (1.0,),
            top_k=tuple(sorted({sampling.top_k for sampling in sampled})) or (0,),
            predicted=predicted,
        )

    def covers(self, sampling: SamplingConfig, predicted: bool = False) -> bool:
        """Whether a generation decoded with ``sampling`` (``predicted``: with a prediction) is inside the measured
        range."""
        if not self.measured:
            return True
        if predicted and not self.predicted:
            return False
        if sampling.greedy:
            return self.greedy
        low, high = self.temperature
        inside = high > 0 and low - 1e-9 <= sampling.temperature <= high + 1e-9
        return inside and any(abs(sampling.top_p - p) < 1e-9 for p in self.top_p) and sampling.top_k in self.top_k

    def describe(self) -> str:
        """``greedy``, ``T 0.7-1``, ``greedy and T 0.7 (top-p 0.95)``; ``any sampling`` unmeasured."""
        if not self.measured:
            return "any sampling"
        parts = ["greedy"] if self.greedy else []
        low, high = self.temperature
        if high > 0:
            sampled = f"T {low:g}" if low == high else f"T {low:g}-{high:g}"
            filters = [f"top-p {p:g}" for p in self.top_p if p < 1] + [f"top-k {k}" for k in self.top_k if k]
            parts.append(sampled + (f" ({', '.join(filters)})" if filters else ""))
        return " and ".join(parts)


PROTECT_CLASSES = ("digits", "names", "identifiers")


def check_device(device: str) -> str:
    """``device`` if it is ``auto``, ``cpu``, ``cuda`` or ``cuda:N``; else a :class:`ConfigError` saying so.

    Whether CUDA is there is checked when a model is loaded (``runtime/loading.resolve_device``).
    """
    text = str(device).strip().lower()
    index = text.removeprefix("cuda:")
    _require(
        text in ("auto", "cpu", "cuda") or (text.startswith("cuda:") and index.isdigit()),
        f"unknown device {device!r}; use auto, cpu, cuda or cuda:N (N = GPU index)",
    )
    return text


@dataclass(frozen=True)
class GuardConfig:
    """Trust guards of the lossy verifiers (``names.LOSSY_VERIFIERS``); see ``verifiers/guard.py``.

    On by default. :meth:`bare` gives the papers' bare rules for ablations; even then EOS and
    n-gram-cache tokens are never loosely accepted (those are defects, not trade-offs).

    ``protect``: token classes never loosely accepted (``digits``; ``names`` = identifiers inside
    code and names/identifiers that occur in the prompt; ``identifiers`` = every word).
    ``top_k``: a loose accept must be one of the target's ``top_k`` tokens (0: off).
    ``repeat_ngram``: n-gram length of the loop and copy guards (0: both off).
    ``copy_ratio``: a loose token inside a copy of the prompt needs
    ``p_target(token) >= copy_ratio * p_target(top token)`` (0: copies are not checked). The
    default 1.0 refuses every such copy short of an exact tie: at 0.5, 9 of 200 ``passage`` answers
    (SmolLM2-135M, float32) copied a prompt sentence the target wanted to leave and changed
    their names and numbers (EVALUATION.md).
    ``exact_first``: the first ``exact_first`` tokens of every output are verified exactly (0: off), the
    correction a comparison of relaxed verifiers found to recover most of the safety they lose (a refusal is
    decided in the first tokens). Not a trust guard of the papers' rules: :meth:`bare` keeps it.
    """

    protect: tuple[str, ...] = ("digits", "names")
    top_k: int = 3
    repeat_ngram: int = 4
    copy_ratio: float = 1.0
    exact_first: int = 0

    def __post_init__(self) -> None:
        for name in self.protect:
            _require(
                name in PROTECT_CLASSES,
                f"unknown protected token class {name!r}; choose from: {', '.join(PROTECT_CLASSES)}",
            )
        _require(self.top_k >= 0, f"guard top_k must be >= 0 (got {self.top_k}); 0 disables it")
        _require(
            self.repeat_ngram == 0 or self.repeat_ngram >= 2,
            f"guard repeat_ngram must be 0 (off) or >= 2 (got {self.repeat_ngram})",
        )
        _require(
            0 <= self.copy_ratio <= 1, f"guard copy_ratio must be in [0, 1] (got {self.copy_ratio}); 0 disables it"
        )
        _require(
            self.exact_first >= 0,
            f"exact_first must be >= 0 (got {self.exact_first}): how many first output tokens are verified exactly",
        )

    @staticmethod
    def bare() -> GuardConfig:
        """The papers' bare rules: only the always-on EOS and cache guards remain."""
        return GuardConfig(protect=(), top_k=0, repeat_ngram=0, copy_ratio=0.0)

    @property
    def is_bare(self) -> bool:
        """No trust guard beyond the always-on ones (``exact_first`` is not one: any rule may have it)."""
        return dataclasses.replace(self, exact_first=0) == GuardConfig.bare()

    def with_options(self, protect: Sequence[str] | None, bare_rule: bool | None, where: str = "") -> GuardConfig:
        """These guards with ``protect`` and ``bare_rule`` (``--protect``/``--bare-rule``, or a request's).

        ``bare_rule=False`` restores the defaults; the same protected set in any order is no change.
        """

        def flag(name: str) -> str:
            return f"{where}{name}" if where else f"--{name.replace('_', '-')}"

        _require(
            not (bare_rule and protect),
            f"{flag('bare_rule')} turns every trust guard off; drop {flag('protect')} (or {flag('bare_rule')})",
        )
        guard = self
        if bare_rule is not None and bare_rule != self.is_bare:
            guard = GuardConfig.bare() if bare_rule else GuardConfig()
            guard = dataclasses.replace(guard, exact_first=self.exact_first)
        if protect is None or set(protect) == set(guard.protect):
            return guard
        return dataclasses.replace(guard, protect=tuple(dict.fromkeys(protect)))


@dataclass(frozen=True)
class BreakerConfig:
    """The online circuit breaker of a lossy rule (``decoding/breaker.py``); a calibration profile sets it.

    Per generation: once it has made at least ``min_loose_accepts`` loose accepts and more than
    ``max_loose_per_100`` per 100 committed tokens, far more than the rule made on the prompts it
    was calibrated on, the prompt is taken to be outside that domain and the rest of the generation
    is verified by the strict base rule (exact match when greedy). ``max_loose_per_100=0``: off.
    """

    max_loose_per_100: float = 0.0
    min_loose_accepts: int = 3

    def __post_init__(self) -> None:
        _require(
            math.isfinite(self.max_loose_per_100) and self.max_loose_per_100 >= 0,
            f"breaker max_loose_per_100 must be a finite number >= 0 (got {self.max_loose_per_100}); 0 is off",
        )
        _require(self.min_loose_accepts >= 1, f"breaker min_loose_accepts must be >= 1 (got {self.min_loose_accepts})")

    @property
    def enabled(self) -> bool:
        return self.max_loose_per_100 > 0


PROFILE_AUTO = "auto"  # the profile flyspec ships for the model, drafter and dtype, if any (profiles/profile.py)
PROFILE_NONE = "none"


@dataclass(frozen=True)
class DecodeConfig:
    """One generation: length limit, stop strings and sampling (what to draft with: :class:`SpeculationConfig`)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop_strings: tuple[str, ...] = ()
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks)

    def __post_init__(self) -> None:
        _require(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        _require(all(self.stop_strings), "stop strings must be non-empty")


MODEL_DRAFTERS = ("draft-model", "multilevel")  # the drafters that need a draft model


@dataclass(frozen=True)
class SpeculationConfig:
    """What to speculate with: drafter, verifier, draft length and every component's settings.

    The one home of these defaults: the CLI builds it, the server keeps it and applies per-request
    overrides with ``dataclasses.replace``, bench and eval carry it, and
    :func:`flyspec.api.build_decoder` takes it. ``draft_model`` and the ``stack`` levels are names
    (packaged name, path, hub id) that the caller's :class:`flyspec.resources.Resources` resolves.
    ``num_proposal_tokens``: tokens a stack level checks per forward (multilevel, stack).
    :meth:`from_dict` also reads vLLM's ``speculative_config`` key names (see ``config_mapping.VLLM_KEYS``).
    """

    drafter: str = "ngram"
    verifier: str = "exact"
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    draft_model: str | None = None
    stack: tuple[str, ...] = ()  # levels of drafter "stack", bottom first
    num_proposal_tokens: int = DEFAULT_NUM_PROPOSAL_TOKENS
    draft_length: DraftLengthConfig = field(default_factory=DraftLengthConfig)
    ngram: NgramConfig = field(default_factory=NgramConfig)
    ngram_cache: NgramCacheConfig = field(default_factory=NgramCacheConfig)
    layer_skip: LayerSkipConfig = field(default_factory=LayerSkipConfig)
    fly: FlyConfig = field(default_factory=FlyConfig)
    margin: MarginConfig = field(default_factory=MarginConfig)
    typical: TypicalConfig = field(default_factory=TypicalConfig)
    bild: BildConfig = field(default_factory=BildConfig)
    fsd: FsdConfig = field(default_factory=FsdConfig)
    cascade: CascadeConfig = field(default_factory=CascadeConfig)
    adasd: AdasdConfig = field(default_factory=AdasdConfig)
    lenience: LenienceConfig = field(default_factory=LenienceConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    # where the lossy settings' quality was measured (a profile's sampling): outside it a generation is verified exactly
    sampling_range: SamplingRange = field(default_factory=SamplingRange)
    # a calibration profile (``flyspec calibrate``, ``profiles/profile.py``): a JSON file, "auto" (the one flyspec ships
    # for this model, drafter and dtype, used when a lossy verifier runs with its default settings) or "none"
    profile: str = PROFILE_AUTO

    def __post_init__(self) -> None:
        _require(
            isinstance(self.profile, str) and bool(self.profile.strip()),
            f"profile must be a profile file, {PROFILE_AUTO!r} or {PROFILE_NONE!r} (got {self.profile!r})",
        )
        _require(
            self.num_draft_tokens >= 1,
            f"num_draft_tokens must be >= 1 (got {self.num_draft_tokens}); use plain decoding for 0",
        )
        _require(self.num_proposal_tokens >= 1, f"num_proposal_tokens must be >= 1 (got {self.num_proposal_tokens})")
        _require(
            self.drafter not in MODEL_DRAFTERS or self.draft_model is not None,
            f"drafter {self.drafter!r} needs a draft model; pass --draft-model NAME_OR_PATH",
        )
        _require(
            self.verifier not in DISTRIBUTION_VERIFIERS or self.drafter in DISTRIBUTION_DRAFTERS,
            f"verifier {self.verifier!r} compares the draft model's distribution with the target's, and drafter "
            f"{self.drafter!r} has none: use --drafter layer-skip, or draft-model or multilevel with --draft-model",
        )
        _require(
            self.drafter != "stack" or bool(self.stack),
            "drafter 'stack' needs its levels, bottom first: e.g. --stack ngram,DRAFT_MODEL",
        )
        for name, value in floats(self):
            # configs are written to JSON (responses, run metadata): JSON has no NaN or Infinity
            _require(math.isfinite(value), f"{name} must be a finite number (got {value})")

    @property
    def models(self) -> tuple[str, ...]:
        """Every model name this configuration drafts with (draft model, stack levels that are models)."""
        levels = self.stack if self.drafter == "stack" else ()
        named = (self.draft_model,) if self.drafter in MODEL_DRAFTERS else ()
        return tuple(name for name in (*named, *levels) if name not in _LEVEL_KEYWORDS)

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any], base: SpeculationConfig | None = None) -> SpeculationConfig:
        """``base`` (default: the defaults) with the given fields: flyspec's names, nested per component
        (``{"fly": {"window_size": 4}}``), or vLLM's ``speculative_config`` names (``VLLM_KEYS``).

        An unknown key is an error naming the known ones, never silently ignored.
        """
        flat = from_vllm(mapping)
        return replaced(base or cls(), flat, "speculative config")

    def to_dict(self) -> dict[str, Any]:
        """Every field, nested, JSON-ready; ``from_dict(to_dict())`` gives the same config."""
        return jsonable(dataclasses.asdict(self))

    def to_vllm(self) -> dict[str, Any]:
        """The settings vLLM's ``speculative_config`` can express, under vLLM's key names."""
        out: dict[str, Any] = {"num_speculative_tokens": self.num_draft_tokens}
        if self.drafter == "ngram":
            out.update(method="ngram", prompt_lookup_max=self.ngram.max_ngram, prompt_lookup_min=self.ngram.min_ngram)
        elif self.drafter == "draft-model":
            out.update(method="draft_model", model=self.draft_model)
        if self.verifier == "fly":
            out.update(
                rejection_sample_method="fly",
                fly_window_size=self.fly.window_size,
                fly_entropy_threshold=self.fly.entropy_threshold,
                fly_entropy_top_k=self.fly.entropy_top_k,
            )
        return out

    def with_options(self, options: Mapping[str, Any], where: str = "") -> SpeculationConfig:
        """This config with flat options (CLI flags, a server request's ``speculative`` fields) applied.

        ``options`` keys are ``config_mapping.FLAT_OPTIONS`` names plus ``protect`` and ``bare_rule``; ``None``
        values are left out. ``where`` prefixes names in messages (``"speculative."`` for requests).
        """
        given = {name: value for name, value in options.items() if value is not None}
        nested: dict[str, Any] = {}
        for name, value in given.items():
            if name in ("protect", "bare_rule"):
                continue
            *component, field_name = FLAT_OPTIONS[name].split(".")
            (nested.setdefault(component[0], {}) if component else nested)[field_name] = value
        config = replaced(self, nested, "speculative config")
        guard = config.guard.with_options(given.get("protect"), given.get("bare_rule"), where)
        return dataclasses.replace(config, guard=guard)


_LEVEL_KEYWORDS = ("ngram", "ngram-cache", "layer-skip")
