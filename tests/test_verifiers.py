"""Hand-built target-logit tables → the exact Verdict of every verifier.

Each table is ``[k + 1, VOCAB]``: row ``i`` is the target's distribution at the position of
draft token ``d_i``, row ``k`` the position after the draft (the bonus row). Rows come from
``row({token: logit, ...})`` so that the argmax, the runner-up and the top-3 entropy are chosen
by hand; ``certain`` rows have top-3 entropy ~1e-4 and ``uncertain`` rows ~0.81 (both far from
FLy's default threshold 0.3).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from conftest import on_devices
from flyspec.config import (
    ConfigError,
    DecodeConfig,
    FlyConfig,
    GuardConfig,
    MarginConfig,
    NgramConfig,
    SamplingConfig,
    SpeculationConfig,
    TypicalConfig,
)
from flyspec.config.names import LOSSLESS_VERIFIERS, VERIFIER_SUMMARIES, VERIFIERS
from flyspec.sampling.coupled import Draws
from flyspec.types import Draft, Verdict
from flyspec.verifiers import (
    ExactVerifier,
    FlyVerifier,
    MarginVerifier,
    RejectionVerifier,
    TypicalVerifier,
    Verifier,
    make_verifier,
)
from flyspec.verifiers.adasd import AdasdVerifier
from flyspec.verifiers.bild import BildVerifier
from flyspec.verifiers.block import BlockVerifier
from flyspec.verifiers.cascade import CascadeVerifier
from flyspec.verifiers.fly import topk_entropy
from flyspec.verifiers.fsd import FsdVerifier
from flyspec.verifiers.lenience import LenienceVerifier

# These tests pin the papers' rules themselves; the trust guards are tested in test_guard.py.
BARE = GuardConfig.bare()

VOCAB = 10
GREEDY = SamplingConfig()
CERTAIN_LOGIT = 12.0  # others 0: p_top ≈ 1 - 5.5e-5, top-3 entropy ≈ 1.5e-4
UNCERTAIN_LOGITS = (3.0, 2.9)  # top-2 logits, others 0: top-3 entropy ≈ 0.812


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    # Intra-op threads on [16, 10] tensors only add scheduling jitter on a loaded CI box.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# --------------------------------------------------------------------------- table builders


def row(values: dict[int, float], base: float = 0.0) -> torch.Tensor:
    """``[VOCAB]`` logits: ``base`` everywhere except the given ``{token: logit}``."""
    logits = torch.full((VOCAB,), base)
    for token, value in values.items():
        logits[token] = value
    return logits


def runner_up(token: int) -> int:
    return (token + 1) % VOCAB


def certain(token: int) -> torch.Tensor:
    return row({token: CERTAIN_LOGIT})


def uncertain(token: int) -> torch.Tensor:
    """Target prefers ``token`` but ``runner_up(token)`` is close."""
    return row({token: UNCERTAIN_LOGITS[0], runner_up(token): UNCERTAIN_LOGITS[1]})


def table(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(rows)  # [k + 1, VOCAB]


def target_choices(k: int) -> list[int]:
    """The target's argmax per row of a scenario (varied so that a shifted draft would show)."""
    return [(3 * i + 1) % VOCAB for i in range(k + 1)]


def scenario(
    k: int, mismatches: set[int] = frozenset(), uncertain_at: set[int] = frozenset()
) -> tuple[list[int], torch.Tensor, list[int]]:
    """Draft equal to the target's argmax except at ``mismatches`` (there: the runner-up).

    Returns ``(draft tokens, target logits [k + 1, VOCAB], target argmax per row)``.
    """
    targets = target_choices(k)
    rows = [uncertain(t) if i in uncertain_at else certain(t) for i, t in enumerate(targets)]
    draft = [runner_up(t) if i in mismatches else t for i, t in enumerate(targets[:k])]
    return draft, table(rows), targets


def draft_of(tokens: list[int], draft_probs: torch.Tensor | None = None) -> Draft:
    return Draft(torch.tensor(tokens, dtype=torch.long), draft_probs)


def fly(window_size: int = 6, entropy_threshold: float = 0.3, rule: str = "rejection") -> FlyVerifier:
    return FlyVerifier(FlyConfig(window_size, entropy_threshold, temperature_rule=rule), guard=BARE)


def naive_top3_entropy(logits: list[float]) -> float:
    """The documented formula: natural log, full-vocabulary softmax, top-3 probs not renormalised."""
    top = max(logits)
    normaliser = sum(math.exp(z - top) for z in logits)
    probs = sorted((math.exp(z - top) / normaliser for z in logits), reverse=True)[:3]
    return -sum(p * math.log(p) for p in probs)


