"""The quality budget a user sets, the bounds a calibration measures against it, and the choice it makes.

budget
    How much a lossy rule may change, as rates over the calibration prompts: the share of outputs
    whose meaning changed (``eval/trust.py``: numbers or identifiers differ from plain decoding's),
    the share with a new loop, and the retention of the task score (``eval/stats.py``). Default:
    at most 1 % changed, at most 1 % looping, retention at least 0.99.
bound
    A point is inside the budget only when the *one-sided* confidence bound is: the Wilson upper
    bound of each rate and the paired-bootstrap lower bound of retention, at ``confidence`` (95 %).
    A one-sided 95 % bound is the end of a two-sided 90 % interval. With no change at all in ``n``
    outputs the upper bound is about ``2.7 / n``, so a 1 % budget needs at least 268 prompts before
    any point can pass (:func:`min_items`); fewer is not an error, but nothing will be chosen.
decisive
    A point with at least ``DECISIVE_EVENTS`` (3) changed (or looping) outputs whose one-sided 99 %
    lower bound is already above the budget cannot come back inside it: the calibration stops
    running it (``runner.py``). Stopping early only ever drops points, it never accepts one, so
    looking at the bounds after every prompt cannot let a bad point through; the stricter level and
    the three events keep it from dropping a good point on an unlucky start (simulated over 400
    prompts: a point whose true rate is half the budget is stopped in about 1.4 % of runs, one at
    the budget in 11 %, one at twice the budget in 59 %; ``tests/test_calibrate.py``).
prompts as clusters
    Sampled, each prompt is decoded under several seeds (and temperatures): a rate's bounds are then taken at its
    effective size (``eval/stats.py``: the outputs over the design effect of their prompts, never more than the
    outputs, and the number of prompts when nothing happened), so a 1 % budget still needs 268 prompts, whatever
    the seeds; each temperature is judged on its own, and a point is inside only where it is inside at every one.
chosen point
    The in-budget point, measured on every prompt, with the highest projected speedup, provided it
    is at least 1 % faster than the best lossless setting measured beside it (``frontier.MIN_GAIN``:
    a lossy point faster by a rounding error is not worth its risk); otherwise none (use ``exact``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Any

from flyspec.config import ConfigError
from flyspec.eval.stats import bootstrap_ratio_ci, wilson_interval

DEFAULT_BUDGET = 0.01
DEFAULT_CONFIDENCE = 0.95
DECISIVE_CONFIDENCE = 0.99  # an early stop's lower bound (stricter than the budget's own bound)
DECISIVE_EVENTS = 3  # ... and it needs this many events


@dataclass(frozen=True)
class Budget:
    """Limits on what a lossy rule may change (rates in (0, 1)), judged at one-sided ``confidence``."""

    max_meaning_change: float = DEFAULT_BUDGET
    max_loop: float = DEFAULT_BUDGET
    min_retention: float = 1 - DEFAULT_BUDGET
    confidence: float = DEFAULT_CONFIDENCE

    def __post_init__(self) -> None:
        for name in ("max_meaning_change", "max_loop", "min_retention"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 < value < 1):
                raise ConfigError(f"budget {name} must be a number in (0, 1) (got {value!r}); e.g. 0.01 for 1 %")
        if not 0.5 <= self.confidence < 1:
            raise ConfigError(f"budget confidence must be in [0.5, 1) (got {self.confidence!r}); e.g. 0.95")

    @staticmethod
    def of(rate: float, confidence: float = DEFAULT_CONFIDENCE) -> Budget:
        """The one-number budget: at most ``rate`` changed or looping, retention at least ``1 - rate``."""
        if not (isinstance(rate, int | float) and 0 < rate < 1):
            raise ConfigError(f"--budget must be a rate in (0, 1) (got {rate!r}); e.g. 0.01 for 1 % of answers")
        return Budget(rate, rate, 1 - rate, confidence)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(record: dict[str, Any]) -> Budget:
        return Budget(**{key: record[key] for key in ("max_meaning_change", "max_loop", "min_retention", "confidence")})


def _two_sided(confidence: float) -> float:
    """The two-sided level whose ends are one-sided bounds at ``confidence``."""
    return 2 * confidence - 1


def upper_bound(count: int, total: int, confidence: float = DEFAULT_CONFIDENCE, size: float | None = None) -> float:
    """One-sided Wilson upper bound of ``count / total`` (1.0 when nothing was measured), at the effective ``size``
    (default ``total``: independent outputs)."""
    interval = _interval(count, total, confidence, size)
    return 1.0 if interval is None else interval[1]


def lower_bound(count: int, total: int, confidence: float = DEFAULT_CONFIDENCE, size: float | None = None) -> float:
    """One-sided Wilson lower bound of ``count / total`` (0.0 when nothing was measured), at the effective ``size``."""
    interval = _interval(count, total, confidence, size)
    return 0.0 if interval is None else interval[0]


def _interval(count: int, total: int, confidence: float, size: float | None) -> tuple[float, float] | None:
    if size is None or total == 0:
        return wilson_interval(count, total, _two_sided(confidence))
    return wilson_interval(count / total * size, size, _two_sided(confidence))


def retention_lower_bound(
    method: list[float], plain: list[float], confidence: float = DEFAULT_CONFIDENCE, resamples: int = 2000
) -> float | None:
    """One-sided paired-bootstrap lower bound of ``mean(method) / mean(plain)``; None without a ratio."""
    if not method or sum(plain) <= 0:
        return None
    if method == plain:  # identical scores: every resample's ratio is 1
        return 1.0
    interval = bootstrap_ratio_ci(method, plain, resamples=resamples, confidence=_two_sided(confidence))
    return None if interval is None else interval[0]


def decisively_above(count: int, total: int, limit: float, size: float | None = None) -> bool:
    """``count`` of ``total`` is surely a rate above ``limit``: enough events, and the 99 % lower bound above it."""
    return count >= DECISIVE_EVENTS and lower_bound(count, total, DECISIVE_CONFIDENCE, size) > limit


def min_items(rate: float, confidence: float = DEFAULT_CONFIDENCE) -> int:
    """The fewest outputs whose Wilson upper bound with no event at all is within ``rate``: below it nothing passes."""
    z = NormalDist().inv_cdf(confidence)
    # upper bound with 0 events is z^2 / (n + z^2)
    return max(1, math.ceil(z * z * (1 - rate) / rate))


@dataclass(frozen=True)
class Verdict:
    """A point's standing against the budget: ``inside``, ``outside`` (decided), or ``open`` (not yet either)."""

    status: str  # inside | outside | open
    reasons: tuple[str, ...] = ()


