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
Wilson interval
    For a rate (a count of yes out of ``n``, e.g. outputs whose meaning changed) the Wilson score
    interval: unlike ``p ± 1.96 sqrt(p(1-p)/n)`` it stays inside [0, 1] and is not zero-width when
    the count is 0 or ``n`` (0 of 200 gives [0, 0.019]).
floor
    With a small model a task's baseline score can be near zero, and a ratio of two tiny numbers
    says nothing. Below ``floor`` no retention is reported, only the absolute scores.
prompts as clusters
    Sampled (T > 0) each prompt is decoded under several seeds, and a prompt's outputs are not independent
    (a prompt where a rule changes one answer tends to change the others). A rate over outputs is then
    judged at its *effective* size ``n / deff``, the design effect ``deff`` being the ratio of the
    cluster-robust variance of the rate (the outputs' events summed per prompt) to the binomial one,
    clamped to [1, outputs per prompt]; with no event at all it is the number of prompts (as if a prompt's
    seeds were one output), so a seed never buys a tighter bound than a prompt would. One output per prompt
    (greedy) is ``deff = 1``. Retention's bootstrap resamples prompts, each with the mean of its seeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from statistics import NormalDist
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


def _percentile_interval(
    numerators: np.ndarray, denominators: np.ndarray, valid: np.ndarray, resamples: int, confidence: float
) -> tuple[float, float] | None:
    """Percentile interval of the resampled ratios; None when fewer than half the resamples have one."""
    if valid.sum() < resamples / 2:
        return None
    ratios = numerators[valid] / denominators[valid]
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return float(low), float(high)


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
    return _percentile_interval(method_means, baseline_means, valid, resamples, confidence)


def bootstrap_speedup_ci(
    method_tokens: Sequence[float],
    method_seconds: Sequence[float],
    plain_tokens: Sequence[float],
    plain_seconds: Sequence[float],
    *,
    resamples: int = DEFAULT_RESAMPLES,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float] | None:
    """Percentile interval of the speedup ``(Σ method tokens / Σ method s) / (Σ plain tokens / Σ plain s)``
    under a paired item bootstrap (the same resampled items for both; timing noise is per item)."""
    columns = [
        np.asarray(column, dtype=np.float64) for column in (method_tokens, method_seconds, plain_tokens, plain_seconds)
    ]
    if len({column.shape for column in columns}) != 1 or columns[0].ndim != 1:
        raise ValueError("the four columns must be paired 1-D sequences of the same length")
    if columns[0].size == 0:
        return None
    rng = np.random.default_rng(seed)
    indices = rng.integers(0, columns[0].size, size=(resamples, columns[0].size))  # [resamples, n]
    tokens_m, seconds_m, tokens_p, seconds_p = (column[indices].sum(axis=1) for column in columns)
    valid = (seconds_m > 0) & (seconds_p > 0) & (tokens_p > 0)
    rates_m, rates_p = tokens_m / np.where(valid, seconds_m, 1), tokens_p / np.where(valid, seconds_p, 1)
    return _percentile_interval(rates_m, rates_p, valid, resamples, confidence)


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


@dataclass(frozen=True)
class Rate:
    """``count`` of ``num_items`` with a Wilson 95% interval; ``rate`` etc. are None when ``num_items`` is 0."""

    count: int
    num_items: int
    rate: float | None
    low: float | None
    high: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def wilson_interval(count: float, total: float, confidence: float = 0.95) -> tuple[float, float] | None:
    """Wilson score interval of the proportion ``count / total``; None when ``total`` is 0. ``total`` may be an
    effective size (:func:`effective_size`), ``count`` then the rate times it."""
    if not 0 <= count <= total + 1e-9:
        raise ValueError(f"count must be in [0, total] (got {count} of {total})")
    if total == 0:
        return None
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    proportion = count / total
    denominator = 1 + z * z / total
    center = (proportion + z * z / (2 * total)) / denominator
    half_width = z * (proportion * (1 - proportion) / total + z * z / (4 * total * total)) ** 0.5 / denominator
    return max(0.0, center - half_width), min(1.0, center + half_width)


def rate(flags: Sequence[bool], confidence: float = 0.95, clusters: Sequence[Any] | None = None) -> Rate:
    """How many of ``flags`` are True, as a count, a rate and its Wilson interval; ``clusters`` (one label per
    flag: its prompt) judges it at its effective size (module docstring)."""
    count, total = sum(bool(flag) for flag in flags), len(flags)
    if total == 0:
        return Rate(0, 0, None, None, None)
    size = total if clusters is None else effective_size(cluster_counts(flags, clusters))
    interval = wilson_interval(count / total * size, size, confidence)
    assert interval is not None
    return Rate(count, total, count / total, *interval)


def cluster_counts(flags: Sequence[bool], clusters: Sequence[Any]) -> list[tuple[int, int]]:
    """``(events, outputs)`` per cluster, in first-seen order."""
    if len(flags) != len(clusters):
        raise ValueError("one cluster label per flag")
    counts: dict[Any, list[int]] = {}
    for flag, cluster in zip(flags, clusters, strict=True):
        entry = counts.setdefault(cluster, [0, 0])
        entry[0] += bool(flag)
        entry[1] += 1
    return [(events, outputs) for events, outputs in counts.values()]


def effective_size(counts: Sequence[tuple[int, int]]) -> float:
    """The effective number of outputs of a rate over clustered outputs: ``n / deff`` (module docstring)."""
    total = sum(outputs for _, outputs in counts)
    if total == 0:
        return 0.0
    largest = max(outputs for _, outputs in counts)
    if largest == 1:
        return float(total)  # one output per prompt: independent
    events = sum(events for events, _ in counts)
    if events in (0, total):  # no variance to estimate a design effect from: a prompt counts once
        return float(len(counts))
    share = events / total
    clusters = len(counts)
    robust = clusters / (clusters - 1) * sum((e - share * n) ** 2 for e, n in counts) / total**2
    binomial = share * (1 - share) / total
    design_effect = min(max(robust / binomial, 1.0), float(largest))
    return total / design_effect