def single_peak_logit_for_entropy(entropy: float) -> float:
    """Logit ``x`` such that ``row({0: x})`` has top-3 entropy ``entropy`` (bisection; H falls in x)."""
    low, high = 2.0, 8.0
    for _ in range(100):
        middle = (low + high) / 2
        if naive_top3_entropy([middle] + [0.0] * (VOCAB - 1)) > entropy:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def test_table_builders_control_entropy() -> None:
    certain_entropy = float(topk_entropy(certain(4).unsqueeze(0), 3))
    uncertain_entropy = float(topk_entropy(uncertain(4).unsqueeze(0), 3))
    assert certain_entropy < 1e-3
    assert uncertain_entropy == pytest.approx(0.812, abs=1e-3)
    assert uncertain_entropy == pytest.approx(naive_top3_entropy(uncertain(4).tolist()), abs=1e-5)


# --------------------------------------------------------------------------- exact


@pytest.mark.parametrize(
    ("mismatch", "expected_accepted"),
    [(None, 4), (0, 0), (2, 2), (3, 3)],
    ids=["all-match", "first", "middle", "last"],
)
def test_exact_commits_prefix_plus_target_argmax(mismatch: int | None, expected_accepted: int) -> None:
    draft, logits, targets = scenario(4, {mismatch} if mismatch is not None else set())
    verdict = ExactVerifier().verify(draft_of(draft), logits, GREEDY, None)
    assert verdict == Verdict(
        tokens=draft[:expected_accepted] + [targets[expected_accepted]],
        num_accepted=expected_accepted,
        bonus=expected_accepted == 4,
    )


def test_exact_literal_table() -> None:
    logits = table([certain(7), certain(2), uncertain(5), certain(9)])
    verdict = ExactVerifier().verify(draft_of([7, 2, 6]), logits, GREEDY, None)
    assert verdict == Verdict(tokens=[7, 2, 5], num_accepted=2)
    verdict = ExactVerifier().verify(draft_of([7, 2, 5]), logits, GREEDY, None)
    assert verdict == Verdict(tokens=[7, 2, 5, 9], num_accepted=3, bonus=True)


@pytest.mark.parametrize(
    "verifier", [ExactVerifier(), RejectionVerifier(), fly(), MarginVerifier(guard=BARE), TypicalVerifier(guard=BARE)]
)
def test_empty_draft_commits_the_targets_next_token(verifier: Verifier) -> None:
    logits = table([certain(6)])
    verdict = verifier.verify(Draft.empty(), logits, GREEDY, None)
    assert verdict == Verdict(tokens=[6], num_accepted=0, bonus=True)


def test_exact_at_positive_temperature_with_top1_filter_is_greedy() -> None:
    draft, logits, targets = scenario(5, {3}, uncertain_at={0, 1, 2, 3, 4, 5})
    sampling = SamplingConfig(temperature=0.9, top_k=1)
    verdict = ExactVerifier().verify(draft_of(draft), logits, sampling, Draws.seeded(0))
    assert verdict == Verdict(tokens=draft[:3] + [targets[3]], num_accepted=3)


# --------------------------------------------------------------------------- rejection at T=0


@pytest.mark.parametrize("mismatches", [set(), {0}, {2, 4}, {5}])
def test_rejection_greedy_equals_exact_and_draws_nothing(mismatches: set[int]) -> None:
    draft, logits, _ = scenario(6, mismatches, uncertain_at={0, 2, 4})
    draws = Draws.seeded(1234)
    state_before = draws.generator.get_state()
    soft = torch.full((6, VOCAB), 1.0 / VOCAB)
    verdict = RejectionVerifier().verify(draft_of(draft, soft), logits, GREEDY, draws)
    assert verdict == ExactVerifier().verify(draft_of(draft), logits, GREEDY, None)
    assert torch.equal(draws.generator.get_state(), state_before) and draws.noise.num_rows_drawn == 0


@pytest.mark.parametrize(
    "verifier", [ExactVerifier(), RejectionVerifier(), fly(), MarginVerifier(guard=BARE), TypicalVerifier(guard=BARE)]
)
def test_greedy_path_draws_no_random_numbers(verifier: Verifier) -> None:
    draft, logits, _ = scenario(15, {3, 12}, uncertain_at={3, 7, 12})
    draws = Draws.seeded(99)
    state_before = draws.generator.get_state()
    verifier.verify(draft_of(draft), logits, GREEDY, draws)
    assert torch.equal(draws.generator.get_state(), state_before) and draws.noise.num_rows_drawn == 0


