"""The lossy verification rules' settings: one frozen dataclass per rule, the field of its name in
:class:`flyspec.config.SpeculationConfig` (``spec.fly``, ``spec.margin``, ...), re-exported by :mod:`flyspec.config`.

Each validates itself in ``__post_init__`` and raises :class:`ConfigError` with a message that says what to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flyspec.config.mapping import ConfigError as ConfigError  # re-exported: raised by every config here
from flyspec.config.mapping import require as _require

FLY_VARIANTS = ("flyspec", "vllm")  # FlyConfig.variant: the reference code's window, or vLLM 0.33's native rule
FLY_TEMPERATURE_RULES = ("coupled", "rejection", "two-sample")  # FlyConfig.temperature_rule: the base rule at T > 0


@dataclass(frozen=True)
class FlyConfig:
    """FLy loose acceptance (arXiv 2511.22972). See ``verifiers/fly.py`` for the exact rule.

    ``window_size=0`` (no deferred window) and ``entropy_threshold=0`` (no entropy gate) are the
    paper's ablations. ``temperature_rule`` picks how T>0 is handled: ``"coupled"`` judges the draft
    against the target's coupled sample (plain sampling's token for the seed: ``sampling/coupled.py``);
    ``"rejection"`` applies the gate and window over speculative rejection sampling; ``"two-sample"`` is
    the reference code's rule (see ``verifiers/fly.py``). ``variant``: ``"flyspec"`` (the reference code's window: the
    ``W - 1`` draft tokens after a mismatch must match) or ``"vllm"`` (vLLM 0.33's native FLy: the ``W``
    tokens after it must match, the draft token needs a non-zero probability under the distribution the
    target samples from, and at T > 0 the entropy is that distribution's).
    """

    window_size: int = 6
    entropy_threshold: float = 0.3
    entropy_top_k: int = 3
    temperature_rule: str = "coupled"  # FLY_TEMPERATURE_RULES
    # a floor on the draft token's own target probability (temperature 1, full vocabulary): the FLy pull
    # request on vLLM (#53987) asks for a non-zero one; a calibration may find a higher one worth its τ
    min_draft_prob: float = 0.0
    variant: str = "flyspec"  # FLY_VARIANTS

    def __post_init__(self) -> None:
        _require(self.window_size >= 0, f"window_size must be >= 0 (got {self.window_size}); 0 disables it")
        _require(
            self.variant in FLY_VARIANTS, f"fly variant must be one of {', '.join(FLY_VARIANTS)} (got {self.variant!r})"
        )
        _require(
            self.variant != "vllm" or (self.window_size >= 1 and self.temperature_rule != "two-sample"),
            "the vllm variant needs window_size >= 1 and temperature_rule 'coupled' or 'rejection' (vLLM's native "
            "FLy at T > 0 is 'rejection')",
        )
        _require(
            0 <= self.min_draft_prob < 1,
            f"min_draft_prob must be in [0, 1) (got {self.min_draft_prob}); 0 keeps the paper's rule",
        )
        _require(
            math.isfinite(self.entropy_threshold) and self.entropy_threshold >= 0,
            f"entropy_threshold must be a finite number >= 0 (got {self.entropy_threshold}); 0 disables the gate",
        )
        _require(self.entropy_top_k >= 2, f"entropy_top_k must be >= 2 (got {self.entropy_top_k})")
        _require(
            self.temperature_rule in FLY_TEMPERATURE_RULES,
            f"temperature_rule must be one of {', '.join(FLY_TEMPERATURE_RULES)} (got {self.temperature_rule!r})",
        )


@dataclass(frozen=True)
class MarginConfig:
    """MARS margin-aware verification (arXiv 2601.15498).

    A mismatch is kept when the draft token is the target's second choice and the target's
    top-2 logits are close: ``z2 / z1 > logit_ratio`` when both are positive, otherwise (the
    ratio of logits is meaningless across zero) ``p2 / p1 = exp(z2 - z1) > logit_ratio``.
    """

    logit_ratio: float = 0.9

    def __post_init__(self) -> None:
        _require(0 < self.logit_ratio < 1, f"logit_ratio must be in (0, 1) (got {self.logit_ratio})")


@dataclass(frozen=True)
class TypicalConfig:
    """Medusa typical acceptance: keep a draft token if p_target(token) > min(epsilon, delta * exp(-H))."""

    epsilon: float = 0.09  # Medusa's posterior_threshold
    delta: float = 0.3  # Medusa's posterior_alpha

    def __post_init__(self) -> None:
        _require(0 < self.epsilon <= 1, f"epsilon must be in (0, 1] (got {self.epsilon})")
        _require(0 < self.delta <= 1, f"delta must be in (0, 1] (got {self.delta})")


@dataclass(frozen=True)
class BildConfig:
    """BiLD's rollback policy (arXiv 2302.07863): keep a mismatching draft token while the cross-entropy
    ``-log p_target(token)`` (nats, temperature 1) is at most ``rollback_threshold`` (the paper's ``α_RB``).
    The default is flyspec's (``p_target >= e^-2 ≈ 0.14``), not the paper's: the paper sweeps ``α_RB`` to trade
    quality for speed, as ``flyspec calibrate`` does."""

    rollback_threshold: float = 2.0

    def __post_init__(self) -> None:
        _require(
            math.isfinite(self.rollback_threshold) and self.rollback_threshold > 0,
            f"bild rollback_threshold must be a finite number > 0 (got {self.rollback_threshold}); "
            "larger keeps more mismatches",
        )


FSD_DIVERGENCES = ("js", "kl", "tv")  # FsdConfig.divergence


@dataclass(frozen=True)
class FsdConfig:
    """Fuzzy speculative decoding (arXiv 2502.20704): keep a mismatching draft token while the divergence between
    the target's and the draft model's next-token distributions there is at most ``threshold``. ``divergence``:
    ``js`` (Jensen-Shannon, nats, at most ln 2), ``kl`` (KL(draft || target), as the official code's ``kl_div``),
    ``tv`` (total variation, at most 1). Default: the official README's example, JS at 0.4."""

    divergence: str = "js"
    threshold: float = 0.4

    def __post_init__(self) -> None:
        _require(
            self.divergence in FSD_DIVERGENCES,
            f"fsd divergence must be one of {', '.join(FSD_DIVERGENCES)} (got {self.divergence!r})",
        )
        _require(
            math.isfinite(self.threshold) and self.threshold >= 0,
            f"fsd threshold must be a finite number >= 0 (got {self.threshold}); larger keeps more mismatches",
        )


# CascadeConfig.rule -> the range of its lenience α in which the rule is not already plain speculative decoding or
# the draft alone (the speculative-cascades authors' notebook, google-research/speculative_cascades)
CASCADE_RULES = {"chow": (0.0, 1.0), "diff": (-1.0, 1.0), "opt": (-math.inf, math.inf)}


@dataclass(frozen=True)
class CascadeConfig:
    """Speculative cascades' deferral rules (selective classification; arXiv 2405.19261). At each draft position
    the rule decides whether to *defer* to the target; where it does not, the draft model's token is kept.
    With the draft's and the target's distributions q and p (temperature 1) and ``lenience`` α: ``chow`` defers
    when ``max q < 1 - α``, ``diff`` when ``max q < max p - α``, ``opt`` when ``max q < max p - α·TV(p, q)``."""

    rule: str = "chow"
    lenience: float = 0.1

    def __post_init__(self) -> None:
        _require(
            self.rule in CASCADE_RULES, f"cascade rule must be one of {', '.join(CASCADE_RULES)} (got {self.rule!r})"
        )
        low, high = CASCADE_RULES.get(self.rule, (-math.inf, math.inf))
        _require(
            math.isfinite(self.lenience) and low <= self.lenience <= high,
            f"cascade lenience for rule {self.rule!r} must be a finite number in [{low:g}, {high:g}] "
            f"(got {self.lenience}); larger defers less",
        )


# AdasdConfig.scale: the threshold's place between the two means (0: the accepted tokens', 2: the rejected tokens')
ADASD_SCALE_RANGE = (0.0, 2.0)


@dataclass(frozen=True)
class AdasdConfig:
    """AdaSD's acceptance as flyspec reads it (arXiv 2512.11280; ``verifiers/adasd.py``). A mismatching draft token is
    kept while the Jensen-Shannon divergence (nats) between the target's and the draft's next-token distributions
    there is at most ``mean_accepted + scale * (mean_rejected - mean_accepted) / 2``, the running means of that
    divergence at the positions the exact rule accepted and rejected so far in this generation; the rule is exact
    until each class holds ``min_samples`` positions. ``scale`` 1 is the paper's midpoint; 0 keeps only mismatches as
    close as the accepted tokens' mean, 2 up to the rejected tokens' mean."""

    min_samples: int = 8
    scale: float = 1.0

    def __post_init__(self) -> None:
        _require(
            self.min_samples >= 1,
            f"adasd min_samples must be >= 1 (got {self.min_samples}): the threshold needs that many accepted and "
            "rejected positions of this generation; larger stays exact longer",
        )
        low, high = ADASD_SCALE_RANGE
        _require(
            math.isfinite(self.scale) and low <= self.scale <= high,
            f"adasd scale must be a number in [{low:g}, {high:g}] (got {self.scale}): 1 is the paper's midpoint "
            "between the accepted and rejected tokens' mean distances, larger keeps more mismatches",
        )


@dataclass(frozen=True)
class LenienceConfig:
    """Leviathan et al.'s lenience (arXiv 2211.17192, appendix A.5): ``q(x)`` is multiplied by ``lenience`` l
    before it is compared with ``p(x)``: a draft token is kept with probability ``min(1, p(x) / (l·q(x)))`` at
    T > 0, and greedy when ``p(x) >= l·max p``. ``lenience`` 1 is plain speculative decoding; smaller keeps more."""

    lenience: float = 0.5

    def __post_init__(self) -> None:
        _require(
            math.isfinite(self.lenience) and 0 < self.lenience <= 1,
            f"lenience must be in (0, 1] (got {self.lenience}); 1 is lossless, smaller keeps more",
        )
