"""How many tokens to speculate at each batch size, derived from measured throughput (vLLM's format).

Speculation spends compute that a lone request leaves idle. A batch uses that compute up: at batch B
each step verifies ``B·(k + 1)`` tokens instead of ``B``, and once the forward is compute-bound the
extra tokens cost more than the accepted drafts save. So the best draft length falls with the batch
size, to 0 (no drafts) where speculation stops paying.

A **schedule** is vLLM's ``num_speculative_tokens_per_batch_size``: inclusive batch-size ranges
``(start, end, k)``, sorted, the first starting at 1, ``k = 0`` meaning no drafts; a batch above the
last range keeps its ``k`` (vLLM carries it forward). vLLM 0.32's scheduler hands ``k`` to its own
proposers (``ngram``, ``suffix``, EAGLE, ...); flyspec's proposer (``flyspec_vllm.NgramProposer``)
reads the same schedule itself, from ``speculative_config`` or ``$FLYSPEC_VLLM_SCHEDULE``.

:func:`derive_schedule` makes one from a sweep measured on one engine in one run: total tokens/s at
each batch size for each draft length (0 included). At each batch size from 1 to the largest
measured, each ``k``'s throughput *relative to k = 0* is interpolated (linear in log batch size)
between the measured sizes, and the best ``k`` wins only if it beats no drafts by more than
``margin`` (the sweep's noise): within what was measured, never slower than not speculating.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flyspec.config import ConfigError

VLLM_KEY = "num_speculative_tokens_per_batch_size"
DEFAULT_MARGIN = 0.03  # a draft length must beat no drafts by 3 % (two runs of one point differ by ~1-2 % here)

Ranges = tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class BatchSchedule:
    """Draft tokens per batch-size range (vLLM's ``num_speculative_tokens_per_batch_size``)."""

    ranges: Ranges

    def __post_init__(self) -> None:
        previous_end = 0
        for start, end, k in self.ranges:
            if not (0 < start <= end) or k < 0:
                raise ConfigError(f"batch schedule range {(start, end, k)}: need 1 <= start <= end and k >= 0")
            if start != previous_end + 1:
                raise ConfigError(
                    f"batch schedule: range {(start, end, k)} should start at {previous_end + 1} (ranges are sorted, "
                    "contiguous and start at batch size 1)"
                )
            previous_end = end
        if not self.ranges:
            raise ConfigError("batch schedule: give at least one (start, end, k) range starting at 1")

    def k_for(self, batch_size: int) -> int:
        """Draft tokens at this batch size (above the last range: the last range's)."""
        for start, end, k in self.ranges:
            if start <= batch_size <= end:
                return k
        return self.ranges[-1][2]

    def to_vllm(self) -> list[list[int]]:
        """The value of vLLM's ``speculative_config["num_speculative_tokens_per_batch_size"]``."""
        return [list(entry) for entry in self.ranges]

    def describe(self) -> str:
        """``k = 8 at batch 1-2, 4 at 3-6, none from 7``."""
        parts = []
        for index, (start, end, k) in enumerate(self.ranges):
            what = f"{k}" if k else "none"
            span = f"from {start}" if index == len(self.ranges) - 1 else f"{start}-{end}" if end > start else f"{start}"
            parts.append(f"{what} at batch {span}")
        return "draft tokens: " + ", ".join(parts)

    def save(self, path: Path, measured: Mapping[str, Any], method: str | None) -> Path:
        """A schedule file (``schedule.json``: what ``--schedule`` and ``$FLYSPEC_VLLM_SCHEDULE`` read): the
        schedule in vLLM's key, in words, where it was measured and how."""
        payload: dict[str, Any] = {VLLM_KEY: self.to_vllm(), "description": self.describe(), "measured": dict(measured)}
        payload["method"] = method
        path.write_text(json.dumps(payload, indent=1), encoding="utf-8")
        return path

    @classmethod
    def from_entries(cls, entries: Any) -> BatchSchedule:
        """From vLLM's list of ``[start, end, k]`` entries (validated as vLLM does, sorted by start)."""
        if not isinstance(entries, Sequence) or isinstance(entries, str | bytes):
            raise ConfigError(f"{VLLM_KEY} must be a list of [start, end, k] entries, not {type(entries).__name__}")
        try:
            ranges = tuple(sorted((int(a), int(b), int(c)) for a, b, c in entries))
        except (TypeError, ValueError) as error:
            raise ConfigError(f"{VLLM_KEY}: every entry is [start, end, k] of integers ({error})") from None
        return cls(ranges)

    @classmethod
    def load(cls, path: str | Path) -> BatchSchedule:
        """From a schedule file (``flyspec bench --concurrency ... --derive-schedule``'s schedule.json) or a profile
        that carries one: the ``num_speculative_tokens_per_batch_size`` key at its top level or under ``schedule``."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            raise ConfigError(f"cannot read the batch schedule {path}: {error}") from None
        holder = data.get("schedule", data) if isinstance(data, Mapping) else None
        if not isinstance(holder, Mapping) or VLLM_KEY not in holder:
            raise ConfigError(
                f"{path} has no {VLLM_KEY} (make one with `flyspec bench --concurrency ... --derive-schedule`)"
            )
        return cls.from_entries(holder[VLLM_KEY])


def compress(per_batch: Sequence[int]) -> BatchSchedule:
    """The ranges of a dense ``k`` per batch size (``per_batch[0]`` is batch 1)."""
    ranges: list[tuple[int, int, int]] = []
    for batch_size, k in enumerate(per_batch, start=1):
        if ranges and ranges[-1][2] == k:
            ranges[-1] = (ranges[-1][0], batch_size, k)
        else:
            ranges.append((batch_size, batch_size, k))
    return BatchSchedule(tuple(ranges))


def relative_throughput(throughput: Mapping[int, Mapping[int, float]]) -> dict[int, dict[int, float]]:
    """Each ``k``'s tokens/s over no drafts' (``k = 0``) at each batch size measured for both."""
    if 0 not in throughput:
        raise ConfigError("a batch schedule needs the no-draft throughput (k = 0) measured in the same sweep")
    plain = throughput[0]
    return {
        k: {batch: rate / plain[batch] for batch, rate in rates.items() if plain.get(batch, 0) > 0}
        for k, rates in throughput.items()
        if k > 0
    }


def interpolate(points: Mapping[int, float], batch_size: int) -> float:
    """Linear in log batch size between measured points; the nearest measured value outside them."""
    sizes = sorted(points)
    if batch_size <= sizes[0]:
        return points[sizes[0]]
    if batch_size >= sizes[-1]:
        return points[sizes[-1]]
    upper = next(size for size in sizes if size >= batch_size)
    lower = max(size for size in sizes if size <= batch_size)
    if upper == lower:
        return points[lower]
    weight = (math.log(batch_size) - math.log(lower)) / (math.log(upper) - math.log(lower))
    return points[lower] + weight * (points[upper] - points[lower])


def derive_schedule(throughput: Mapping[int, Mapping[int, float]], margin: float = DEFAULT_MARGIN) -> BatchSchedule:
    """The schedule a sweep supports: ``throughput[k][batch]`` = total tokens/s with at most ``k`` draft tokens per
    request at that batch size (``k = 0``: none), measured on one engine in one run (module docstring)."""
    if margin < 0:
        raise ConfigError(f"the schedule's margin must be >= 0 (got {margin})")
    relative = {k: points for k, points in relative_throughput(throughput).items() if points}
    largest = max(max(points) for points in throughput.values() if points)
    chosen = []
    for batch_size in range(1, largest + 1):
        gains = {k: interpolate(points, batch_size) for k, points in relative.items()}
        best = max(gains, key=lambda k: (gains[k], -k), default=0)
        chosen.append(best if best and gains[best] > 1 + margin else 0)
    return compress(chosen)