# --------------------------------------------------------------------------- FLy, greedy


def test_fly_loose_at_last_judgeable_position_defaults() -> None:
    # k=15, W=6: j = k - W - 1 = 8 is the last position that can be judged; d_9..d_13 match.
    draft, logits, targets = scenario(15, {8}, uncertain_at={8})
    verdict = fly().verify(draft_of(draft), logits, GREEDY, None)
    assert verdict == Verdict(tokens=draft + [targets[15]], num_accepted=15, loose_positions=(8,), bonus=True)
    assert verdict.tokens[8] == runner_up(targets[8])  # the DRAFT token is kept, not the target's


def test_fly_strict_at_first_unjudgeable_position_defaults() -> None:
    # j = k - W = 9: its window would end at the last draft token, so it is treated strictly.
    draft, logits, targets = scenario(15, {9}, uncertain_at={9})
    verdict = fly().verify(draft_of(draft), logits, GREEDY, None)
    assert verdict == Verdict(tokens=draft[:9] + [targets[9]], num_accepted=9)


@pytest.mark.parametrize("position", [10, 14])
def test_fly_never_loose_in_the_last_window(position: int) -> None:
    draft, logits, targets = scenario(15, {position}, uncertain_at={position})
    verdict = fly().verify(draft_of(draft), logits, GREEDY, None)
    assert verdict == Verdict(tokens=draft[:position] + [targets[position]], num_accepted=position)


@pytest.mark.parametrize(
    ("window_size", "k", "last_judgeable"),
    [(2, 5, 2), (3, 8, 4), (1, 3, 1), (4, 6, 1)],
)
def test_fly_window_edge_small_sizes(window_size: int, k: int, last_judgeable: int) -> None:
    assert last_judgeable == k - window_size - 1
    verifier = fly(window_size)
    draft, logits, targets = scenario(k, {last_judgeable}, uncertain_at={last_judgeable})
    verdict = verifier.verify(draft_of(draft), logits, GREEDY, None)
    assert verdict == Verdict(draft + [targets[k]], k, (last_judgeable,), bonus=True)

    edge = last_judgeable + 1
    draft, logits, targets = scenario(k, {edge}, uncertain_at={edge})
    verdict = verifier.verify(draft_of(draft), logits, GREEDY, None)
    assert verdict == Verdict(draft[:edge] + [targets[edge]], edge)


def test_fly_window_larger_than_draft_is_exact() -> None:
    draft, logits, targets = scenario(3, {0}, uncertain_at={0, 1, 2})
    verdict = fly(window_size=6).verify(draft_of(draft), logits, GREEDY, None)
    assert verdict == Verdict([targets[0]], 0)


def test_fly_two_mismatches_in_one_window_reject_the_first() -> None:
    # d_5 alone would be loosely accepted (window 6..10 clean, 5 <= 8), but a loose accept does
    # not count as a match in d_2's window (3..7), so d_2 is rejected strictly.
    draft, logits, targets = scenario(15, {2, 5}, uncertain_at={2, 5})
    verdict = fly().verify(draft_of(draft), logits, GREEDY, None)
    assert verdict == Verdict(tokens=draft[:2] + [targets[2]], num_accepted=2)

    # The same d_5 on its own is loose: the rejection above is the window's doing.
    draft, logits, targets = scenario(15, {5}, uncertain_at={2, 5})
    verdict = fly().verify(draft_of(draft), logits, GREEDY, None)
    assert verdict == Verdict(tokens=draft + [targets[15]], num_accepted=15, loose_positions=(5,), bonus=True)


def test_fly_mismatch_at_window_end_is_outside_the_window() -> None:
    # W=6: d_1's window is d_2..d_6; a mismatch at 7 is exactly W away and does not spoil it.
    draft, logits, targets = scenario(15, {1, 7}, uncertain_at={1, 7})
    verdict = fly().verify(draft_of(draft), logits, GREEDY, None)
    assert verdict == Verdict(tokens=draft + [targets[15]], num_accepted=15, loose_positions=(1, 7), bonus=True)
    assert [verdict.tokens[1], verdict.tokens[7]] == [runner_up(targets[1]), runner_up(targets[7])]

    # One closer (6) and d_1's window is no longer clean.
    draft, logits, targets = scenario(15, {1, 6}, uncertain_at={1, 6})
    verdict = fly().verify(draft_of(draft), logits, GREEDY, None)
    assert verdict == Verdict(tokens=draft[:1] + [targets[1]], num_accepted=1)


