"""BiLD's rollback policy (verifiers/bild.py): hand-built target probabilities → the exact Verdict, and the rule's
plumbing (flags, requests, profiles, calibration grid, the vLLM plugin's candidates)."""

from __future__ import annotations

import math

import pytest
import torch

from flyspec.calibration.space import points
from flyspec.cli.speculation import FLAG_NAMES
from flyspec.config import BildConfig, ConfigError, GuardConfig, SamplingConfig, SpeculationConfig
from flyspec.profiles import looser
from flyspec.sampling.coupled import Draws
from flyspec.server.settings import describe, for_request
from flyspec.types import Draft, Verdict
from flyspec.verifiers.bild import BildVerifier, rollback_distance
from flyspec.verifiers.registry import make_verifier

BARE = GuardConfig.bare()
GREEDY = SamplingConfig()
RUNNER_UP = [0.5, 0.3, 0.15, 0.05]  # token 1: -log 0.3 = 1.204 nats; token 2: 1.897; token 3: 2.996
CERTAIN = [0.97, 0.01, 0.01, 0.01]


def logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows).log()  # [k + 1, vocab]


def draft(*tokens: int) -> Draft:
    return Draft(torch.tensor(tokens, dtype=torch.long))


def bild(threshold: float) -> BildVerifier:
    return BildVerifier(BildConfig(rollback_threshold=threshold), guard=BARE)


def test_rollback_distance_is_the_cross_entropy_of_the_draft_token() -> None:
    distance = rollback_distance(torch.tensor([1, 3]), logits(RUNNER_UP, RUNNER_UP, CERTAIN))
    assert distance.tolist() == pytest.approx([-math.log(0.3), -math.log(0.05)], abs=1e-5)


@pytest.mark.parametrize(
    ("token", "threshold", "kept"),
    [(1, 1.3, True), (1, 1.1, False), (2, 2.0, True), (2, 1.8, False), (3, 2.0, False), (3, 3.1, True)],
)
def test_a_mismatch_is_kept_exactly_while_its_distance_is_within_the_threshold(
    token: int, threshold: float, kept: bool
) -> None:
    verdict = bild(threshold).verify(draft(token, 0), logits(RUNNER_UP, CERTAIN, CERTAIN), GREEDY, None)
    if kept:
        assert verdict.tokens == [token, 0, 0] and verdict.loose_positions == (0,) and verdict.bonus
        assert verdict.loose[0].evidence == pytest.approx(-math.log(RUNNER_UP[token]), abs=1e-5)
        assert verdict.loose[0].target_token == 0
    else:  # rolled back: the target's own token is committed there
        assert verdict == Verdict(tokens=[0], num_accepted=0)


def test_matches_are_kept_and_the_first_rollback_ends_the_step() -> None:
    table = logits(RUNNER_UP, CERTAIN, RUNNER_UP, RUNNER_UP, CERTAIN)
    verdict = bild(1.5).verify(draft(0, 0, 1, 3), table, GREEDY, None)  # match, match, loose, rollback (2.996)
    assert (verdict.tokens, verdict.num_accepted, verdict.loose_positions) == ([0, 0, 1, 0], 3, (2,))
    assert [accept.position for accept in verdict.loose] == [2]


def test_at_t_above_0_it_keeps_what_rejection_sampling_would_sometimes_reject() -> None:
    # one-hot n-gram draft of token 1 (p = 0.3 at T = 1): rejection sampling keeps it 30 % of the time, BiLD always
    table = logits(RUNNER_UP, CERTAIN)
    sampling = SamplingConfig(temperature=1.0)
    strict = [make_verifier("rejection").verify(draft(1), table, sampling, Draws.seeded(seed)) for seed in range(60)]
    loose = [bild(1.3).verify(draft(1), table, sampling, Draws.seeded(seed)) for seed in range(60)]
    assert 5 < sum(verdict.num_accepted for verdict in strict) < 40
    assert all(verdict.num_accepted == 1 and verdict.tokens[0] == 1 for verdict in loose)
    rolled_back = [bild(1.1).verify(draft(1), table, sampling, Draws.seeded(seed)) for seed in range(60)]
    assert all(not verdict.loose_positions for verdict in rolled_back)  # 1.204 > 1.1: only rejection's own accepts


@pytest.mark.parametrize("threshold", [0.0, -1.0, math.inf, math.nan])
def test_a_threshold_that_is_not_a_finite_positive_number_is_refused(threshold: float) -> None:
    with pytest.raises(ConfigError, match="rollback_threshold"):
        BildConfig(rollback_threshold=threshold)


def test_the_rule_is_a_flag_a_request_field_a_profile_limit_and_a_calibration_family() -> None:
    assert "bild_rollback" in FLAG_NAMES
    spec = SpeculationConfig().with_options({"verifier": "bild", "bild_rollback": 1.5})
    assert spec.bild.rollback_threshold == 1.5 and isinstance(make_verifier("bild", spec), BildVerifier)
    assert make_verifier("bild", spec).config.rollback_threshold == 1.5
    assert describe(spec)["bild_rollback"] == 1.5 and not describe(spec)["lossless"]
    with pytest.raises(ConfigError, match="bild_rollback applies to verifier bild only"):
        for_request(SpeculationConfig(verifier="fly"), {"bild_rollback": 1.5})
    assert looser(spec, spec) == []
    looser_spec = SpeculationConfig().with_options({"verifier": "bild", "bild_rollback": 2.5})
    assert looser(spec, looser_spec) == ["bild rollback_threshold 2.5 is above the profile's 1.5"]
    family = [point for point in points(SpeculationConfig(), rules=("bild",)) if point.rule == "bild"]
    thresholds = [point.speculation.bild.rollback_threshold for point in family]
    assert thresholds == sorted(thresholds) and len(thresholds) >= 5  # strict to loose
    assert [point.order for point in family] == list(range(len(family)))
