"""AdaSD as flyspec reads it: hand-built tables for the threshold, the state and the guards; a property of the
threshold; end to end on tiny random models (strict before both classes are seen, loose after); the state made per
generation, never shared between two generations of one decoder or two requests of one server; the plumbing
(flags, speculative_config, profiles, the vLLM plugin's refusal, the calibration grid)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flyspec.api import build_decoder
from flyspec.calibration.space import points
from flyspec.cli.app import main
from flyspec.config import AdasdConfig, ConfigError, DecodeConfig, GuardConfig, SamplingConfig, SpeculationConfig
from flyspec.profiles import looser
from flyspec.resources import Resources
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.sampling.coupled import Draws
from flyspec.sampling.sampler import make_generator
from flyspec.server.app import create_app
from flyspec.server.settings import ServerSecurity, describe
from flyspec.types import Draft, Verdict, VerifyContext
from flyspec.verifiers.adasd import AdasdState, AdasdVerifier, threshold
from flyspec.verifiers.distributions import divergence
from server_helpers import RunningServer

BARE = GuardConfig.bare()
GREEDY = SamplingConfig()
P = [0.5, 0.3, 0.15, 0.05]  # the target at the first position: its choice is token 0
CERTAIN = [0.97, 0.01, 0.01, 0.01]
NEAR = [0.45, 0.35, 0.15, 0.05]  # a draft distribution close to P
FAR = [0.05, 0.9, 0.03, 0.02]  # one far from it
CPU = torch.device("cpu")


def js(target: list[float], drafted: list[float]) -> float:
    return divergence(torch.tensor([target]), torch.tensor([drafted]), "js").item()


def logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows).log()


def draft(tokens: list[int], distribution: list[list[float]]) -> Draft:
    return Draft(torch.tensor(tokens), draft_distribution=torch.tensor(distribution))


def learnt(mean_accepted: float, mean_rejected: float, samples: int = 8) -> AdasdState:
    """A state that has seen ``samples`` positions of each class at these mean distances."""
    sums = torch.tensor([mean_accepted * samples, mean_rejected * samples], dtype=torch.float32)
    return AdasdState(sums, torch.tensor([samples, samples]))


def context_of(state: AdasdState, output_length: int = 100) -> VerifyContext:
    return VerifyContext(list(range(output_length)), 0, rule_state=state)


def verify(verifier: AdasdVerifier, state: AdasdState | None, drafted: Draft, table: torch.Tensor) -> Verdict:
    return verifier.verify(drafted, table, GREEDY, None, context_of(state) if state is not None else None)


# --- the threshold -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("scale", "expected"), [(0.0, 0.1), (0.5, 0.2), (1.0, 0.3), (1.5, 0.4), (2.0, 0.5)])
def test_the_threshold_moves_from_the_accepted_mean_to_the_rejected_one(scale: float, expected: float) -> None:
    assert threshold(0.1, 0.5, scale) == pytest.approx(expected)
    assert learnt(0.1, 0.5).threshold(AdasdConfig(scale=scale), CPU).item() == pytest.approx(expected, abs=1e-6)


means = st.floats(0.0, math.log(2), allow_nan=False)


@given(mean_accepted=means, mean_rejected=means, scale=st.floats(0.0, 2.0), samples=st.integers(1, 500))
def test_for_a_scale_in_0_2_the_threshold_lies_between_the_two_means(
    mean_accepted: float, mean_rejected: float, scale: float, samples: int
) -> None:
    low, high = sorted((mean_accepted, mean_rejected))
    assert low - 1e-12 <= threshold(mean_accepted, mean_rejected, scale) <= high + 1e-12
    state = learnt(mean_accepted, mean_rejected, samples)  # the same through the state's float32 sums
    assert low - 1e-6 <= state.threshold(AdasdConfig(min_samples=samples, scale=scale), CPU).item() <= high + 1e-6


@pytest.mark.parametrize(("accepted", "rejected", "strict"), [(7, 8, True), (8, 7, True), (0, 0, True), (8, 8, False)])
def test_the_rule_is_exact_until_both_classes_hold_min_samples(accepted: int, rejected: int, strict: bool) -> None:
    state = AdasdState(torch.tensor([0.01 * accepted, 0.6 * rejected]), torch.tensor([accepted, rejected]))
    assert math.isnan(state.threshold(AdasdConfig(min_samples=8), CPU).item()) is strict
    verdict = verify(AdasdVerifier(guard=BARE), state, draft([1, 0], [NEAR, CERTAIN]), logits(P, CERTAIN, CERTAIN))
    assert verdict.tokens == ([0] if strict else [1, 0, 0])  # JS(P, NEAR) ~ 0.003 <= 0.01 + (0.6 - 0.01) / 2


# --- hand-built verdicts ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mean_rejected", "scale", "drafted", "kept"),
    [
        (0.099, 1.0, NEAR, True),  # JS ~ 0.003 <= 0.001 + (0.099 - 0.001) / 2 = 0.05
        (0.099, 1.0, FAR, False),  # JS ~ 0.26 > 0.05
        (0.3, 2.0, FAR, True),  # <= the rejected tokens' mean
        (0.3, 0.0, NEAR, False),  # > the accepted tokens' mean, 0.001
    ],
)
def test_a_mismatch_is_kept_when_its_distance_is_within_the_learnt_threshold(
    mean_rejected: float, scale: float, drafted: list[float], kept: bool
) -> None:
    verifier = AdasdVerifier(AdasdConfig(scale=scale), guard=BARE)
    table = logits(P, CERTAIN, CERTAIN)
    verdict = verify(verifier, learnt(0.001, mean_rejected), draft([1, 0], [drafted, CERTAIN]), table)
    if kept:
        assert verdict.tokens == [1, 0, 0] and verdict.loose_positions == (0,)
        assert verdict.loose[0].evidence == pytest.approx(js(P, drafted), abs=1e-6)
    else:
        assert verdict == Verdict(tokens=[0], num_accepted=0)


@pytest.mark.parametrize(("guard", "kept"), [(GuardConfig.bare(), True), (GuardConfig(top_k=1, protect=()), False)])
def test_a_kept_mismatch_still_passes_the_trust_guards(guard: GuardConfig, kept: bool) -> None:
    # token 1 is the target's second choice: the top-1 guard vetoes it, and the target's token 0 is committed
    verdict = verify(AdasdVerifier(guard=guard), learnt(0.001, 0.5), draft([1], [NEAR]), logits(P, CERTAIN))
    assert verdict.tokens == ([1, 0] if kept else [0])
    guarded = AdasdVerifier(guard=GuardConfig(exact_first=16, top_k=0, protect=(), repeat_ngram=0))
    early = guarded.verify(draft([1], [NEAR]), logits(P, CERTAIN), GREEDY, None, context_of(learnt(0.001, 0.5), 3))
    assert early.tokens == [0]  # the first 16 output tokens are verified exactly


def test_the_judged_positions_run_through_the_first_one_not_kept() -> None:
    """Strict: the exact rule's accepted prefix and its first rejection; after it nothing is counted."""
    state = AdasdState()
    table = logits(CERTAIN, CERTAIN, P, CERTAIN, CERTAIN)  # the target's choice is 0 everywhere
    verdict = verify(AdasdVerifier(guard=BARE), state, draft([0, 0, 1, 0], [NEAR, P, FAR, FAR]), table)
    assert verdict.tokens == [0, 0, 0]
    assert state.samples() == (2, 1)  # positions 0, 1 accepted, 2 rejected; 3 not judged
    accepted, rejected = state.means()
    assert accepted == pytest.approx((js(CERTAIN, NEAR) + js(CERTAIN, P)) / 2, abs=1e-6)
    assert rejected == pytest.approx(js(P, FAR), abs=1e-6)


