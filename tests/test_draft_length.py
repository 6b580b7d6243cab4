"""The cost-aware draft length: the step cost t(n) (measured, cached per machine) and the policy.

The policy is checked on hand-made costs and acceptance (which k wins, and why), then end to end
on the tiny model: lossless output, a cut draft reported as the length asked for, the cost
measured once and read back from the cache file, and the option on the CLI and the server.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from flyspec import DecodeConfig, PlainDecoder, SpeculativeDecoder, build_decoder, make_verifier
from flyspec.config import ConfigError, DraftLengthConfig, SamplingConfig, SpeculationConfig
from flyspec.decoding.draft_length import (
    AcceptanceModel,
    CostAwareLength,
    DraftLength,
    StepTimes,
    bucket_of,
    new_draft_length,
    resolve_policy,
)
from flyspec.drafters import NgramDrafter
from flyspec.resources import Resources
from flyspec.runtime import step_cost as step_cost_module
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.runtime.step_cost import StepCost, measure, sizes_up_to, step_cost
from flyspec.types import MODEL, OUTPUT_COPY, PROMPT_COPY, Draft

COST = DraftLengthConfig(policy="cost")


def linear_cost(per_token: float, largest: int = 16) -> StepCost:
    """t(n) = 1 + per_token·(n - 1), measured at every n up to ``largest``."""
    sizes = tuple(range(1, largest + 1))
    return StepCost(sizes, tuple(1 + per_token * (n - 1) for n in sizes))


def copy_draft(num_tokens: int, match_length: int, source: str = OUTPUT_COPY) -> Draft:
    return Draft(torch.arange(num_tokens), sources=(source,) * num_tokens, match_length=match_length)


def trained(policy: CostAwareLength, bucket_draft: Draft, kept: int, steps: int = 30) -> CostAwareLength:
    """``policy`` after ``steps`` steps that each verified ``bucket_draft`` whole and kept ``kept`` tokens."""
    for _ in range(steps):
        policy.choose(bucket_draft, 0.0)
        policy.observe(bucket_draft.num_tokens, kept)
    return policy


# ---- the step cost --------------------------------------------------------------------------


def test_step_cost_interpolates_and_extends_the_last_slope() -> None:
    cost = StepCost((1, 2, 4), (1.0, 2.0, 3.0))
    assert cost(1) == 1.0 and cost(3) == pytest.approx(2.5) and cost(4) == 3.0
    assert cost(6) == pytest.approx(4.0)  # beyond 4: the slope from 2 to 4 (0.5 per token)
    assert cost.relative() == {1: 1.0, 2: 2.0, 4: 3.0}
    assert StepCost.from_dict(cost.to_dict()) == cost
    with pytest.raises(ValueError, match="starting at 1"):
        StepCost((2, 4), (1.0, 2.0))
    with pytest.raises(ValueError, match="increase"):
        StepCost((1, 4, 2), (1.0, 2.0, 3.0))


def test_measured_sizes_reach_the_asked_maximum() -> None:
    assert sizes_up_to(16) == (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16)
    assert sizes_up_to(11)[-2:] == (10, 11)


def test_measure_times_every_size_on_the_model(tiny_target: LoadedModel) -> None:
    cost = measure(tiny_target, 6, rounds=2, context=16)
    assert cost.sizes == (1, 2, 3, 4, 5, 6) and all(seconds > 0 for seconds in cost.seconds)
    assert cost.context == 16


def test_step_cost_is_measured_once_then_read_from_the_cache_file(
    tiny_target: LoadedModel, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLYSPEC_STEP_COSTS", str(tmp_path / "step-costs.json"))
    measured: list[int] = []

    def fake_measure(model: LoadedModel, max_tokens: int) -> StepCost:
        measured.append(max_tokens)
        return linear_cost(0.1, max_tokens)

    monkeypatch.setattr(step_cost_module, "measure", fake_measure)
    first = step_cost(tiny_target, 8)
    assert measured == [8]
    record = json.loads((tmp_path / "step-costs.json").read_text())
    (entry,) = record.values()
    assert entry["fingerprint"]["model"] == tiny_target.name and entry["fingerprint"]["dtype"] == "float32"
    assert step_cost(tiny_target, 6) == first and measured == [8], "a covered size is read, not measured"
    step_cost(tiny_target, 12)
    assert measured == [8, 12], "a longer maximum than the cached one is measured"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(1, threads - 1) if threads > 1 else 2)
        step_cost(tiny_target, 6)
    finally:
        torch.set_num_threads(threads)
    assert measured == [8, 12, 6], "another thread count is another machine"
    assert len(json.loads((tmp_path / "step-costs.json").read_text())) == 2


def test_an_unreadable_cache_file_is_measured_again_and_replaced(
    tiny_target: LoadedModel, tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("FLYSPEC_STEP_COSTS", str(tmp_path / "step-costs.json"))
    (tmp_path / "step-costs.json").write_text("{not json")
    monkeypatch.setattr(step_cost_module, "measure", lambda model, max_tokens: linear_cost(0.1, max_tokens))
    with caplog.at_level(logging.WARNING, logger="flyspec.runtime.step_cost"):
        step_cost(tiny_target, 4)
    assert "unreadable step-cost cache" in caplog.text
    assert len(json.loads((tmp_path / "step-costs.json").read_text())) == 1


# ---- the acceptance estimate ------------------------------------------------------------------


def test_acceptance_starts_even_and_learns_per_bucket() -> None:
    model = AcceptanceModel(max_tokens=6)
    long_match, short_match = (OUTPUT_COPY, 4), (PROMPT_COPY, 1)
    assert np.allclose(model.rates(long_match), 0.5)
    for _ in range(20):
        model.observe(long_match, 6, 6)  # a 4-gram copy: always kept
        model.observe(short_match, 6, 0)  # a 1-gram copy: never
    assert model.rates(long_match).min() > 0.8
    assert model.rates(short_match)[0] < 0.2
    expected = model.expected_committed(long_match)
    assert expected[0] == 1.0 and np.all(np.diff(expected) > 0) and expected[-1] > 5
    # an unseen bucket borrows every bucket's pooled rate (6 of the 7 tokens reached per pair of steps
    # were kept), not the prior's 0.5
    assert 0.8 < model.rates((MODEL, 0))[0] < 0.9


def test_positions_never_verified_continue_the_deepest_verified_rate() -> None:
    model = AcceptanceModel(max_tokens=8, decay=0.5)
    bucket = (OUTPUT_COPY, 3)
    for _ in range(10):
        model.observe(bucket, 2, 2)  # only positions 1 and 2 are ever verified, always kept
    rates = model.rates(bucket)
    assert rates[2:] == pytest.approx(rates[1]) and rates[1] > 0.8, "position 3 on continue position 2's rate"


def test_a_copy_kept_past_its_first_token_is_expected_to_run_on() -> None:
    """Half the copies fail at once, the other half are kept whole (a copy that starts right goes on): positions 2-4
    are near 1, and the unverified 5-12 continue them, not the pooled rate the failing first tokens pull down."""
    model = AcceptanceModel(max_tokens=12)
    bucket = (PROMPT_COPY, 2)
    for _ in range(20):
        model.observe(bucket, 4, 4)
        model.observe(bucket, 4, 0)
    rates = model.rates(bucket)
    assert 0.4 < rates[0] < 0.6 and 0.75 < rates[1] < rates[2] < rates[3] and rates[3] > 0.9  # decayed: shrunk
    assert rates[4:].min() == pytest.approx(rates[3]) and rates[4:].min() > 0.9
    policy = CostAwareLength(COST, 12, 1, linear_cost(0.1), cheap_drafts=True)
    policy.acceptance = model
    assert policy.choose(copy_draft(12, 2, PROMPT_COPY), 0.0) == 12  # a tenth of a step a token: worth drafting on


# ---- the policy -----------------------------------------------------------------------------


def test_a_flat_cost_verifies_the_whole_draft_and_a_steep_one_cuts_it() -> None:
    bucket_draft = copy_draft(10, 2)
    flat = trained(CostAwareLength(COST, 10, 1, linear_cost(0.0), cheap_drafts=True), bucket_draft, kept=3)
    steep = trained(CostAwareLength(COST, 10, 1, linear_cost(0.5), cheap_drafts=True), bucket_draft, kept=3)
    assert flat.choose(bucket_draft, 0.0) == 10  # verifying more costs nothing: take every chance
    chosen = steep.choose(bucket_draft, 0.0)
    assert 1 <= chosen <= 4, chosen  # each token costs half a step: stop near where drafts fail


def test_the_choice_follows_the_evidence_of_the_draft() -> None:
    policy = CostAwareLength(COST, 12, 1, linear_cost(0.08), cheap_drafts=True)
    long_copy, short_copy = copy_draft(12, 4), copy_draft(12, 1)
    for _ in range(30):
        for draft, kept in ((long_copy, 12), (short_copy, 0)):
            policy.choose(draft, 0.0)
            policy.observe(draft.num_tokens, kept)
    assert policy.choose(long_copy, 0.0) == 12
    assert policy.choose(short_copy, 0.0) <= 1
    assert bucket_of(long_copy) == (OUTPUT_COPY, 4) and bucket_of(copy_draft(3, 30)) == (OUTPUT_COPY, 8)


def test_never_below_the_verifier_floor_unless_drafting_nothing() -> None:
    policy = trained(CostAwareLength(COST, 15, 7, linear_cost(0.05), cheap_drafts=True), copy_draft(15, 2), kept=2)
    chosen = policy.choose(copy_draft(15, 2), 0.0)
    assert chosen == 0 or chosen >= 7, chosen
    short = copy_draft(4, 2)  # the drafter had only 4: verify them or nothing
    assert policy.choose(short, 0.0) in (0, 4)


def test_a_model_drafter_is_asked_for_fewer_tokens_when_its_tokens_cost_time() -> None:
    free = CostAwareLength(COST, 10, 1, linear_cost(0.02), cheap_drafts=False)
    paid = CostAwareLength(COST, 10, 1, linear_cost(0.02), cheap_drafts=False)
    model_draft = Draft(torch.arange(10), sources=(MODEL,) * 10)
    for policy, seconds in ((free, 0.0), (paid, 10 * 0.5)):  # paid: each draft token takes half a target step
        for _ in range(30):
            policy.choose(model_draft, seconds)
            policy.observe(10, 4)
    assert paid.next() < free.next()
    assert CostAwareLength(COST, 10, 1, linear_cost(0.02), cheap_drafts=True).next() == 10  # copies: propose all


def test_fixed_and_heuristic_policies_verify_the_whole_draft() -> None:
    for policy in ("fixed", "heuristic"):
        length = new_draft_length(DraftLengthConfig(policy=policy), 8, 1)
        assert type(length) is DraftLength and length.choose(copy_draft(5, 1), 0.0) == 5
    with pytest.raises(ValueError, match="step cost"):
        new_draft_length(COST, 8, 1)
    with pytest.raises(ConfigError, match="draft length policy must be one of auto, fixed, heuristic, cost"):
        DraftLengthConfig(policy="fast")


# ---- end to end -----------------------------------------------------------------------------


@pytest.mark.parametrize("per_token", [0.0, 0.3])
def test_cost_aware_length_is_lossless_and_reports_what_it_verified(tiny_target: LoadedModel, per_token: float) -> None:
    config = DecodeConfig(max_new_tokens=40)
    spec = SpeculationConfig(num_draft_tokens=8, draft_length=COST)
    decoder = SpeculativeDecoder(
        tiny_target, NgramDrafter(), make_verifier("exact"), config, spec, step_cost=linear_cost(per_token)
    )
    for prompt in ("The capital of", "Once upon a time there was a small model that"):
        result = decoder.generate(prompt, use_chat=False)
        assert result.token_ids == PlainDecoder(tiny_target, config).generate(prompt, use_chat=False).token_ids
        stats = result.stats
        assert sum(stats.requested_draft_lengths.values()) == stats.num_target_forwards - 1  # the first: no draft
        verified = sum(length * steps for length, steps in stats.requested_draft_lengths.items())
        assert stats.num_proposed == verified, "the recorded length is the verified one"
        if per_token == 0.0:
            assert max(stats.requested_draft_lengths) == 8  # free tokens: the whole draft, whenever there is one


def test_build_decoder_measures_the_step_cost_once_per_resources(
    tiny_target: LoadedModel, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setenv("FLYSPEC_STEP_COSTS", str(tmp_path / "step-costs.json"))
    calls: list[int] = []
    real = step_cost_module.measure

    def counted(model: LoadedModel, max_tokens: int) -> StepCost:
        calls.append(max_tokens)
        return real(model, max_tokens, rounds=2, context=16)

    monkeypatch.setattr(step_cost_module, "measure", counted)
    resources = Resources(models=(tiny_target,))
    spec = SpeculationConfig(num_draft_tokens=6, draft_length=COST)
    first = build_decoder(tiny_target, spec, resources=resources)
    build_decoder(tiny_target, spec, resources=resources.isolated())
    assert calls == [7] and first.step_cost is not None and first.step_cost.max_tokens == 7
    assert first.draft_length_policy == "cost"


def test_auto_is_cost_for_lossless_copy_drafts_and_fixed_otherwise(tiny_target: LoadedModel) -> None:
    resources = Resources(models=(tiny_target,))
    lossless = build_decoder(tiny_target, SpeculationConfig(num_draft_tokens=6), resources=resources)
    assert lossless.draft_length_policy == "cost" and lossless.step_cost is not None
    lossy = build_decoder(tiny_target, SpeculationConfig(verifier="fly", num_draft_tokens=8), resources=resources)
    assert lossy.draft_length_policy == "fixed" and lossy.step_cost is None
    pinned = SpeculationConfig(num_draft_tokens=6, draft_length=DraftLengthConfig(policy="fixed"))
    assert build_decoder(tiny_target, pinned, resources=resources).draft_length_policy == "fixed"
    # built by hand without a step cost, auto cannot weigh costs: it drafts a fixed k
    by_hand = SpeculativeDecoder(tiny_target, NgramDrafter(), make_verifier("exact"))
    assert by_hand.draft_length_policy == "fixed"
    assert resolve_policy(DraftLengthConfig(), lossless=True, drafter="ngram-cache") == "cost"
    assert resolve_policy(DraftLengthConfig(), lossless=False, drafter="ngram") == "fixed"
    # a model drafter: cost-aware when greedy (issue 39: a fixed k is k sequential draft forwards); when
    # sampling its cost is timed as it runs, so a seeded sample would depend on the timings: fixed
    assert resolve_policy(DraftLengthConfig(), lossless=True, drafter="multilevel") == "cost"
    assert resolve_policy(DraftLengthConfig(), lossless=True, drafter="draft-model", greedy=False) == "fixed"
    assert resolve_policy(DraftLengthConfig(), lossless=True, drafter="ngram", greedy=False) == "cost"
    assert resolve_policy(DraftLengthConfig(policy="heuristic"), lossless=False, drafter="ngram") == "heuristic"


def test_a_model_drafter_is_cost_aware_when_greedy_and_reproducible_when_sampling(
    tiny_target: LoadedModel, tiny_draft: LoadedModel
) -> None:
    resources = Resources("float32", models=(tiny_target, tiny_draft))
    spec = SpeculationConfig(drafter="draft-model", draft_model=tiny_draft.name, num_draft_tokens=6)
    decoder = build_decoder(tiny_target, spec, resources=resources)
    assert decoder.draft_length_policy == "cost" and decoder.step_cost is not None
    assert type(decoder.new_draft_length()).__name__ == "CostAwareLength"
    assert type(decoder.new_draft_length(greedy=False)).__name__ == "DraftLength"  # this call samples: fixed
    sampling = DecodeConfig(max_new_tokens=16, sampling=SamplingConfig(temperature=0.9))
    outputs = [
        decoder.generate("the cat sat", config=sampling, generator=torch.Generator().manual_seed(3)).token_ids
        for _ in range(2)
    ]
    assert outputs[0] == outputs[1]
    sampled = build_decoder(tiny_target, spec, sampling, resources=resources)
    assert sampled.draft_length_policy == "fixed" and sampled.step_cost is None


def test_a_decoder_without_a_step_cost_refuses_the_cost_policy(tiny_target: LoadedModel) -> None:
    with pytest.raises(ConfigError, match="forward cost"):
        SpeculativeDecoder(
            tiny_target, NgramDrafter(), make_verifier("exact"), None, SpeculationConfig(draft_length=COST)
        )


def test_a_request_whose_speculative_steps_cost_more_than_the_table_says_drafts_less() -> None:
    """The table says a 4-token step costs 1.15 one-token steps; this request's own speculative steps take 4 s (a
    graph recompiling, a path falling back to eager) while its plain steps take the table's 1 s: it times a plain
    step beside the slow ones, stops drafting a copy that keeps 2 of 8 (never slower than plain by its own
    measure), and tries again once those steps have faded from the evidence."""
    draft = copy_draft(8, 2)  # a copy that keeps 2 of 8: by the table, 3 tokens for 1.15 steps
    policy = trained(CostAwareLength(COST, 8, 1, linear_cost(0.05), cheap_drafts=True), draft, kept=2)
    policy.times = times = StepTimes(1.0)  # the training's own (sub-millisecond) steps left out
    assert policy.choose(draft, 0.0) > 0  # by the table, 3 tokens for 1.4 steps pay
    now, plain_steps = 0.0, 0
    times.step_ended(0, 1.0, now)  # the first step (its time holds the prefill: not counted)
    for _ in range(30):  # the request runs: each step as long as this machine makes it
        k = policy.choose(draft, 0.0)
        plain_steps += k == 0
        now += 1.0 if k == 0 else 4.0
        times.step_ended(k, 1 + 0.05 * k, now)  # the table's t(k + 1)
    assert times.factor(8) > 1.5 * times.factor(0)
    assert policy.choose(draft, 0.0) == 0 and plain_steps > 15, "3 tokens in 4 s lose to plain's 1 token a second"
    for _ in range(60):  # plain steps as the table says: the slow speculative ones fade from the evidence
        now += 1.0
        times.step_ended(0, 1.0, now)
    assert policy.choose(draft, 0.0) > 0


def test_a_machine_slower_than_its_table_keeps_drafting() -> None:
    """Every step twice the table (a busier machine, not the speculative path): the ratio holds, drafting goes on."""
    draft = copy_draft(8, 2)
    policy = trained(CostAwareLength(COST, 8, 1, linear_cost(0.05), cheap_drafts=True), draft, kept=2)
    policy.times = times = StepTimes(1.0)
    now, chosen = 0.0, []
    times.step_ended(0, 1.0, now)
    for _ in range(40):
        k = policy.choose(draft, 0.0)
        chosen.append(k)
        tabled = 1.0 + 0.05 * k
        now += 2 * tabled
        times.step_ended(k, tabled, now)
    assert sum(k > 0 for k in chosen) >= 34, chosen  # a plain step now and then to check, then on


def test_a_sampled_request_keeps_its_seeded_text_however_slow_its_steps_run(
    tiny_target: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Block verification's sample depends on the draft length; a seeded sample must not depend on how busy the
    machine was, so a sampled request follows the table alone (the CI run of 2026-12-07 drew another text)."""
    spec = SpeculationConfig(drafter="ngram", verifier="block", num_draft_tokens=8)
    decode = DecodeConfig(max_new_tokens=24, sampling=SamplingConfig(temperature=1.0))
    prompt = "The capital of France is Paris. The capital of France is Paris. The capital of"

    def sample() -> list[int]:
        decoder = build_decoder(tiny_target, spec, decode, resources=Resources(models=(tiny_target,)))
        assert decoder.draft_length_policy == "cost"
        return decoder.generate(prompt, use_chat=False, generator=torch.Generator().manual_seed(0)).token_ids

    expected = sample()
    # a machine whose steps take anything from a millisecond to 10 s: speculative ones often far above the table
    clock = iter(np.cumsum(np.random.default_rng(0).uniform(0.001, 10.0, 100_000)))

    class SlowClock:
        @staticmethod
        def perf_counter() -> float:
            return float(next(clock))

    monkeypatch.setattr("flyspec.decoding.draft_length.time", SlowClock)
    assert sample() == expected
    greedy = build_decoder(tiny_target, spec, resources=Resources(models=(tiny_target,)))
    assert greedy.new_draft_length(greedy=True).timed and not greedy.new_draft_length(greedy=False).timed