def test_fly_recovered_token_after_loose_accept_is_target_argmax() -> None:
    # Loose at 1; at 10 the mismatch is confident (gate closed) → first strict rejection.
    draft, logits, targets = scenario(15, {1, 10}, uncertain_at={1})
    verdict = fly().verify(draft_of(draft), logits, GREEDY, None)
    assert verdict == Verdict(tokens=draft[:10] + [targets[10]], num_accepted=10, loose_positions=(1,))
    assert verdict.tokens[1] != targets[1]


def test_fly_all_match_gives_bonus() -> None:
    draft, logits, targets = scenario(15, uncertain_at=set(range(16)))
    verdict = fly().verify(draft_of(draft), logits, GREEDY, None)
    assert verdict == Verdict(tokens=draft + [targets[15]], num_accepted=15, bonus=True)


def test_fly_confident_mismatch_is_strict() -> None:
    draft, logits, targets = scenario(15, {0})
    verdict = fly().verify(draft_of(draft), logits, GREEDY, None)
    assert verdict == Verdict(tokens=[targets[0]], num_accepted=0)


@pytest.mark.parametrize(("entropy", "loose"), [(0.29, False), (0.299, False), (0.301, True), (0.31, True)])
def test_fly_entropy_gate_edges(entropy: float, loose: bool) -> None:
    peak = single_peak_logit_for_entropy(entropy)
    gate_row = row({0: peak})
    assert float(topk_entropy(gate_row.unsqueeze(0), 3)) == pytest.approx(entropy, abs=1e-5)
    _, logits, targets = scenario(15)
    logits[0] = gate_row
    draft = [1] + targets[1:15]  # d_0 = 1 is not the argmax (0) of the gate row
    verdict = fly().verify(draft_of(draft), logits, GREEDY, None)
    if loose:
        assert verdict == Verdict(tokens=draft + [targets[15]], num_accepted=15, loose_positions=(0,), bonus=True)
    else:
        assert verdict == Verdict(tokens=[0], num_accepted=0)


def test_fly_entropy_exactly_at_threshold_passes_the_gate() -> None:
    draft, logits, targets = scenario(15, {4}, uncertain_at={4})
    threshold = float(topk_entropy(logits[:15], 3)[4])  # the float32 value the verifier computes
    verdict = fly(entropy_threshold=threshold).verify(draft_of(draft), logits, GREEDY, None)
    assert verdict.loose_positions == (4,)
    verdict = fly(entropy_threshold=threshold + 1e-6).verify(draft_of(draft), logits, GREEDY, None)
    assert verdict == Verdict(tokens=draft[:4] + [targets[4]], num_accepted=4)


def test_fly_draft_probability_floor_keeps_only_real_alternatives() -> None:
    """``min_draft_prob``: the loose accept needs the target to give the draft token at least the floor."""
    draft, logits, targets = scenario(15, {4}, uncertain_at={4})
    draft_prob = float(torch.softmax(logits[4], -1)[draft[4]])  # the runner-up's probability
    for floor, kept in ((draft_prob * 0.99, True), (draft_prob * 1.01, False)):
        config = FlyConfig(6, 0.3, min_draft_prob=floor)
        verdict = FlyVerifier(config, guard=BARE).verify(draft_of(draft), logits, GREEDY, None)
        if kept:
            assert verdict.loose_positions == (4,) and verdict.num_accepted == 15
        else:
            assert verdict == Verdict(tokens=draft[:4] + [targets[4]], num_accepted=4)
    with pytest.raises(ConfigError, match="min_draft_prob"):
        FlyConfig(min_draft_prob=1.0)


def test_fly_ablation_no_window_keeps_every_gated_mismatch() -> None:
    # window_size=0: consecutive mismatches and the very last positions are all kept.
    draft, logits, targets = scenario(15, {3, 4, 13, 14}, uncertain_at={3, 4, 13, 14})
    verdict = fly(window_size=0).verify(draft_of(draft), logits, GREEDY, None)
    assert verdict == Verdict(tokens=draft + [targets[15]], num_accepted=15, loose_positions=(3, 4, 13, 14), bonus=True)
    # ... but the gate still applies.
    draft, logits, targets = scenario(15, {3, 14}, uncertain_at={3})
    verdict = fly(window_size=0).verify(draft_of(draft), logits, GREEDY, None)
    assert verdict == Verdict(tokens=draft[:14] + [targets[14]], num_accepted=14, loose_positions=(3,))