def test_a_loose_accept_counts_as_rejected_and_the_run_goes_on() -> None:
    """Once learnt, a kept mismatch is a rejection of the exact rule; the positions after it are judged too."""
    state = learnt(0.001, 0.5)  # threshold 0.2505
    table = logits(P, CERTAIN, CERTAIN, CERTAIN, CERTAIN)
    verdict = verify(AdasdVerifier(guard=BARE), state, draft([1, 0, 2, 0], [NEAR, CERTAIN, FAR, P]), table)
    assert verdict.tokens == [1, 0, 0] and verdict.loose_positions == (0,)  # FAR at 2: JS(CERTAIN, FAR) > 0.25
    assert state.samples() == (9, 10)  # + position 1 accepted, + positions 0 and 2 rejected; 3 not judged
    assert state.sums is not None
    assert state.sums[0].item() == pytest.approx(0.008 + js(CERTAIN, CERTAIN), abs=1e-6)
    assert state.sums[1].item() == pytest.approx(4.0 + js(P, NEAR) + js(CERTAIN, FAR), abs=1e-5)


def test_the_threshold_is_the_states_at_the_start_of_the_step() -> None:
    """Seven of each class before the step: this step's own positions do not open the rule within it."""
    state = AdasdState(torch.tensor([0.007, 3.5]), torch.tensor([7, 7]))
    table = logits(CERTAIN, P, CERTAIN)
    verdict = verify(AdasdVerifier(guard=BARE), state, draft([0, 1], [CERTAIN, NEAR]), table)
    assert verdict.tokens == [0, 0]  # strict: 8 accepted only after this step, and 8 rejected
    assert state.samples() == (8, 8)
    again = verify(AdasdVerifier(guard=BARE), state, draft([0, 1], [CERTAIN, NEAR]), table)
    assert again.tokens == [0, 1, 0] and again.loose_positions == (1,)  # learnt now


