"""Lenience, FSD, speculative cascades (hand-built distributions → the exact Verdict; lenience's T > 0 rates), and
their plumbing: the draft model's distribution, refusals with n-gram drafts and in the vLLM plugin, flags, requests,
profiles, the calibration grid."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flyspec.calibration.space import points
from flyspec.cli.app import main
from flyspec.config import (
    CascadeConfig,
    ConfigError,
    DecodeConfig,
    FsdConfig,
    GuardConfig,
    LenienceConfig,
    SamplingConfig,
    SpeculationConfig,
)
from flyspec.drafters.registry import make_drafter
from flyspec.profiles import looser
from flyspec.sampling.coupled import Draws
from flyspec.server.settings import describe
from flyspec.types import Draft, Verdict
from flyspec.verifiers.cascade import CascadeVerifier, defers
from flyspec.verifiers.distributions import divergence
from flyspec.verifiers.fsd import FsdVerifier
from flyspec.verifiers.lenience import LenienceVerifier

BARE = GuardConfig.bare()
GREEDY = SamplingConfig()
UNIT = SamplingConfig(temperature=1.0)
P = [0.5, 0.3, 0.15, 0.05]  # the target at the first position
CERTAIN = [0.97, 0.01, 0.01, 0.01]


def logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows).log()


def draft(tokens: list[int], distribution: list[list[float]] | None = None, probs=None) -> Draft:
    dist = torch.tensor(distribution) if distribution is not None else None
    return Draft(torch.tensor(tokens), probs, draft_distribution=dist)


# --- lenience (Leviathan et al., appendix A.5) ---------------------------------------------------------------------


@pytest.mark.parametrize(("lenience", "kept"), [(0.55, True), (0.65, False), (1.0, False)])
def test_greedy_lenience_keeps_a_token_with_p_at_least_l_times_the_top(lenience: float, kept: bool) -> None:
    verifier = LenienceVerifier(LenienceConfig(lenience), guard=BARE)
    verdict = verifier.verify(draft([1]), logits(P, CERTAIN), GREEDY, None)  # p(1) / max p = 0.6
    if kept:
        assert verdict.tokens == [1, 0] and verdict.loose_positions == (0,)
        assert verdict.loose[0].evidence == pytest.approx(0.6, abs=1e-5)
    else:
        assert verdict == Verdict(tokens=[0], num_accepted=0)


@pytest.mark.parametrize(("lenience", "rate"), [(1.0, 0.15), (0.5, 0.30), (0.1, 1.0)])
def test_at_t_above_0_an_ngram_token_is_kept_with_probability_p_over_l(lenience: float, rate: float) -> None:
    verifier = LenienceVerifier(LenienceConfig(lenience), guard=BARE)
    kept = [
        verifier.verify(draft([2]), logits(P, CERTAIN), UNIT, Draws.seeded(seed)).num_accepted for seed in range(4000)
    ]
    assert np.mean(kept) == pytest.approx(rate, abs=0.025)  # min(1, p(2) / l) with p(2) = 0.15


def test_at_t_above_0_with_draft_probabilities_the_rate_is_leviathans() -> None:
    target, drafted = torch.tensor(P), torch.tensor([0.1, 0.1, 0.4, 0.4])
    lenience = 0.5
    verifier = LenienceVerifier(LenienceConfig(lenience), guard=BARE)
    table = logits(P, CERTAIN)
    kept = []
    for seed in range(6000):  # each draft token drawn with its generation's token noise, as a draft model draws it
        draws = Draws.seeded(seed)
        token = int(draws.choose(drafted.log()[None], UNIT)[0])
        kept.append(verifier.verify(draft([token], probs=drafted[None]), table, UNIT, draws).num_accepted)
    expected = float(torch.minimum(target / lenience, drafted).sum())  # alpha = sum_x min(p(x) / l, q(x))
    assert np.mean(kept) == pytest.approx(expected, abs=0.025)
    assert expected > float(torch.minimum(target, drafted).sum()) + 0.1  # more than rejection sampling keeps


# --- FSD -----------------------------------------------------------------------------------------------------------


def test_divergences_are_the_textbook_ones() -> None:
    p, q = torch.tensor([[0.5, 0.5, 0.0]]), torch.tensor([[0.0, 0.5, 0.5]])
    assert divergence(p, p, "js").item() == pytest.approx(0.0, abs=1e-7)
    assert divergence(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]]), "js").item() == pytest.approx(
        math.log(2), abs=1e-6
    )
    assert divergence(p, q, "tv").item() == pytest.approx(0.5)
    target, drafted = torch.tensor([[0.7, 0.2, 0.1]]), torch.tensor([[0.2, 0.5, 0.3]])
    draft_first = 0.2 * math.log(0.2 / 0.7) + 0.5 * math.log(0.5 / 0.2) + 0.3 * math.log(0.3 / 0.1)
    assert divergence(target, drafted, "kl").item() == pytest.approx(draft_first, abs=1e-6)  # KL(draft || target)
    assert divergence(drafted, target, "kl").item() != pytest.approx(draft_first, abs=1e-3)


@pytest.mark.parametrize(("threshold", "kept"), [(0.05, True), (0.001, False)])
def test_fsd_keeps_a_mismatch_where_the_distributions_agree(threshold: float, kept: bool) -> None:
    near = [0.45, 0.35, 0.15, 0.05]  # the draft model's distribution: close to P (JS about 0.003)
    verifier = FsdVerifier(FsdConfig(threshold=threshold), guard=BARE)
    verdict = verifier.verify(draft([1, 0], [near, CERTAIN]), logits(P, CERTAIN, CERTAIN), GREEDY, None)
    js = divergence(torch.tensor([P]), torch.tensor([near]), "js").item()
    if kept:
        assert verdict.tokens == [1, 0, 0] and verdict.loose_positions == (0,)
        assert verdict.loose[0].evidence == pytest.approx(js, abs=1e-6)
    else:
        assert verdict == Verdict(tokens=[0], num_accepted=0)


def test_fsd_refuses_a_draft_without_a_distribution() -> None:
    with pytest.raises(ConfigError, match="distribution"):
        FsdVerifier(guard=BARE).verify(draft([1]), logits(P, CERTAIN), GREEDY, None)
    with pytest.raises(ConfigError, match="vLLM plugin"):
        FsdVerifier().candidates(torch.tensor([False]), torch.tensor([1]), logits(P, CERTAIN))


# --- speculative cascades ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rule", "lenience", "draft_row", "defer"),
    [
        ("chow", 0.1, [0.05, 0.92, 0.02, 0.01], False),  # max q 0.92 >= 0.9
        ("chow", 0.1, [0.1, 0.85, 0.04, 0.01], True),
        ("diff", 0.0, [0.1, 0.6, 0.2, 0.1], False),  # max q 0.6 >= max p 0.5
        ("diff", 0.0, [0.3, 0.45, 0.2, 0.05], True),
        ("diff", 0.1, [0.3, 0.45, 0.2, 0.05], False),  # 0.45 >= 0.5 - 0.1
        ("opt", 0.5, [0.3, 0.45, 0.2, 0.05], False),  # TV 0.2: 0.45 >= 0.5 - 0.5 * 0.2
        ("opt", -0.5, [0.3, 0.45, 0.2, 0.05], True),  # 0.45 < 0.5 + 0.5 * 0.2
    ],
)
def test_deferral_rules(rule: str, lenience: float, draft_row: list[float], defer: bool) -> None:
    target, drafted = torch.tensor([P]), torch.tensor([draft_row])
    assert bool(defers(target, drafted, rule, lenience)[0]) is defer
    verifier = CascadeVerifier(CascadeConfig(rule, lenience), guard=BARE)
    verdict = verifier.verify(draft([1], [draft_row]), logits(P, CERTAIN), GREEDY, None)
    assert verdict.tokens == ([0] if defer else [1, 0])
    if not defer:
        assert verdict.loose[0].evidence == pytest.approx(max(draft_row), abs=1e-6)


@pytest.mark.parametrize(("rule", "lenience"), [("chow", 1.5), ("diff", -2.0), ("opt", math.inf), ("nope", 0.1)])
def test_a_lenience_outside_the_rules_range_is_refused(rule: str, lenience: float) -> None:
    with pytest.raises(ConfigError, match="cascade"):
        CascadeConfig(rule, lenience)


# --- plumbing ------------------------------------------------------------------------------------------------------


def test_distribution_rules_need_a_draft_model_in_one_line(capsys) -> None:
    for verifier in ("fsd", "cascade", "adasd"):
        with pytest.raises(ConfigError, match="--drafter layer-skip, or draft-model or multilevel"):
            SpeculationConfig(verifier=verifier)
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--verifier", "fsd", "hello"])
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and "draft model's distribution" in err and "\n" not in err


def test_flags_requests_and_profiles_for_each_rule() -> None:
    model = {"drafter": "draft-model", "draft_model": "d"}
    cases = {
        "lenience": ({"lenience": 0.4}, {"lenience": 0.3}, "lenience 0.3 is below the profile's 0.4"),
        "fsd": ({"fsd_threshold": 0.1, "fsd_divergence": "tv"}, {"fsd_threshold": 0.2, "fsd_divergence": "tv"},
                "fsd threshold 0.2 is above the profile's 0.1"),
        "cascade": ({"cascade_rule": "diff", "cascade_lenience": 0.0},
                    {"cascade_rule": "diff", "cascade_lenience": 0.1}, "cascade lenience 0.1 is above the profile's 0"),
    }  # fmt: skip
    for verifier, (options, loosened, reason) in cases.items():
        spec = SpeculationConfig().with_options({**model, "verifier": verifier, **options})
        described = describe(spec)
        assert not described["lossless"] and all(described[name] == value for name, value in options.items())
        assert looser(spec, spec) == []
        assert looser(spec, SpeculationConfig().with_options({**model, "verifier": verifier, **loosened})) == [reason]


def test_the_calibration_grid_has_the_distribution_families_only_for_model_drafts() -> None:
    ngram = {point.family for point in points(SpeculationConfig())}
    assert "lenience" in ngram and not any(family.startswith(("fsd", "cascade")) for family in ngram)
    skipped = {point.family for point in points(SpeculationConfig(drafter="layer-skip"))}
    assert {"fsd", "cascade chow", "cascade diff", "cascade opt"} <= skipped
    drafted = points(SpeculationConfig(drafter="draft-model", draft_model="d"))
    families = {point.family for point in drafted}
    assert {"fsd", "cascade chow", "cascade diff", "cascade opt", "lenience"} <= families
    for family in ("fsd", "cascade chow", "lenience"):  # orders run strict to loose
        orders = [point.order for point in drafted if point.family == family]
        assert orders == list(range(len(orders))) and len(orders) >= 5


MODEL_DRAFTS = {
    "draft-model": lambda draft_model: {"drafter": "draft-model", "draft_model": draft_model.name},
    # the target's own skip view: its early exit goes through the target's norm and head
    "layer-skip": lambda draft_model: {"drafter": "layer-skip", "skip_layers": (1,)},
}


@pytest.mark.parametrize("drafter", list(MODEL_DRAFTS))
@pytest.mark.parametrize(
    ("verifier", "strict", "loose"),
    [
        ("fsd", {"fsd_threshold": 0.0}, {"fsd_threshold": 0.69}),
        ("cascade", {"cascade_lenience": 0.0}, {"cascade_lenience": 1.0}),
    ],
)
def test_a_model_draft_carries_its_distribution_end_to_end(
    tiny_target, tiny_draft, drafter, verifier, strict, loose
) -> None:
    from flyspec.api import build_decoder
    from flyspec.resources import Resources

    resources = Resources("float32", models=(tiny_target, tiny_draft))
    decode = DecodeConfig(max_new_tokens=24)
    prompt = tiny_target.tokenizer("Once upon a time there was a cat and a cat").input_ids
    base = {**MODEL_DRAFTS[drafter](tiny_draft), "num_draft_tokens": 5, "profile": "none"}

    def run(options):
        spec = SpeculationConfig().with_options({**base, "verifier": verifier, "bare_rule": True, **options})
        return build_decoder(tiny_target, spec, decode, resources=resources).generate(prompt)

    exact = build_decoder(tiny_target, SpeculationConfig().with_options(base), decode, resources=resources)
    assert run(strict).token_ids == exact.generate(prompt).token_ids  # nothing within a threshold of 0 / defers all
    loosened = run(loose)
    assert loosened.stats.num_loose_accepts > 0


def test_a_layer_skip_draft_is_the_skip_views_own_distribution_over_the_targets_vocabulary(tiny_target) -> None:
    from flyspec.drafters.skip_view import skip_view
    from flyspec.resources import Resources

    spec = SpeculationConfig(drafter="layer-skip", verifier="fsd").with_options({"skip_layers": (1,)})
    drafter = make_drafter(spec, tiny_target, Resources("float32", models=(tiny_target,)))
    prompt = tiny_target.tokenizer("Once upon a time there was a cat").input_ids
    drafter.reset(prompt)
    drafted = drafter.propose(prompt, 4, GREEDY, None)
    distribution = drafted.draft_distribution
    assert distribution is not None and distribution.shape == (4, tiny_target.model.config.vocab_size)
    assert torch.equal(distribution.argmax(-1), drafted.tokens)  # greedy: each token is its row's top
    ids = torch.tensor([[*prompt, *drafted.tokens.tolist()[:-1]]])
    with torch.inference_mode():  # the same skip view, uncached: the rows are its softmax at the draft positions
        expected = torch.softmax(skip_view(tiny_target, (1,)).model(input_ids=ids).logits[0, -4:].float(), dim=-1)
    torch.testing.assert_close(distribution, expected, atol=1e-5, rtol=1e-4)
    drafter.keep_distribution = False
    drafter.reset(prompt)
    assert drafter.propose(prompt, 2, GREEDY, None).draft_distribution is None