def test_fly_ablation_no_entropy_gate_keeps_confident_mismatch() -> None:
    draft, logits, targets = scenario(15, {0})  # every row near-certain
    assert float(topk_entropy(logits[:1], 3)) < 1e-3
    verdict = fly(entropy_threshold=0.0).verify(draft_of(draft), logits, GREEDY, None)
    assert verdict == Verdict(tokens=draft + [targets[15]], num_accepted=15, loose_positions=(0,), bonus=True)
    # The window still applies: a mismatch in the last W positions stays strict.
    draft, logits, targets = scenario(15, {12})
    verdict = fly(entropy_threshold=0.0).verify(draft_of(draft), logits, GREEDY, None)
    assert verdict == Verdict(tokens=draft[:12] + [targets[12]], num_accepted=12)


def test_fly_entropy_ignores_temperature() -> None:
    # The gate reads the raw logits: a sharp temperature does not close it.
    draft, logits, targets = scenario(15, {2}, uncertain_at={2})
    sampling = SamplingConfig(temperature=0.05, top_k=1)
    verdict = fly().verify(draft_of(draft), logits, sampling, Draws.seeded(0))
    assert verdict.loose_positions == (2,)


# --------------------------------------------------------------------------- FLy, property-based


def naive_fly(
    draft: list[int], targets: list[int], entropies: list[float], window_size: int, threshold: float
) -> Verdict:
    """The rule of ``verifiers/fly.py``'s docstring, one position at a time."""
    k = len(draft)
    matches = [draft[i] == targets[i] for i in range(k)]
    accepted, loose = 0, []
    for j in range(k):
        if matches[j]:
            accepted += 1
            continue
        window_clean = window_size == 0 or (j <= k - window_size - 1 and all(matches[j + 1 : j + window_size]))
        if entropies[j] >= threshold and window_clean:
            accepted += 1
            loose.append(j)
            continue
        break
    return Verdict(draft[:accepted] + [targets[accepted]], accepted, tuple(loose), accepted == k)


@st.composite
def fly_tables(draw: st.DrawFn) -> tuple[list[int], torch.Tensor, list[int], list[float]]:
    k = draw(st.integers(0, 14))
    targets = draw(st.lists(st.integers(0, VOCAB - 1), min_size=k + 1, max_size=k + 1))
    peaks = draw(st.lists(st.floats(0.5, 9.0), min_size=k + 1, max_size=k + 1))
    matches = draw(st.lists(st.booleans(), min_size=k, max_size=k))
    rows = [row({t: peak}) for t, peak in zip(targets, peaks, strict=True)]
    draft = [t if match else runner_up(t) for t, match in zip(targets[:k], matches, strict=True)]
    entropies = [naive_top3_entropy(r.tolist()) for r in rows[:k]]
    return draft, table(rows), targets, entropies


@on_devices
@settings(max_examples=300, deadline=None)
@given(case=fly_tables(), window_size=st.integers(0, 8), threshold=st.sampled_from([0.0, 0.3, 0.6]))
def test_fly_matches_naive_reference(
    case: tuple[list[int], torch.Tensor, list[int], list[float]], window_size: int, threshold: float, device: str
) -> None:
    draft, logits, targets, entropies = case
    assume(all(abs(h - threshold) > 1e-4 for h in entropies))  # float32 vs float64 at the boundary
    draft_tokens = torch.tensor(draft, dtype=torch.long, device=device)
    verdict = fly(window_size, threshold).verify(Draft(draft_tokens), logits.to(device), GREEDY, None)
    assert verdict == naive_fly(draft, targets, entropies, window_size, threshold)


@settings(max_examples=200, deadline=None)
@given(case=fly_tables(), window_size=st.integers(0, 8))
def test_fly_with_closed_gate_equals_exact(
    case: tuple[list[int], torch.Tensor, list[int], list[float]], window_size: int
) -> None:
    draft, logits, _, _ = case
    verdict = fly(window_size, entropy_threshold=1e9).verify(draft_of(draft), logits, GREEDY, None)
    assert verdict == ExactVerifier().verify(draft_of(draft), logits, GREEDY, None)


@settings(max_examples=100, deadline=None)
@given(logits=st.lists(st.floats(-20.0, 20.0), min_size=VOCAB, max_size=VOCAB))
def test_topk_entropy_matches_documented_formula(logits: list[float]) -> None:
    computed = float(topk_entropy(torch.tensor([logits]), 3))
    assert computed == pytest.approx(naive_top3_entropy(logits), abs=1e-5)


