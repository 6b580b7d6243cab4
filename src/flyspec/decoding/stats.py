"""Per-generation statistics: τ, acceptance by draft position, loose accepts, speed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

from flyspec.runtime.clock import device_clock
from flyspec.types import PREDICTION, Verdict


@dataclass
class DecodeStats:
    """Counters for one generation. ``observe`` is called once per target forward."""

    num_target_forwards: int = 0
    num_proposed: int = 0  # draft tokens proposed
    num_accepted: int = 0  # draft tokens kept (loose accepts included)
    num_loose_accepts: int = 0
    num_new_tokens: int = 0  # committed (after EOS / stop / length truncation)
    # draft tokens from the request's prediction (OpenAI's Predicted Outputs; drafters/prediction.py) that the
    # target scored: kept (accepted, loose accepts included) or not (rejected: computed, so counted)
    num_accepted_prediction_tokens: int = 0
    num_rejected_prediction_tokens: int = 0
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    wall_time_s: float = 0.0  # prefill included
    time_to_first_token_s: float | None = None  # from the loop's start to its first committed token (prefill included)
    prefill_time_s: float = 0.0
    num_reused_prompt_tokens: int = 0  # prompt tokens taken from the decoder's cache, not prefilled (runtime/target.py)
    target_time_s: float = 0.0  # in target verification forwards (after prefill)
    draft_time_s: float = 0.0  # in Drafter.propose (model forwards for model drafters, lookups for n-gram)
    requested_draft_lengths: dict[int, int] = field(default_factory=dict)  # draft length asked for → steps
    drafter: dict[str, Any] = field(default_factory=dict)  # Drafter.report() at the end of the generation
    # every committed loose accept, explained (types.LooseAccept + "index" into the output; texts added at the end)
    loose_accepts: list[dict[str, Any]] = field(default_factory=list)
    guard_vetoes: dict[str, int] = field(default_factory=dict)  # trust guard → loose accepts it refused
    breaker_tripped_at: int | None = None  # output index where the circuit breaker turned loose acceptance off
    # the lossy settings' measured sampling, when this generation was decoded outside it and so verified exactly
    # (config.SamplingRange: a profile's loose accepts hold only where it measured them); None: as configured
    exact_outside_sampling_range: str | None = None
    # True when this generation's prediction made it exact: its profile measured no predicted work (SamplingRange)
    exact_with_prediction: bool = False

    @contextmanager
    def timing(
        self, phase: Literal["prefill", "draft", "target"], device: torch.device | None = None
    ) -> Iterator[None]:
        """Add the time spent in the block to ``<phase>_time_s``.

        On an asynchronous ``device`` (CUDA, XPU, MPS) the work queued before the block and the block's own
        are waited for (``runtime/clock.py``), so the time is the phase's and not only its launch.
        """
        started = device_clock(device)
        try:
            yield
        finally:
            name = f"{phase}_time_s"
            setattr(self, name, getattr(self, name) + device_clock(device) - started)

    def observe(
        self,
        num_proposed: int,
        verdict: Verdict | None,
        num_committed: int,
        requested: int | None = None,
        sources: tuple[str, ...] | None = None,
    ) -> None:
        """Record one target forward that proposed ``num_proposed`` drafts (``requested`` asked for; ``sources``:
        each draft token's provenance, ``types.SOURCES``)."""
        self.num_target_forwards += 1
        if requested is not None:
            self.requested_draft_lengths[requested] = self.requested_draft_lengths.get(requested, 0) + 1
        self.num_proposed += num_proposed
        offset = self.num_new_tokens  # output index of this step's first token
        self.num_new_tokens += num_committed
        if verdict is None:  # plain decoding step
            return
        for loose in verdict.loose:
            if loose.position < num_committed:
                self.loose_accepts.append({"index": offset + loose.position, **asdict(loose)})
        for reason in verdict.vetoes:
            self.guard_vetoes[reason] = self.guard_vetoes.get(reason, 0) + 1
        # Only what was committed counts: EOS / stop / length may cut a verdict short.
        accepted = min(verdict.num_accepted, num_committed)
        self.num_accepted += accepted
        if sources is not None and PREDICTION in sources:
            kept = sources[:accepted].count(PREDICTION)
            self.num_accepted_prediction_tokens += kept
            self.num_rejected_prediction_tokens += sources.count(PREDICTION) - kept
        self.num_loose_accepts += sum(position < num_committed for position in verdict.loose_positions)
        _grow(self.proposed_per_position, num_proposed)
        _grow(self.accepted_per_position, num_proposed)
        for position in range(num_proposed):
            self.proposed_per_position[position] += 1
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """τ: tokens committed per target forward, bonus/recovered token included (plain decoding = 1)."""
        return self.num_new_tokens / self.num_target_forwards if self.num_target_forwards else 0.0

    @property
    def mean_requested_draft_length(self) -> float:
        """The mean draft length asked of the drafter (constant unless the length is adaptive)."""
        steps = sum(self.requested_draft_lengths.values())
        return sum(length * count for length, count in self.requested_draft_lengths.items()) / steps if steps else 0.0

    @property
    def loose_accepts_by_source(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for record in self.loose_accepts:
            counts[record["source"]] = counts.get(record["source"], 0) + 1
        return dict(sorted(counts.items()))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def other_time_s(self) -> float:
        """Engine time outside prefill, target forwards and drafting: verification, commit, rollback, stop checks."""
        return max(0.0, self.wall_time_s - self.prefill_time_s - self.target_time_s - self.draft_time_s)

    @property
    def tokens_per_s(self) -> float:
        return self.num_new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_new_tokens": self.num_new_tokens,
            "num_target_forwards": self.num_target_forwards,
            "num_proposed": self.num_proposed,
            "num_accepted": self.num_accepted,
            "num_loose_accepts": self.num_loose_accepts,
            "num_accepted_prediction_tokens": self.num_accepted_prediction_tokens,
            "num_rejected_prediction_tokens": self.num_rejected_prediction_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "accepted_per_position": list(self.accepted_per_position),
            "proposed_per_position": list(self.proposed_per_position),
            "requested_draft_lengths": {
                str(length): count for length, count in sorted(self.requested_draft_lengths.items())
            },
            "mean_requested_draft_length": self.mean_requested_draft_length,
            "drafter_stats": dict(self.drafter),
            "loose_accepts": [dict(record) for record in self.loose_accepts],
            "loose_accepts_by_source": self.loose_accepts_by_source,
            "guard_vetoes": dict(sorted(self.guard_vetoes.items())),
            "breaker_tripped_at": self.breaker_tripped_at,
            "exact_outside_sampling_range": self.exact_outside_sampling_range,
            "exact_with_prediction": self.exact_with_prediction,
            "wall_time_s": self.wall_time_s,
            "time_to_first_token_s": self.time_to_first_token_s,
            "prefill_time_s": self.prefill_time_s,
            "num_reused_prompt_tokens": self.num_reused_prompt_tokens,
            "target_time_s": self.target_time_s,
            "draft_time_s": self.draft_time_s,
            "other_time_s": self.other_time_s,
            "tokens_per_s": self.tokens_per_s,
        }


def _grow(counts: list[int], length: int) -> None:
    counts.extend([0] * (length - len(counts)))
