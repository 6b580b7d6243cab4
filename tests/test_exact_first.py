"""The exact-first correction (``GuardConfig.exact_first``): the first L output tokens are verified exactly, under
every lossy rule, in bare rules too; plumbing through flags, requests, profiles and calibrate's axis."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flyspec.calibration.space import points
from flyspec.cli.app import main
from flyspec.config import ConfigError, FlyConfig, GuardConfig, SamplingConfig, SpeculationConfig
from flyspec.profiles import looser
from flyspec.server.settings import describe, for_request
from flyspec.types import Draft, VerifyContext
from flyspec.verifiers.registry import make_verifier
from test_guard import CAT, DOG, SAT, THE, VOCABULARY, logits_for

LOOSE = SpeculationConfig(verifier="fly", fly=FlyConfig(window_size=0, entropy_threshold=0.0))


def verdict(output_length: int | None, exact_first: int, draft: list[int], top: list[int], second: list[int]):
    guard = dataclasses.replace(GuardConfig.bare(), exact_first=exact_first)
    context = None if output_length is None else VerifyContext([THE] * (2 + output_length), 2, VOCABULARY)
    verifier = make_verifier("fly", dataclasses.replace(LOOSE, guard=guard))
    return verifier.verify(Draft(torch.tensor(draft)), logits_for(top, second), SamplingConfig(), None, context)


@pytest.mark.parametrize(
    ("output_length", "exact_first", "loose"),
    [
        (0, 0, (0, 1)),  # off: the runner-ups are kept
        (0, 1, ()),  # the first output token is exact: the step ends there
        (1, 2, ()),  # output token 1 is still inside the first 2
        (2, 2, (0, 1)),  # past the first 2
        (1, 1, (0, 1)),
    ],
)
def test_loose_accepts_start_only_after_the_first_l_output_tokens(output_length, exact_first, loose) -> None:
    result = verdict(output_length, exact_first, [DOG, SAT], [CAT, CAT, THE], [DOG, SAT])
    assert result.loose_positions == loose
    if not loose:
        assert result.tokens == [CAT] and result.vetoes == ("exact-first",)


def test_a_later_draft_position_inside_the_first_l_is_vetoed_too() -> None:
    # output of 1 token, exact_first 3: draft positions 0 and 1 land on output tokens 1 and 2, position 2 on 3
    result = verdict(1, 3, [CAT, DOG, SAT], [CAT, CAT, THE, THE], [DOG, DOG, SAT])
    assert result.tokens == [CAT, CAT] and result.vetoes == ("exact-first",)
    result = verdict(1, 3, [CAT, CAT, SAT], [CAT, CAT, THE, THE], [DOG, DOG, SAT])
    assert result.loose_positions == (2,)


def test_without_a_context_every_draft_is_the_start_of_the_output() -> None:
    assert verdict(None, 1, [DOG], [CAT, THE], [DOG]).vetoes == ("exact-first",)
    assert verdict(None, 0, [DOG], [CAT, THE], [DOG]).loose_positions == (0,)


def test_it_is_an_option_of_every_rule_kept_by_the_bare_rule_and_refused_when_negative() -> None:
    guard = GuardConfig(exact_first=16)
    assert guard.with_options(None, bare_rule=True).exact_first == 16
    assert guard.with_options(None, bare_rule=True).is_bare  # still the papers' rule, corrected
    assert GuardConfig.bare().with_options(None, bare_rule=False) == GuardConfig()
    with pytest.raises(ConfigError, match="exact_first must be >= 0"):
        GuardConfig(exact_first=-1)
    spec = SpeculationConfig().with_options({"verifier": "margin", "exact_first": 8})
    assert spec.guard.exact_first == 8 and describe(spec)["exact_first"] == 8
    with pytest.raises(ConfigError, match="exact_first applies to verifier"):
        for_request(SpeculationConfig(), {"exact_first": 8})  # exact is lossless: nothing to correct
    assert looser(spec, dataclasses.replace(spec, guard=GuardConfig(exact_first=4))) == [
        "exact_first 4 is below the profile's 8"
    ]
    assert looser(spec, dataclasses.replace(spec, guard=GuardConfig(exact_first=32))) == []


def test_calibrate_runs_every_lossy_point_once_per_exact_first_value() -> None:
    plain = points(SpeculationConfig())
    both = points(SpeculationConfig(), exact_first=(0, 16))
    lossy = [point for point in plain if not point.lossless]
    assert len(both) == len(plain) + len(lossy)
    corrected = [point for point in both if point.speculation.guard.exact_first]
    assert {point.family for point in corrected} == {f"{point.family} first16" for point in lossy}
    assert all(point.settings["exact_first"] == 16 and point.name.endswith(" first16") for point in corrected)
    only = points(SpeculationConfig(), exact_first=(16,))
    assert [point.lossless for point in only].count(True) == [point.lossless for point in plain].count(True)
    assert all(point.speculation.guard.exact_first == 16 for point in only if not point.lossless)
    with pytest.raises(ConfigError, match="exact-first"):
        points(SpeculationConfig(), exact_first=(-1,))


@pytest.mark.parametrize("value", ["x", "-1", "", "1.5"])
def test_a_bad_calibrate_exact_first_is_one_line_and_exit_2(capsys, tiny_model_dir, value) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["calibrate", "--target", str(tiny_model_dir), "--exact-first", value])
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and "--exact-first" in err and "\n" not in err


def test_a_whole_output_inside_the_first_l_tokens_is_plain_decodings_own(tiny_target, tiny_draft) -> None:
    from flyspec.api import build_decoder
    from flyspec.config import DecodeConfig
    from flyspec.resources import Resources

    decode = DecodeConfig(max_new_tokens=24)
    prompt = tiny_target.tokenizer("Once upon a time there was a cat and a cat and a cat").input_ids
    spec = SpeculationConfig(
        drafter="draft-model", draft_model=tiny_draft.name, verifier="typical", num_draft_tokens=6, profile="none"
    )
    spec = dataclasses.replace(spec, guard=GuardConfig.bare())

    def run(exact_first: int):
        guard = dataclasses.replace(spec.guard, exact_first=exact_first)
        decoder = build_decoder(tiny_target, dataclasses.replace(spec, guard=guard), decode, resources=resources)
        return decoder.generate(prompt)

    resources = Resources("float32", models=(tiny_target, tiny_draft))
    loose = run(0)
    assert loose.stats.num_loose_accepts > 0  # the rule does loosen here, so the correction has work to do
    corrected = run(24)
    exact = build_decoder(tiny_target, dataclasses.replace(spec, verifier="exact"), decode, resources=resources)
    assert corrected.stats.num_loose_accepts == 0
    assert corrected.token_ids == exact.generate(prompt).token_ids
    partly = run(8)
    assert all(index >= 8 for index in partly.loose_token_indices) and partly.loose_token_indices