# --------------------------------------------------------------------------- FLy, T > 0


@pytest.mark.parametrize("rule", ["coupled", "rejection", "two-sample"])
@pytest.mark.parametrize("soft_draft", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fly_sampling_loose_accepts_certain_rejections(rule: str, soft_draft: bool, seed: int) -> None:
    # top_k=1 makes target_probs one-hot on the argmax: the base rule accepts matches and rejects
    # mismatches with certainty, and the recovered/bonus token is the argmax. The raw logits are
    # uncertain, so gate and window decide exactly as when greedy.
    draft, logits, targets = scenario(15, {3, 11}, uncertain_at=set(range(16)))
    draft_probs = torch.full((15, VOCAB), 1.0 / VOCAB) if soft_draft else None  # two-sample ignores them
    sampling = SamplingConfig(temperature=0.8, top_k=1)
    verdict = fly(rule=rule).verify(draft_of(draft, draft_probs), logits, sampling, Draws.seeded(seed))
    assert verdict == Verdict(tokens=draft[:11] + [targets[11]], num_accepted=11, loose_positions=(3,))


@pytest.mark.parametrize("rule", ["coupled", "rejection", "two-sample"])
def test_fly_sampling_is_reproducible_per_seed(rule: str) -> None:
    draft, logits, _ = scenario(8, {1, 5}, uncertain_at=set(range(9)))
    sampling = SamplingConfig(temperature=1.0)
    verifier = fly(window_size=2, rule=rule)

    def run(seed: int) -> Verdict:
        return verifier.verify(draft_of(draft), logits, sampling, Draws.seeded(seed))

    verdicts = [run(seed) for seed in range(40)]
    assert verdicts == [run(seed) for seed in range(40)]
    assert len({(tuple(v.tokens), v.loose_positions) for v in verdicts}) > 1  # randomness is used


def test_fly_two_sample_accepts_more_often_than_rejection() -> None:
    # k=1 < W+1: nothing is judgeable, so FLy = its base rule. A one-hot draft token with target
    # probability p is accepted w.p. p by rejection sampling and 1 - (1 - p)^2 by two-sample.
    target_probs = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.05, 0.05, 0.0, 0.0, 0.0, 0.0]) + 1e-9
    logits = table([target_probs.log(), certain(0)])
    sampling = SamplingConfig(temperature=1.0)
    trials = 1500
    rates = {}
    for rule in ("coupled", "rejection", "two-sample"):
        verifier = fly(rule=rule)
        accepted = sum(
            verifier.verify(draft_of([1]), logits, sampling, Draws.seeded(t)).num_accepted for t in range(trials)
        )
        rates[rule] = accepted / trials
    assert rates["rejection"] == pytest.approx(0.3, abs=0.04)
    assert rates["coupled"] == rates["rejection"]  # one-hot drafts: the same rule
    assert rates["two-sample"] == pytest.approx(1 - 0.7**2, abs=0.04)


# --------------------------------------------------------------------------- margin (MARS)


@pytest.mark.parametrize(
    ("values", "base", "draft_token", "loose"),
    [
        ({0: 10.0, 1: 9.5}, 0.0, 1, True),  # z2/z1 = 0.95 (the probability ratio would be 0.61)
        ({0: 10.0, 1: 9.5, 2: 9.4}, 0.0, 2, False),  # third choice
        ({0: 10.0, 1: 9.1}, 0.0, 1, True),  # 0.91
        ({0: 10.0, 1: 8.9}, 0.0, 1, False),  # 0.89
        ({0: -1.0, 1: -1.05}, -20.0, 1, True),  # exp(-0.05) = 0.951
        ({0: -1.0, 1: -1.2}, -20.0, 1, False),  # exp(-0.2) = 0.819 (z2/z1 = 1.2 would pass)
        ({0: 0.05, 1: -0.03}, -20.0, 1, True),  # mixed signs: exp(-0.08) = 0.923
        ({0: 0.05, 1: -0.2}, -20.0, 1, False),  # exp(-0.25) = 0.779
    ],
    ids=[
        "ratio-0.95",
        "third-choice",
        "ratio-0.91",
        "ratio-0.89",
        "neg-0.951",
        "neg-0.819",
        "mixed-0.923",
        "mixed-0.779",
    ],
)
def test_margin_single_position(values: dict[int, float], base: float, draft_token: int, loose: bool) -> None:
    logits = table([row(values, base), certain(5)])
    verdict = MarginVerifier(guard=BARE).verify(draft_of([draft_token]), logits, GREEDY, None)
    if loose:
        assert verdict == Verdict(tokens=[draft_token, 5], num_accepted=1, loose_positions=(0,), bonus=True)
    else:
        assert verdict == Verdict(tokens=[0], num_accepted=0)