def test_greedy_draws_no_random_numbers() -> None:
    draws = Draws.seeded(5)
    before = draws.generator.get_state()
    state = learnt(0.001, 0.5)
    AdasdVerifier(guard=BARE).verify(draft([1, 0], [NEAR, CERTAIN]), logits(P, CERTAIN, CERTAIN), GREEDY, draws,
                                     context_of(state))  # fmt: skip
    assert torch.equal(draws.generator.get_state(), before) and draws.noise.num_rows_drawn == 0


def test_without_a_generation_the_rule_is_exact_and_it_needs_a_distribution() -> None:
    table = logits(P, CERTAIN)
    assert verify(AdasdVerifier(guard=BARE), None, draft([1], [NEAR]), table) == Verdict(tokens=[0], num_accepted=0)
    with pytest.raises(ConfigError, match="distribution"):
        AdasdVerifier().verify(Draft(torch.tensor([1])), table, GREEDY, None, context_of(AdasdState()))
    with pytest.raises(ConfigError, match="vLLM plugin"):
        AdasdVerifier().candidates(torch.tensor([False]), torch.tensor([1]), table)
    empty = AdasdVerifier().verify(Draft.empty(), logits(P), GREEDY, None, context_of(AdasdState()))
    assert empty.tokens == [0]


# --- end to end ----------------------------------------------------------------------------------------------------

MODEL_DRAFTS = {
    "draft-model": {"drafter": "draft-model", "draft_model": "tiny-target-seed0-noisy0.3"},  # conftest's tiny_draft
    "layer-skip": {"drafter": "layer-skip", "skip_layers": (1,)},
}
MAX_NEW_TOKENS = 24
PROMPTS = ("Once upon a time there was a cat and a cat", "The capital of France is Paris. The capital of")


def adasd_spec(drafter: str, **adasd: Any) -> SpeculationConfig:
    options = {**MODEL_DRAFTS[drafter], "num_draft_tokens": 5, "profile": "none"}
    return SpeculationConfig(adasd=AdasdConfig(**adasd)).with_options({**options, "verifier": "adasd",
                                                                        "bare_rule": True})  # fmt: skip


@pytest.mark.parametrize(("drafter", "temperature"), [("draft-model", 0.0), ("layer-skip", 0.0), ("draft-model", 1.0)])
def test_strict_until_learnt_end_to_end(
    tiny_target: LoadedModel, tiny_draft: LoadedModel, drafter: str, temperature: float
) -> None:
    """min_samples above the output length: never learnt, so exact's output (at T > 0 with the same seed: the same
    draws); greedy, min_samples 1 at scale 2 loosens."""
    resources = Resources("float32", models=(tiny_target, tiny_draft))
    decode = DecodeConfig(max_new_tokens=MAX_NEW_TOKENS, sampling=SamplingConfig(temperature=temperature))
    prompt = tiny_target.tokenizer(PROMPTS[0]).input_ids

    def run(spec: SpeculationConfig) -> Any:
        decoder = build_decoder(tiny_target, spec, decode, resources=resources)
        return decoder.generate(prompt, generator=make_generator(7))

    exact = run(SpeculationConfig().with_options({**MODEL_DRAFTS[drafter], "num_draft_tokens": 5}))
    strict = run(adasd_spec(drafter, min_samples=MAX_NEW_TOKENS + 1, scale=2.0))
    assert strict.token_ids == exact.token_ids and strict.stats.num_loose_accepts == 0
    if temperature == 0.0:  # (sampled, the tiny random target's draws rarely match a draft: nothing to learn from)
        assert run(adasd_spec(drafter, min_samples=1, scale=2.0)).stats.num_loose_accepts > 0


@pytest.fixture
def first_steps(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[AdasdState, list[int]]]]:
    """Every step's state and its counts before the step, in order (the states themselves kept alive)."""
    seen: list[tuple[AdasdState, list[int]]] = []
    relax = AdasdVerifier.relax

    def spy(self: AdasdVerifier, draft: Draft, target_logits: torch.Tensor, *args: Any) -> Verdict:
        context = args[2]
        seen.append((context.rule_state, list(context.rule_state.samples())))
        return relax(self, draft, target_logits, *args)

    monkeypatch.setattr(AdasdVerifier, "relax", spy)
    yield seen


def generations(seen: list[tuple[AdasdState, list[int]]]) -> list[list[list[int]]]:
    """The counts before each step, grouped by state object (one group per generation)."""
    groups: dict[int, list[list[int]]] = {}
    for state, counts in seen:
        groups.setdefault(id(state), []).append(counts)
    return list(groups.values())


