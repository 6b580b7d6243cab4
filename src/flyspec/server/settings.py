"""Server-wide settings: speculation defaults (from the CLI) and request limits.

Frozen dataclasses, like the library's configs; a request may override the speculation
defaults (see :meth:`SpeculationDefaults.for_request`) but never the limits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from flyspec.config import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_NUM_DRAFT_TOKENS,
    ConfigError,
    DraftLengthConfig,
    FlyConfig,
    GuardConfig,
    LayerSkipConfig,
    MarginConfig,
    NgramCacheConfig,
    NgramConfig,
    TypicalConfig,
)
from flyspec.drafters.registry import DRAFTERS
from flyspec.verifiers.registry import LOSSLESS_VERIFIERS, VERIFIERS

# Which verifier each per-request speculative parameter belongs to: setting one while another
# verifier runs is a 400, so nobody believes they ran FLy when they did not.
LOSSY_VERIFIERS = tuple(name for name in VERIFIERS if name not in LOSSLESS_VERIFIERS)
VERIFIER_PARAMETERS: dict[str, tuple[str, ...]] = {
    "window_size": ("fly",),
    "entropy_threshold": ("fly",),
    "fly_temperature_rule": ("fly",),
    "margin_ratio": ("margin",),
    "typical_epsilon": ("typical",),
    "typical_delta": ("typical",),
    "protect": LOSSY_VERIFIERS,
}


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass(frozen=True)
class SpeculationDefaults:
    """Drafter, verifier and their parameters: server-wide defaults, or one request's resolved choice."""

    drafter: str = "ngram"
    verifier: str = "exact"
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    fly: FlyConfig = field(default_factory=FlyConfig)
    margin: MarginConfig = field(default_factory=MarginConfig)
    typical: TypicalConfig = field(default_factory=TypicalConfig)
    ngram: NgramConfig = field(default_factory=NgramConfig)
    num_ngram_tokens: int = 6
    guard: GuardConfig = field(default_factory=GuardConfig)
    draft_length: DraftLengthConfig = field(default_factory=DraftLengthConfig)
    layer_skip: LayerSkipConfig = field(default_factory=LayerSkipConfig)
    ngram_cache: NgramCacheConfig = field(default_factory=NgramCacheConfig)
    stack: tuple[str, ...] = ()  # levels of drafter "stack" (server-wide; requests cannot load models)

    def __post_init__(self) -> None:
        _require(self.drafter in DRAFTERS, f"unknown drafter {self.drafter!r}; choose one of: {', '.join(DRAFTERS)}")
        _require(
            self.verifier in VERIFIERS, f"unknown verifier {self.verifier!r}; choose one of: {', '.join(VERIFIERS)}"
        )
        _require(self.num_draft_tokens >= 1, f"num_draft_tokens must be >= 1 (got {self.num_draft_tokens})")

    @property
    def lossless(self) -> bool:
        return self.verifier in LOSSLESS_VERIFIERS

    def for_request(self, overrides: dict[str, Any]) -> SpeculationDefaults:
        """These defaults with one request's ``speculative`` fields applied (``None`` = keep the default).

        Raises :class:`ConfigError` when a value is invalid or belongs to a verifier that is not running.
        """
        overrides = {name: value for name, value in overrides.items() if value is not None}
        verifier = overrides.get("verifier", self.verifier)
        for name, owners in VERIFIER_PARAMETERS.items():
            _require(
                name not in overrides or verifier in owners,
                f"speculative.{name} applies to verifier {' / '.join(owners)} only, but verifier {verifier!r} "
                f'would run; add "verifier": "{owners[0]}" or drop {name}',
            )
        fly = dataclasses.replace(
            self.fly,
            window_size=overrides.get("window_size", self.fly.window_size),
            entropy_threshold=overrides.get("entropy_threshold", self.fly.entropy_threshold),
            temperature_rule=overrides.get("fly_temperature_rule", self.fly.temperature_rule),
        )
        return dataclasses.replace(
            self,
            drafter=overrides.get("drafter", self.drafter),
            verifier=verifier,
            num_draft_tokens=overrides.get("num_draft_tokens", self.num_draft_tokens),
            fly=fly,
            margin=MarginConfig(overrides.get("margin_ratio", self.margin.logit_ratio)),
            typical=TypicalConfig(
                overrides.get("typical_epsilon", self.typical.epsilon),
                overrides.get("typical_delta", self.typical.delta),
            ),
            guard=GuardConfig(tuple(dict.fromkeys(overrides.get("protect", self.guard.protect)))),
            draft_length=dataclasses.replace(
                self.draft_length, adaptive=overrides.get("adaptive_draft", self.draft_length.adaptive)
            ),
        )

    def describe(self) -> dict[str, Any]:
        """What ran, for the ``flyspec`` object in responses: the verifier's own parameters only."""
        described: dict[str, Any] = {
            "verifier": self.verifier,
            "lossless": self.lossless,
            "drafter": self.drafter,
            "num_draft_tokens": self.num_draft_tokens,
            "adaptive_draft": self.draft_length.adaptive,
        }
        if self.drafter == "stack":
            described["stack"] = list(self.stack)
        if self.verifier == "fly":
            described.update(
                window_size=self.fly.window_size,
                entropy_threshold=self.fly.entropy_threshold,
                fly_temperature_rule=self.fly.temperature_rule,
            )
        elif self.verifier == "margin":
            described["margin_ratio"] = self.margin.logit_ratio
        elif self.verifier == "typical":
            described.update(typical_epsilon=self.typical.epsilon, typical_delta=self.typical.delta)
        if not self.lossless:
            described["protect"] = list(self.guard.protect)
        return described

    def build_kwargs(self) -> dict[str, Any]:
        """:func:`flyspec.api.build_decoder` keyword arguments (besides target, draft model and config)."""
        return {
            "drafter": self.drafter,
            "verifier": self.verifier,
            "num_draft_tokens": self.num_draft_tokens,
            "fly": self.fly,
            "margin": self.margin,
            "typical": self.typical,
            "ngram": self.ngram,
            "num_ngram_tokens": self.num_ngram_tokens,
            "guard": self.guard,
            "draft_length": self.draft_length,
            "layer_skip": self.layer_skip,
            "ngram_cache": self.ngram_cache,
            "stack": self.stack,
        }


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask for, and how much the server takes on at once."""

    default_max_tokens: int = DEFAULT_MAX_NEW_TOKENS  # when a request gives no max_tokens
    max_tokens_cap: int = 2048  # a larger max_tokens is a 400 (not silently clamped)
    max_queue: int = 32  # requests waiting for the model besides the one generating; more → 429
    max_body_bytes: int = 1 << 20  # larger request bodies → 413
    retry_after_s: int = 1  # smallest Retry-After sent with a 429

    def __post_init__(self) -> None:
        _require(self.max_tokens_cap >= 1, f"max_tokens_cap must be >= 1 (got {self.max_tokens_cap})")
        _require(
            1 <= self.default_max_tokens <= self.max_tokens_cap,
            f"default_max_tokens must be in [1, max_tokens_cap={self.max_tokens_cap}] (got {self.default_max_tokens})",
        )
        _require(self.max_queue >= 0, f"max_queue must be >= 0 (got {self.max_queue}); 0 = no waiting requests")
        _require(self.max_body_bytes >= 1024, f"max_body_bytes must be >= 1024 (got {self.max_body_bytes})")
        _require(self.retry_after_s >= 1, f"retry_after_s must be >= 1 (got {self.retry_after_s})")