def judge(
    budget: Budget,
    *,
    changed: int,
    looped: int,
    total: int,
    retention_low: float | None,
    finished: bool,
    refusals_low: float | None = None,
    changed_size: float | None = None,
    looped_size: float | None = None,
    label: str = "",
) -> Verdict:
    """Where a point stands after ``total`` outputs (``finished``: it ran every calibration prompt); the sizes are
    the rates' effective sizes (prompts as clusters: default ``total``), ``label`` the sampling the reasons name."""
    at = f" ({label})" if label else ""
    reasons = []
    if decisively_above(changed, total, budget.max_meaning_change, changed_size):
        reasons.append(f"meaning changed in {changed} of {total}{at} (surely above {budget.max_meaning_change:.1%})")
    if decisively_above(looped, total, budget.max_loop, looped_size):
        reasons.append(f"looped in {looped} of {total}{at} (surely above {budget.max_loop:.1%})")
    if reasons:
        return Verdict("outside", tuple(reasons))
    if not finished:
        return Verdict("open")
    misses = []
    upper = upper_bound(changed, total, budget.confidence, changed_size)
    if upper > budget.max_meaning_change:
        misses.append(
            f"meaning changed in {changed} of {total}{at} (bound {upper:.2%} > {budget.max_meaning_change:.1%})"
        )
    upper = upper_bound(looped, total, budget.confidence, looped_size)
    if upper > budget.max_loop:
        misses.append(f"looped in {looped} of {total}{at} (bound {upper:.2%} > {budget.max_loop:.1%})")
    if retention_low is not None and retention_low < budget.min_retention:
        misses.append(f"retention bound {retention_low:.3f}{at} < {budget.min_retention:.3f}")
    if refusals_low is not None and refusals_low < budget.min_retention:  # the safety task's refusals kept
        misses.append(f"refusals kept bound {refusals_low:.3f}{at} < {budget.min_retention:.3f}")
    return Verdict("outside", tuple(misses)) if misses else Verdict("inside")