def test_one_decoder_makes_a_state_per_generation(
    tiny_target: LoadedModel, tiny_draft: LoadedModel, first_steps: list
) -> None:
    resources = Resources("float32", models=(tiny_target, tiny_draft))
    spec = adasd_spec("draft-model", min_samples=1, scale=2.0)
    decode = DecodeConfig(max_new_tokens=MAX_NEW_TOKENS)
    decoder = build_decoder(tiny_target, spec, decode, resources=resources)
    second, first = (tiny_target.tokenizer(prompt).input_ids for prompt in PROMPTS)  # the second loosens
    decoder.generate(first)
    after_another = decoder.generate(second)
    groups = generations(first_steps)
    assert len(groups) == 2 and all(group[0] == [0, 0] for group in groups)  # each starts with nothing learnt
    assert groups[0][-1] != [0, 0]  # and the first had learnt something the second did not inherit
    alone = build_decoder(tiny_target, spec, decode, resources=resources).generate(second)
    assert after_another.token_ids == alone.token_ids and alone.stats.num_loose_accepts > 0


def test_two_requests_of_one_server_do_not_share_a_state(tiny_target: LoadedModel, first_steps: list) -> None:
    spec = adasd_spec("layer-skip", min_samples=1, scale=2.0)
    app = create_app(tiny_target, spec, security=ServerSecurity(allow_request_speculative="all"), served_model_name="t")
    bodies = [{"model": "t", "prompt": prompt, "max_tokens": MAX_NEW_TOKENS, "temperature": 0} for prompt in PROMPTS]
    with RunningServer(app) as server:
        answers = [httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json() for body in bodies]
    groups = generations(first_steps)
    assert len(groups) == 2 and all(group[0] == [0, 0] for group in groups) and groups[0][-1] != [0, 0]
    decoder = build_decoder(tiny_target, spec, DecodeConfig(max_new_tokens=MAX_NEW_TOKENS))
    alone = decoder.generate(PROMPTS[1], use_chat=False)
    assert answers[1]["choices"][0]["text"] == alone.text
    assert answers[1]["flyspec"]["verifier"] == "adasd"


# --- plumbing ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"min_samples": 0}, "min_samples must be >= 1"),
        ({"scale": -0.1}, r"scale must be a number in \[0, 2\]"),
        ({"scale": 2.5}, r"scale must be a number in \[0, 2\]"),
        ({"scale": math.nan}, "scale"),
    ],
)
def test_a_setting_outside_the_rules_range_is_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AdasdConfig(**fields)


def test_cli_flags_speculative_config_requests_and_profiles(capsys: pytest.CaptureFixture[str]) -> None:
    model = {"drafter": "draft-model", "draft_model": "d", "verifier": "adasd"}
    spec = SpeculationConfig().with_options({**model, "adasd_min_samples": 16, "adasd_scale": 0.5})
    assert spec.adasd == AdasdConfig(min_samples=16, scale=0.5)
    adasd = {"min_samples": 16, "scale": 0.5}
    vllm_style = {"method": "draft_model", "model": "d", "verifier": "adasd", "adasd": adasd}
    assert SpeculationConfig.from_dict(vllm_style) == spec
    described = describe(spec)
    assert described["adasd_min_samples"] == 16 and described["adasd_scale"] == 0.5 and not described["lossless"]
    assert looser(spec, spec) == []
    looser_spec = SpeculationConfig().with_options({**model, "adasd_min_samples": 8, "adasd_scale": 1.0})
    assert looser(spec, looser_spec) == ["adasd scale 1 is above the profile's 0.5",
                                         "adasd min_samples 8 is below the profile's 16"]  # fmt: skip
    for argv in (["generate", "--verifier", "adasd", "hello"], ["generate", "--adasd-scale", "3", "hello"]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        err = capsys.readouterr().err.strip()
        assert exited.value.code == 2 and "\n" not in err and ("distribution" in err or "adasd scale" in err)


def test_the_grid_has_adasd_where_the_drafter_gives_a_distribution() -> None:
    assert not any(point.rule == "adasd" for point in points(SpeculationConfig()))  # n-gram drafts
    for drafter in MODEL_DRAFTS.values():
        spec = SpeculationConfig().with_options(drafter)
        found = [point for point in points(spec, exact_first=(0, 16)) if point.rule == "adasd"]
        assert {point.family for point in found} == {"adasd n>=8", "adasd n>=32", "adasd n>=8 first16",
                                                     "adasd n>=32 first16"}  # fmt: skip
        settings = {(point.speculation.adasd.min_samples, point.speculation.adasd.scale) for point in found}
        assert settings == {(n, scale) for n in (8, 32) for scale in (0.5, 1.0, 1.5)}
        for point in found:  # strict to loose: the scale grows with the order
            assert point.speculation.adasd.scale == (0.5, 1.0, 1.5)[point.order]
            assert point.speculation.guard.exact_first == (16 if point.family.endswith("first16") else 0)