def test_margin_multi_position() -> None:
    logits = table(
        [
            certain(4),
            row({2: 10.0, 3: 9.6}),  # d_1 = 3: loose
            certain(8),
            row({6: 10.0, 7: 9.8, 1: 9.7}),  # d_3 = 1: third choice → recovered 6
            certain(0),
        ]
    )
    verdict = MarginVerifier(guard=BARE).verify(draft_of([4, 3, 8, 1]), logits, GREEDY, None)
    assert verdict == Verdict(tokens=[4, 3, 8, 6], num_accepted=3, loose_positions=(1,))


def test_margin_ratio_is_configurable() -> None:
    logits = table([row({0: 10.0, 1: 8.9}), certain(5)])
    verdict = MarginVerifier(MarginConfig(logit_ratio=0.85), guard=BARE).verify(draft_of([1]), logits, GREEDY, None)
    assert verdict == Verdict(tokens=[1, 5], num_accepted=1, loose_positions=(0,), bonus=True)


def test_margin_sampling_keeps_close_runner_up_over_certain_rejection() -> None:
    logits = table([row({0: 10.0, 1: 9.5}), row({3: 10.0, 4: 5.0}), certain(5)])
    sampling = SamplingConfig(temperature=0.7, top_k=1)
    verdict = MarginVerifier(guard=BARE).verify(draft_of([1, 4]), logits, sampling, Draws.seeded(3))
    assert verdict == Verdict(tokens=[1, 3], num_accepted=1, loose_positions=(0,))


def test_margin_tied_top_logits_keep_the_other_tied_token() -> None:
    # z1 == z2 (ratio 1 > 0.9): whichever tied token the draft proposes is a target top-2 token.
    # argmax picks token 0, so the runner-up must be token 1 even though torch.topk orders the tie [1, 0].
    logits = table([row({0: 5.0, 1: 5.0}), certain(5)])
    verdict = MarginVerifier(guard=BARE).verify(draft_of([1]), logits, GREEDY, None)
    assert verdict == Verdict(tokens=[1, 5], num_accepted=1, loose_positions=(0,), bonus=True)


# --------------------------------------------------------------------------- typical (Medusa)


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def typical_threshold(probs: list[float], epsilon: float = 0.09, delta: float = 0.3) -> float:
    entropy = -sum(p * math.log(p) for p in probs if p > 0)
    return min(epsilon, delta * math.exp(-entropy))


SPREAD = [0.40, 0.25, 0.15, 0.08, 0.04, 0.03, 0.02, 0.01, 0.01, 0.01]  # H ≈ 1.65: delta term (0.058) binds
PEAKED = [0.85, 0.10] + [0.00625] * 8  # H ≈ 0.62: epsilon (0.09) binds


def test_typical_thresholds_of_the_tables() -> None:
    assert typical_threshold(SPREAD) == pytest.approx(0.3 * math.exp(-1.6501), abs=1e-3)
    assert 0.04 < typical_threshold(SPREAD) < 0.08
    assert typical_threshold(PEAKED) == 0.09


@pytest.mark.parametrize(
    ("probs", "draft_token", "accepted"),
    [
        (SPREAD, 3, True),  # 0.08 > 0.058
        (SPREAD, 4, False),  # 0.04 < 0.058
        (PEAKED, 1, True),  # 0.10 > 0.09
        (PEAKED, 2, False),  # 0.00625 < 0.09
    ],
)
def test_typical_single_position(probs: list[float], draft_token: int, accepted: bool) -> None:
    logits = table([logits_from_probs(probs), certain(5)])
    verdict = TypicalVerifier(guard=BARE).verify(draft_of([draft_token]), logits, GREEDY, None)
    if accepted:
        assert verdict == Verdict(tokens=[draft_token, 5], num_accepted=1, loose_positions=(0,), bonus=True)
    else:
        assert verdict == Verdict(tokens=[0], num_accepted=0)


