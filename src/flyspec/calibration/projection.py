"""Projected speed: what a point's counted steps cost on this machine, from measured costs.

A replayed generation's timings are not real (remembered answers are free), and timings on a
shared 2-core machine are noisy anyway, so a calibration counts and projects instead. For each
generation it counts how many tokens each target forward verified (``DecodeStats``'
``proposed_per_position`` gives the histogram) and how many draft tokens were proposed. Then

    decode time = Σ over forwards t(verified + 1)  +  c · draft tokens
    plain time  = t(1) · tokens
    projected speedup = plain time / decode time

with t(n) the target's measured forward cost (``runtime/step_cost.py``: measured once per model, dtype and
machine, and cached) and c the drafter's seconds per draft token, measured at the start of the
calibration by :func:`measure_draft_cost` (real drafts on the first prompts; about 0 for n-gram
lookups, about one target forward for a layer-skip view of a small model). The prefill is left out
of both: it is the same for every method and would only dilute the ratio. Engine overhead
(verification, bookkeeping) is left out too, so the projection is an upper bound a live run
approaches (``flyspec bench`` measures it).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from flyspec.config import SamplingConfig
from flyspec.drafters.base import Drafter
from flyspec.runtime.clock import device_clock
from flyspec.runtime.step_cost import StepCost

DRAFT_COST_ROUNDS = 3  # timed drafts per prompt, after one untimed


def verified_lengths(stats: dict[str, Any]) -> dict[int, int]:
    """``{draft tokens verified: forwards}`` of one generation, from its ``DecodeStats.to_dict()``."""
    proposed = list(stats.get("proposed_per_position", []))
    forwards = int(stats["num_target_forwards"])
    counts: dict[int, int] = {}
    previous = forwards
    for length, reached in enumerate(proposed):  # reached = forwards that verified more than `length` tokens
        if previous - reached:
            counts[length] = previous - reached
        previous = reached
    if previous:
        counts[len(proposed)] = previous
    return counts


@dataclass(frozen=True)
class CostModel:
    """The measured costs a projection uses."""

    step_cost: StepCost
    draft_seconds_per_token: float = 0.0

    def decode_seconds(self, stats: Iterable[dict[str, Any]]) -> float:
        """Projected seconds of the decode steps of these generations (prefill excluded)."""
        total = 0.0
        for record in stats:
            for length, forwards in verified_lengths(record).items():
                total += forwards * self.step_cost(length + 1)
            total += self.draft_seconds_per_token * record["num_proposed"]
        return total

    def plain_seconds(self, num_tokens: int) -> float:
        return self.step_cost(1) * num_tokens

    def speedup(self, stats: list[dict[str, Any]]) -> float | None:
        """Projected speedup over plain decoding of these generations; None without tokens."""
        tokens = sum(int(record["num_new_tokens"]) for record in stats)
        seconds = self.decode_seconds(stats)
        return self.plain_seconds(tokens) / seconds if tokens and seconds > 0 else None

    def to_dict(self) -> dict[str, Any]:
        relative = self.step_cost.relative()
        return {
            "t1_ms": 1000 * self.step_cost(1),
            "t_relative": {str(size): round(value, 3) for size, value in relative.items()},
            "draft_ms_per_token": 1000 * self.draft_seconds_per_token,
            "draft_relative_to_t1": self.draft_seconds_per_token / self.step_cost(1),
        }


def measure_draft_cost(
    drafter: Drafter,
    prompts: Sequence[list[int]],
    num_draft_tokens: int,
    target_step: Callable[[list[int]], float] | None = None,
) -> float:
    """Seconds per draft token: the median over a few real drafts on ``prompts`` (each draft continues
    the last as if the target had kept it all, so model drafters draft from a warm cache as in a run).

    With ``target_step`` (times one cached one-token target forward after the given ids), each draft is
    timed against a target step taken right beside it and the result is that median ratio, in units of
    t(1): a ratio measured in one moment survives a busy machine, an absolute time does not."""
    greedy = SamplingConfig()
    per_token: list[float] = []
    device = getattr(drafter, "device", None)  # a model drafter's: its forwards are waited for (runtime/clock.py)
    for prompt_ids in prompts:
        drafter.reset(list(prompt_ids))
        sequence = list(prompt_ids)
        for round_index in range(DRAFT_COST_ROUNDS + 1):
            started = device_clock(device)
            draft = drafter.propose(sequence, num_draft_tokens, greedy, None)
            seconds = device_clock(device) - started
            if not draft.num_tokens:
                break
            if round_index:  # the first draft of a prompt includes the drafter's prefill
                unit = target_step(sequence) if target_step is not None else 1.0
                per_token.append(seconds / draft.num_tokens / unit)
            sequence += draft.tokens.tolist()
            drafter.rollback(len(sequence))
    return statistics.median(per_token) if per_token else 0.0
