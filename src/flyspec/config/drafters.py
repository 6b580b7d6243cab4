"""The drafters' settings: one frozen dataclass per drafter option group, a field of
:class:`flyspec.config.SpeculationConfig` (``spec.ngram``, ``spec.draft_length``, ``spec.ngram_cache``,
``spec.layer_skip``), re-exported by :mod:`flyspec.config`.

Each validates itself in ``__post_init__`` and raises :class:`ConfigError` with a message that says what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from flyspec.config.mapping import ConfigError as ConfigError  # re-exported: raised by every config here
from flyspec.config.mapping import require as _require
from flyspec.config.names import DRAFT_LENGTH_POLICIES

NGRAM_MATCHES = ("recent", "earliest", "frequent")  # NgramConfig.match


@dataclass(frozen=True)
class NgramConfig:
    """Prompt lookup: match the last ``max_ngram`` .. ``min_ngram`` tokens earlier in the context.

    ``match``: which earlier occurrence to copy from — ``recent`` (the latest), ``earliest``
    (transformers' prompt lookup, the FLy reference) or ``frequent`` (the continuation most
    occurrences share); ``extend``: past the end of the context, copy on periodically.
    """

    max_ngram: int = 4
    min_ngram: int = 1
    match: str = "recent"
    extend: bool = True

    def __post_init__(self) -> None:
        _require(self.match in NGRAM_MATCHES, f"match must be one of {', '.join(NGRAM_MATCHES)} (got {self.match!r})")
        _require(self.min_ngram >= 1, f"min_ngram must be >= 1 (got {self.min_ngram})")
        _require(
            self.max_ngram >= self.min_ngram,
            f"max_ngram ({self.max_ngram}) must be >= min_ngram ({self.min_ngram})",
        )


@dataclass(frozen=True)
class DraftLengthConfig:
    """How many tokens to draft each step; ``num_draft_tokens`` is the most.

    ``policy``: ``cost`` (the most expected tokens per second), ``fixed``, ``heuristic``, or ``auto``
    (``cost`` under a lossless verifier — every drafter when greedy, n-gram drafters when sampling — else
    ``fixed``): see ``decoding/draft_length.py``.
    The adaptive policies stay within ``min_tokens`` .. ``num_draft_tokens`` (``cost`` may also draft
    nothing). ``confidence_threshold`` (model drafters): stop drafting once the draft model's own top
    probability falls below it (after keeping that token); 0 never stops early.
    """

    policy: str = "auto"
    min_tokens: int = 1
    confidence_threshold: float = 0.0

    def __post_init__(self) -> None:
        _require(
            self.policy in DRAFT_LENGTH_POLICIES,
            f"draft length policy must be one of {', '.join(DRAFT_LENGTH_POLICIES)} (got {self.policy!r})",
        )
        _require(self.min_tokens >= 1, f"min draft tokens must be >= 1 (got {self.min_tokens})")
        _require(
            0 <= self.confidence_threshold < 1,
            f"draft confidence threshold must be in [0, 1) (got {self.confidence_threshold}); 0 disables it",
        )


@dataclass(frozen=True)
class NgramCacheConfig:
    """The persistent n-gram cache (``ngram-cache`` drafter): at most ``max_entries`` n-grams, LRU-evicted."""

    max_entries: int = 200_000

    def __post_init__(self) -> None:
        _require(self.max_entries >= 1, f"ngram cache max_entries must be >= 1 (got {self.max_entries})")


@dataclass(frozen=True)
class LayerSkipConfig:
    """Layer-skip self-speculation: the target drafts for itself with some layers skipped.

    ``skip_layers=None`` chooses the layers by a short training-free calibration on the first
    prompt (see ``drafters/layer_skip.py``); a tuple skips exactly those 0-based layer indices.
    """

    skip_layers: tuple[int, ...] | None = None
    calibration_tokens: int = 64  # prompt tokens the calibration forward reads (the last ones)

    def __post_init__(self) -> None:
        _require(self.calibration_tokens >= 8, f"calibration_tokens must be >= 8 (got {self.calibration_tokens})")
        if self.skip_layers is not None:
            _require(
                all(layer >= 0 for layer in self.skip_layers),
                f"skip layers must be 0-based layer indices >= 0 (got {list(self.skip_layers)})",
            )
            _require(
                len(set(self.skip_layers)) == len(self.skip_layers),
                f"skip layers must not repeat (got {list(self.skip_layers)})",
            )
