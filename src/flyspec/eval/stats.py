"""Retention and its uncertainty: a paired bootstrap over items.

retention
    ``mean(method scores) / mean(baseline scores)`` over the same items: 1.0 means the lossy
    method kept all of plain decoding's quality, 0.99 is the FLy paper's "≥ 99%" claim.
paired bootstrap
    Resample the *items* with replacement (the same indices for both columns, which keeps the
    pairing: an item that is hard for the baseline is hard for the method too), recompute the
    ratio of means, and take the 2.5th and 97.5th percentiles of the resampled ratios (percentile
    interval). Resamples whose baseline mean is 0 have no ratio and are dropped; when fewer than
    half remain the interval is reported as unavailable.
floor
    With a small model a task's baseline score can be near zero, and a ratio of two tiny numbers
    says nothing. Below ``floor`` no retention is reported, only the absolute scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

DEFAULT_RESAMPLES = 2000
DEFAULT_FLOOR = 0.05


@dataclass(frozen=True)
class Retention:
    """Absolute scores, the retention ratio and its bootstrap confidence interval for one metric."""

    num_items: int
    baseline_score: float
    method_score: float
    retention: float | None  # None when the baseline is below the floor (or zero)
    low: float | None
    high: float | None
    below_floor: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def bootstrap_ratio_ci(
    method: Sequence[float],
    baseline: Sequence[float],
    *,
    resamples: int = DEFAULT_RESAMPLES,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float] | None:
    """Percentile interval of ``mean(method) / mean(baseline)`` under a paired item bootstrap."""
    method_scores = np.asarray(method, dtype=np.float64)  # [n]
    baseline_scores = np.asarray(baseline, dtype=np.float64)  # [n]
    if method_scores.shape != baseline_scores.shape or method_scores.ndim != 1:
        raise ValueError("method and baseline scores must be paired 1-D sequences of the same length")
    if method_scores.size == 0:
        return None
    rng = np.random.default_rng(seed)
    indices = rng.integers(0, method_scores.size, size=(resamples, method_scores.size))  # [resamples, n]
    method_means = method_scores[indices].mean(axis=1)
    baseline_means = baseline_scores[indices].mean(axis=1)
    valid = baseline_means > 0
    if valid.sum() < resamples / 2:
        return None
    ratios = method_means[valid] / baseline_means[valid]
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return float(low), float(high)


def retention(
    method: Sequence[float],
    baseline: Sequence[float],
    *,
    floor: float = DEFAULT_FLOOR,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> Retention:
    """Retention of ``method`` against ``baseline`` (paired per item), with a 95% bootstrap interval."""
    num_items = len(method)
    baseline_score = float(np.mean(baseline)) if num_items else 0.0
    method_score = float(np.mean(method)) if num_items else 0.0
    below_floor = baseline_score < floor or baseline_score <= 0
    if below_floor:
        return Retention(num_items, baseline_score, method_score, None, None, None, True)
    interval = bootstrap_ratio_ci(method, baseline, resamples=resamples, seed=seed)
    low, high = interval if interval is not None else (None, None)
    return Retention(num_items, baseline_score, method_score, method_score / baseline_score, low, high, False)
