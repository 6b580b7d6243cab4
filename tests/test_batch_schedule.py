"""Issue 37: the batch-size schedule (vLLM's num_speculative_tokens_per_batch_size) derived from measured throughput."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flyspec.config import ConfigError
from flyspec.config.schedule import BatchSchedule, compress, derive_schedule, interpolate


def test_a_schedule_reads_as_vllms_and_carries_the_last_range_forward() -> None:
    schedule = BatchSchedule.from_entries([[3, 8, 4], [1, 2, 8], [9, 64, 0]])  # sorted as vLLM sorts them
    assert schedule.to_vllm() == [[1, 2, 8], [3, 8, 4], [9, 64, 0]]
    assert [schedule.k_for(b) for b in (1, 2, 3, 8, 9, 64, 500)] == [8, 8, 4, 4, 0, 0, 0]
    assert schedule.describe() == "draft tokens: 8 at batch 1-2, 4 at batch 3-8, none at batch from 9"


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([[2, 4, 3]], "should start at 1"),
        ([[1, 4, 3], [6, 9, 0]], "should start at 5"),
        ([[1, 4, 3], [3, 9, 0]], "should start at 5"),
        ([[1, 4, -1]], "k >= 0"),
        ([[1, 4]], "[start, end, k]"),
        ([], "at least one"),
        ("1-4:3", "must be a list"),
    ],
)
def test_a_bad_schedule_is_refused_saying_what_is_wrong(entries: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        BatchSchedule.from_entries(entries)


def test_a_schedule_loads_from_its_file_or_a_profile_that_carries_one(tmp_path) -> None:
    own = tmp_path / "schedule.json"
    own.write_text(json.dumps({"num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 3, 0]]}))
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"schedule": {"num_speculative_tokens_per_batch_size": [[1, 1, 2]]}}))
    assert BatchSchedule.load(own).ranges == ((1, 2, 4), (3, 3, 0))
    assert BatchSchedule.load(profile).ranges == ((1, 1, 2),)
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ConfigError, match="has no num_speculative_tokens_per_batch_size"):
        BatchSchedule.load(tmp_path / "other.json")
    with pytest.raises(ConfigError, match="cannot read"):
        BatchSchedule.load(tmp_path / "missing.json")


def test_compress_and_interpolate() -> None:
    assert compress([8, 8, 4, 4, 4, 0]).ranges == ((1, 2, 8), (3, 5, 4), (6, 6, 0))
    points = {1: 1.4, 4: 1.0}
    assert interpolate(points, 1) == 1.4 and interpolate(points, 4) == 1.0 and interpolate(points, 64) == 1.0
    assert interpolate(points, 2) == pytest.approx(1.2)  # halfway in log batch size


def cost_model_throughput(batch: int, k: int) -> float:
    """A compute-bound engine: a step costs 10 + B·(k+1) units, each request commits 1 + 0.6·k^0.5 tokens."""
    return batch * (1 + 0.6 * k**0.5) / (10 + batch * (k + 1))


def test_derived_schedule_speculates_more_at_small_batches_and_stops_where_it_costs() -> None:
    batches, ks = (1, 2, 4, 8, 16, 32), (0, 2, 4, 8, 15)
    throughput = {k: {b: cost_model_throughput(b, k) for b in batches} for k in ks}
    schedule = derive_schedule(throughput, margin=0.0)
    per_batch = [schedule.k_for(b) for b in range(1, 33)]
    assert per_batch == sorted(per_batch, reverse=True)  # never more drafts at a bigger batch
    assert schedule.k_for(1) > 0 and schedule.k_for(32) == 0
    for b in batches:  # at every measured size the choice is the measured best
        assert throughput[schedule.k_for(b)][b] == max(throughput[k][b] for k in ks)


def test_a_gain_inside_the_margin_is_not_taken() -> None:
    throughput = {0: {1: 100.0, 8: 400.0}, 4: {1: 102.0, 8: 300.0}}
    assert derive_schedule(throughput, margin=0.03).ranges == ((1, 8, 0),)
    assert derive_schedule(throughput, margin=0.01).ranges[0] == (1, 1, 4)


def test_no_schedule_without_the_no_draft_figure() -> None:
    with pytest.raises(ConfigError, match="k = 0"):
        derive_schedule({4: {1: 10.0}})


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from([1, 2, 4, 8, 16]),
        st.tuples(*[st.floats(1.0, 500.0) for _ in range(4)]),
        min_size=1,
    ),
    st.floats(0.0, 0.1),
)
def test_at_every_measured_batch_size_the_schedule_is_never_slower_than_no_drafts(table, margin) -> None:
    ks = (0, 2, 4, 8)
    throughput = {k: {b: rates[i] for b, rates in table.items()} for i, k in enumerate(ks)}
    schedule = derive_schedule(throughput, margin)
    for b in table:
        chosen = schedule.k_for(b)
        assert throughput[chosen][b] >= throughput[0][b] * (1 + margin if chosen else 1)
