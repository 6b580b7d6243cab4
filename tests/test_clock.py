"""Clock reads around device work wait for the device (issue 39): a stand-in device whose work completes late.

``LateDevice`` behaves as CUDA does for timing: launching work returns at once, the work finishes
``seconds`` later, and only ``synchronize`` waits for it. Registered as the "cuda" synchroniser, it
makes every flyspec timer that brackets device work show whether it waits: one that reads the clock
without synchronising measures ~0 s here.
"""

from __future__ import annotations

import time

import pytest
import torch

from flyspec.calibration.projection import measure_draft_cost
from flyspec.calibration.replay import DraftStore
from flyspec.config import SamplingConfig
from flyspec.decoding.stats import DecodeStats
from flyspec.runtime import clock
from flyspec.types import Draft

WORK_S = 0.05
CUDA = torch.device("cuda")  # a device description only: nothing is allocated on it


class LateDevice:
    def __init__(self) -> None:
        self.done_at = 0.0
        self.waits = 0

    def launch(self, seconds: float = WORK_S) -> None:
        self.done_at = max(self.done_at, time.perf_counter()) + seconds

    def synchronize(self, device: torch.device) -> None:
        self.waits += 1
        time.sleep(max(0.0, self.done_at - time.perf_counter()))


@pytest.fixture
def late(monkeypatch) -> LateDevice:
    device = LateDevice()
    monkeypatch.setitem(clock.SYNCHRONIZERS, "cuda", device.synchronize)
    return device


def test_a_phase_timer_includes_the_devices_late_work(late: LateDevice) -> None:
    stats = DecodeStats()
    with stats.timing("target", CUDA):
        late.launch()
    assert stats.target_time_s >= WORK_S and late.waits == 2  # before (earlier work) and after the block


def test_work_queued_before_a_phase_is_not_charged_to_it(late: LateDevice) -> None:
    stats = DecodeStats()
    late.launch()  # e.g. the target's forward, still running
    with stats.timing("draft", CUDA):
        pass
    assert stats.draft_time_s < WORK_S / 2


def test_the_cpu_is_not_synchronised_and_needs_not_be(late: LateDevice) -> None:
    with DecodeStats().timing("target", torch.device("cpu")):
        pass
    assert late.waits == 0
    clock.synchronize(None)
    clock.synchronize("cpu")
    assert late.waits == 0


class LateDrafter:
    """A model drafter on the stand-in device: each propose queues WORK_S of forwards and returns at once."""

    name = "late"
    device = CUDA

    def __init__(self, late: LateDevice) -> None:
        self.late = late

    def reset(self, prompt_ids: list[int]) -> None:
        """Nothing to reset."""

    def propose(self, token_ids, num_draft_tokens, sampling, generator) -> Draft:  # noqa: ANN001
        self.late.launch()
        return Draft(torch.arange(num_draft_tokens, dtype=torch.long))

    def rollback(self, num_committed: int) -> None:
        """Stateless."""


def test_a_drafts_measured_cost_includes_its_late_forwards(late: LateDevice) -> None:
    per_token = measure_draft_cost(LateDrafter(late), [[1, 2, 3]], num_draft_tokens=5)  # type: ignore[arg-type]
    assert per_token >= WORK_S / 5


def test_calibrations_draft_store_times_late_forwards(late: LateDevice) -> None:
    store = DraftStore(LateDrafter(late))  # type: ignore[arg-type]
    store.begin([1, 2, 3])
    store.propose([1, 2, 3], 4, SamplingConfig(), None)
    assert store.seconds >= WORK_S