def test_typical_loose_positions_exclude_argmax_tokens() -> None:
    logits = table(
        [
            logits_from_probs(SPREAD),  # d_0 = 0: argmax, accepted, not loose
            logits_from_probs(PEAKED),  # d_1 = 1: typical, loose
            certain(7),  # d_2 = 7: argmax
            logits_from_probs(SPREAD),  # d_3 = 3: typical, loose
            logits_from_probs(SPREAD),  # d_4 = 5: 0.03, rejected → argmax 0
            certain(2),
        ]
    )
    verdict = TypicalVerifier(guard=BARE).verify(draft_of([0, 1, 7, 3, 5]), logits, GREEDY, None)
    assert verdict == Verdict(tokens=[0, 1, 7, 3, 0], num_accepted=4, loose_positions=(1, 3))


def test_typical_config_changes_the_threshold() -> None:
    logits = table([logits_from_probs(SPREAD), certain(5)])
    verifier = TypicalVerifier(TypicalConfig(epsilon=0.03, delta=0.3), guard=BARE)  # threshold 0.03
    verdict = verifier.verify(draft_of([4]), logits, GREEDY, None)
    assert verdict == Verdict(tokens=[4, 5], num_accepted=1, loose_positions=(0,), bonus=True)


def test_typical_sampling_uses_the_filtered_distribution() -> None:
    # At T>0 the criterion reads target_probs after top-k: token 3 (0.08 at T=1) is filtered out.
    logits = table([logits_from_probs(SPREAD), certain(5)])
    sampling = SamplingConfig(temperature=1.0, top_k=1)
    verdict = TypicalVerifier(guard=BARE).verify(draft_of([3]), logits, sampling, Draws.seeded(0))
    assert verdict == Verdict(tokens=[0], num_accepted=0)


# --------------------------------------------------------------------------- config and registry


@pytest.mark.parametrize(
    ("build", "field_name"),
    [
        (lambda: FlyConfig(window_size=-1), "window_size"),
        (lambda: FlyConfig(entropy_threshold=-0.1), "entropy_threshold"),
        (lambda: FlyConfig(entropy_top_k=1), "entropy_top_k"),
        (lambda: FlyConfig(temperature_rule="greedy"), "temperature_rule"),
        (lambda: SamplingConfig(temperature=-0.1), "temperature"),
        (lambda: SamplingConfig(top_p=0), "top_p"),
        (lambda: SamplingConfig(top_p=1.5), "top_p"),
        (lambda: SamplingConfig(top_k=-1), "top_k"),
        (lambda: SpeculationConfig(num_draft_tokens=0), "num_draft_tokens"),
        (lambda: DecodeConfig(max_new_tokens=0), "max_new_tokens"),
        (lambda: DecodeConfig(stop_strings=("",)), "stop strings"),
        (lambda: MarginConfig(logit_ratio=1.0), "logit_ratio"),
        (lambda: TypicalConfig(epsilon=0.0), "epsilon"),
        (lambda: TypicalConfig(delta=1.5), "delta"),
        (lambda: NgramConfig(min_ngram=0), "min_ngram"),
        (lambda: NgramConfig(max_ngram=1, min_ngram=2), "max_ngram"),
    ],
)
def test_invalid_config_raises_config_error(build: Callable[[], object], field_name: str) -> None:
    with pytest.raises(ConfigError, match=field_name):
        build()


def test_ablation_values_are_valid_configs() -> None:
    config = FlyConfig(window_size=0, entropy_threshold=0.0)
    assert (config.window_size, config.entropy_threshold) == (0, 0.0)


def test_registry_builds_each_verifier() -> None:
    expected = {
        "exact": (ExactVerifier, True),
        "rejection": (RejectionVerifier, True),
        "fly": (FlyVerifier, False),
        "margin": (MarginVerifier, False),
        "typical": (TypicalVerifier, False),
        "bild": (BildVerifier, False),
        "block": (BlockVerifier, True),
        "lenience": (LenienceVerifier, False),
        "fsd": (FsdVerifier, False),
        "cascade": (CascadeVerifier, False),
        "adasd": (AdasdVerifier, False),
    }
    assert set(expected) == set(VERIFIERS) == set(VERIFIER_SUMMARIES)  # every rule the registry names is built here
    for name, (cls, lossless) in expected.items():
        verifier = make_verifier(name)
        assert isinstance(verifier, cls)
        assert verifier.name == name
        assert verifier.lossless is lossless
        assert (name in LOSSLESS_VERIFIERS) is lossless
        assert VERIFIER_SUMMARIES[name].startswith("lossless" if lossless else "lossy")
    assert make_verifier("fly", SpeculationConfig(fly=FlyConfig(window_size=2))).config.window_size == 2
    with pytest.raises(ConfigError, match="unknown verifier"):
        make_verifier("medusa")
