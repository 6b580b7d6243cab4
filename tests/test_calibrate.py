"""flyspec calibrate: replay against live runs, the budget's bounds, the chooser, the projection, the runner.

Tiny random models (conftest) stand in for real ones; ``test_profile.py`` covers profiles, the
server's limit and the circuit breaker.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import make_tiny_model, make_tokenizer, noisy_copy
from flyspec.api import build_decoder
from flyspec.calibration import budget as budget_module
from flyspec.calibration.api import CalibrationConfig, calibrate
from flyspec.calibration.budget import Budget, decisively_above, judge, min_items, upper_bound
from flyspec.calibration.frontier import choose, rank_families
from flyspec.calibration.projection import CostModel, measure_draft_cost, verified_lengths
from flyspec.calibration.replay import DraftStore, ReplayDrafter, ReplayTarget, ScoreStore
from flyspec.calibration.space import points
from flyspec.config import (
    PROFILE_NONE,
    ConfigError,
    DecodeConfig,
    DraftLengthConfig,
    FlyConfig,
    GuardConfig,
    LayerSkipConfig,
    LenienceConfig,
    MarginConfig,
    SamplingConfig,
    SamplingRange,
    SpeculationConfig,
)
from flyspec.decoding.plain import PlainDecoder
from flyspec.decoding.speculative import SpeculativeDecoder
from flyspec.drafters.cross_tokenizer import CrossTokenizerDrafter
from flyspec.drafters.draft_model import DraftModelDrafter
from flyspec.profiles import Profile
from flyspec.resources import Resources
from flyspec.runtime.step_cost import StepCost
from flyspec.sampling.sampler import make_generator
from server_helpers import one_torch_thread  # noqa: F401 - autouse fixture: tiny models run faster on one thread

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time there was", "Speculative decoding drafts"]
FIXED = DraftLengthConfig(policy="fixed")


@pytest.fixture(scope="module")
def models():
    tokenizer = make_tokenizer()
    target = make_tiny_model(tokenizer, 0, layers=4, name="replay-target")
    return {"target": target, "draft": noisy_copy(target, 0.3, 1), "other": make_tiny_model(tokenizer, 9, name="other")}


def _verifier_specs(drafter: str, sampled: bool = False, **extra) -> list[SpeculationConfig]:
    """Lossless and loose rules, bare so that they loosen often on random models (sampled: also the rules that draw
    at T > 0, FLy's two temperature rules and lenience)."""
    base = SpeculationConfig(
        drafter=drafter, num_draft_tokens=8, draft_length=FIXED, guard=GuardConfig.bare(), profile=PROFILE_NONE, **extra
    )
    at_temperature = [
        dataclasses.replace(base, verifier="fly", fly=FlyConfig(window_size=2, temperature_rule="two-sample")),
        dataclasses.replace(base, verifier="fly", fly=FlyConfig(window_size=2, temperature_rule="rejection")),
        dataclasses.replace(base, verifier="lenience", lenience=LenienceConfig(0.3)),
        dataclasses.replace(base, verifier="rejection"),
    ]
    return [
        *(at_temperature if sampled else []),
        dataclasses.replace(base, verifier="exact"),
        dataclasses.replace(base, verifier="fly", fly=FlyConfig(window_size=2, entropy_threshold=0.0)),
        dataclasses.replace(base, verifier="fly", fly=FlyConfig(window_size=3, entropy_threshold=0.2)),
        dataclasses.replace(base, verifier="fly", fly=FlyConfig(window_size=2, min_draft_prob=0.05)),
        dataclasses.replace(base, verifier="margin", margin=MarginConfig(0.5)),
        dataclasses.replace(base, verifier="typical"),
        dataclasses.replace(base, verifier="fly", guard=GuardConfig(), fly=FlyConfig(window_size=2)),
    ]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "T1"])
@pytest.mark.parametrize(
    ("drafter", "extra"),
    [
        ("ngram", {}),
        ("draft-model", {"draft_model": "draft"}),
        ("multilevel", {"draft_model": "draft"}),
        ("layer-skip", {"layer_skip": LayerSkipConfig(skip_layers=(1, 2))}),
    ],
)
def test_replayed_generations_equal_live_ones_for_every_drafter_and_rule(models, drafter, extra, temperature) -> None:
    """Replay answers from shared stores, live runs compute everything: same tokens, forwards and loose accepts.
    Sampled, every decoder of a prompt samples with the same seed (two seeds per prompt, the rows shared by both)."""
    target, draft = models["target"], models["draft"]
    extra = {key: (draft.name if value == "draft" else value) for key, value in extra.items()}
    resources = Resources("float32", models=(target, draft))
    specs = _verifier_specs(drafter, sampled=temperature > 0, **extra)
    decode = DecodeConfig(max_new_tokens=40 if temperature == 0 else 24, sampling=SamplingConfig(temperature))
    scores = ScoreStore(target)
    drafts = DraftStore(build_decoder(target, specs[0], decode, resources=resources).drafter)
    live = [build_decoder(target, spec, decode, resources=resources) for spec in specs]
    replayed = [build_decoder(target, spec, decode, resources=resources) for spec in specs]
    for decoder in replayed:
        decoder.scorer = ReplayTarget(scores)
        decoder.drafter = ReplayDrafter(drafts, decoder.drafter.name)
    loose = live_forwards = replay_forwards = 0
    for prompt in PROMPTS:
        prompt_ids = target.encode_prompt(prompt, False)
        for seed in (0,) if temperature == 0 else (0, 1):
            scores.begin(prompt_ids)  # the same prompt's rows are kept for its next seed
            drafts.begin(prompt_ids)
            for live_decoder, replay_decoder in zip(live, replayed, strict=True):
                expected = live_decoder.generate(prompt_ids, generator=make_generator(seed))
                got = replay_decoder.generate(prompt_ids, generator=make_generator(seed))
                assert got.token_ids == expected.token_ids, (live_decoder.speculation.verifier, seed)
                assert got.stats.num_target_forwards == expected.stats.num_target_forwards
                assert got.stats.num_loose_accepts == expected.stats.num_loose_accepts
                assert got.stats.proposed_per_position == expected.stats.proposed_per_position
                loose += expected.stats.num_loose_accepts
                live_forwards += expected.stats.num_target_forwards + 1  # + its prefill
        replay_forwards += scores.num_forwards
    assert loose > 20  # the rules really loosened, so the paths really diverged
    assert replay_forwards < 0.8 * live_forwards  # and the shared questions were asked once


def test_replay_with_a_draft_model_of_another_tokenizer(models) -> None:
    """Cross-tokenizer drafting rewinds by re-syncing its text: replay still equals a live run."""
    from test_cross_tokenizer import make_metaspace_tokenizer

    target = models["target"]
    draft = make_tiny_model(make_metaspace_tokenizer(), 3, name="meta-draft")
    spec = SpeculationConfig(drafter="draft-model", draft_model=draft.name, num_draft_tokens=6, draft_length=FIXED)
    resources = Resources("float32", models=(target, draft))
    specs = [
        dataclasses.replace(spec, verifier="exact", profile=PROFILE_NONE),
        dataclasses.replace(
            spec, verifier="fly", fly=FlyConfig(window_size=1, entropy_threshold=0.0), guard=GuardConfig.bare()
        ),
    ]
    decode = DecodeConfig(max_new_tokens=30)
    drafter = build_decoder(target, specs[0], decode, resources=resources).drafter
    assert isinstance(drafter, CrossTokenizerDrafter)
    scores, drafts = ScoreStore(target), DraftStore(drafter)
    for prompt in PROMPTS[:3]:
        prompt_ids = target.encode_prompt(prompt, False)
        scores.begin(prompt_ids)
        drafts.begin(prompt_ids)
        for spec in specs:
            live = build_decoder(target, spec, decode, resources=resources).generate(prompt_ids)
            decoder = build_decoder(target, spec, decode, resources=resources)
            decoder.scorer, decoder.drafter = ReplayTarget(scores), ReplayDrafter(drafts, "draft-model")
            assert decoder.generate(prompt_ids).token_ids == live.token_ids


def test_plain_decoding_replayed_after_exact_needs_no_forward(models) -> None:
    target = models["target"]
    scores = ScoreStore(target)
    prompt_ids = target.encode_prompt(PROMPTS[0], False)
    scores.begin(prompt_ids)
    exact = build_decoder(target, SpeculationConfig(draft_length=FIXED), DecodeConfig(max_new_tokens=30))
    exact.scorer = ReplayTarget(scores)
    drafts = DraftStore(exact.drafter)
    drafts.begin(prompt_ids)
    exact.drafter = ReplayDrafter(drafts, "ngram")
    expected = exact.generate(prompt_ids)
    forwards = scores.num_forwards
    plain = PlainDecoder(target, DecodeConfig(max_new_tokens=30))
    plain.scorer = ReplayTarget(scores)
    assert plain.generate(prompt_ids).token_ids == expected.token_ids
    assert scores.num_forwards == forwards  # every row it asked for was there
    live = PlainDecoder(target, DecodeConfig(max_new_tokens=30)).generate(prompt_ids)
    assert live.token_ids == expected.token_ids


def test_replay_keeps_its_rows_on_the_device_within_a_budget(models) -> None:
    """Issue 39: past the budget the oldest forwards' rows move to the host; answers and outputs unchanged."""
    target = models["target"]
    prompt_ids = target.encode_prompt(PROMPTS[1], False)
    outputs, stores = [], []
    for budget in (1 << 30, 1):  # everything on the device; only the newest forward's rows
        scores = ScoreStore(target, device_budget_bytes=budget)
        scores.begin(prompt_ids)
        for spec in _verifier_specs("ngram"):
            decoder = build_decoder(target, spec, DecodeConfig(max_new_tokens=30))
            drafts = DraftStore(decoder.drafter)
            drafts.begin(prompt_ids)
            decoder.scorer, decoder.drafter = ReplayTarget(scores), ReplayDrafter(drafts, "ngram")
            outputs.append(decoder.generate(prompt_ids).token_ids)
        stores.append(scores)
    half = len(outputs) // 2
    assert outputs[:half] == outputs[half:]
    roomy, tight = stores
    assert roomy.num_forwards == tight.num_forwards  # moved to the host, never recomputed
    newest = tight.blocks[-1]
    assert len(tight.blocks) > 3 and tight.device_bytes == newest.numel() * newest.element_size()
    assert roomy.device_bytes == sum(block.numel() * block.element_size() for block in roomy.blocks)


def test_replay_refuses_another_prompt(models) -> None:
    target = models["target"]
    scores = ScoreStore(target)
    scores.begin(target.encode_prompt(PROMPTS[0], False))
    replay = ReplayTarget(scores)
    with pytest.raises(RuntimeError, match="begin"):
        replay.start(target.encode_prompt(PROMPTS[1], False))
    drafts = DraftStore(DraftModelDrafter(models["draft"]))
    drafts.begin([1, 2, 3])
    with pytest.raises(RuntimeError, match="begin"):
        ReplayDrafter(drafts, "draft-model").reset([4, 5])


# --- the budget ----------------------------------------------------------------------------------------------


def test_min_items_is_where_no_event_first_fits_the_budget() -> None:
    needed = min_items(0.01)
    assert needed == 268
    assert upper_bound(0, needed) <= 0.01 < upper_bound(0, needed - 1)
    assert upper_bound(0, 200) > 0.01  # 200 prompts cannot show 1 %: the n >= 200 is not enough alone


@pytest.mark.parametrize("rate", [0.0, 1.0, -0.1, 2, float("nan"), "0.01"])
def test_a_budget_outside_0_1_is_refused(rate) -> None:
    with pytest.raises(ConfigError, match=r"\(0, 1\)"):
        Budget.of(rate)


def test_judge_accepts_only_finished_points_whose_bounds_fit() -> None:
    budget = Budget()
    assert judge(budget, changed=0, looped=0, total=400, retention_low=0.995, finished=True).status == "inside"
    assert judge(budget, changed=0, looped=0, total=200, retention_low=1.0, finished=True).status == "outside"
    assert judge(budget, changed=1, looped=0, total=400, retention_low=1.0, finished=True).status == "outside"
    assert judge(budget, changed=0, looped=0, total=400, retention_low=0.98, finished=True).status == "outside"
    assert judge(budget, changed=0, looped=0, total=50, retention_low=None, finished=False).status == "open"
    stopped = judge(budget, changed=3, looped=0, total=10, retention_low=None, finished=False)
    assert stopped.status == "outside" and "surely above" in stopped.reasons[0]
    assert judge(budget, changed=2, looped=0, total=3, retention_low=None, finished=False).status == "open"


def test_early_stops_rarely_drop_a_point_below_the_budget() -> None:
    """Simulated over 400 prompts: the early stop's false alarms stay rare for a point at half the budget."""
    rng = np.random.default_rng(0)

    def stopped_share(rate: float, trials: int = 600) -> float:
        stops = 0
        for _ in range(trials):
            events = np.cumsum(rng.random(400) < rate)
            stops += any(decisively_above(int(events[i]), i + 1, 0.01) for i in range(400))
        return stops / trials

    assert stopped_share(0.005) < 0.03
    assert stopped_share(0.05) > 0.95  # and a point at five times the budget is nearly always stopped
    assert budget_module.DECISIVE_EVENTS == 3


# --- the chooser and the projection ----------------------------------------------------------------------------


def _summary(name: str, rule: str, status: str, speedup: float, tau: float = 2.0) -> dict:
    return {
        "name": name,
        "rule": rule,
        "lossless": rule == "exact",
        "status": status,
        "projected_speedup": speedup,
        "tau": tau,
    }


def test_chooser_picks_the_fastest_point_inside_the_budget() -> None:
    frontier = [
        _summary("exact", "exact", "lossless", 1.30),
        _summary("fly a", "fly", "inside", 1.40),
        _summary("fly b", "fly", "inside", 1.55),
        _summary("fly c", "fly", "outside", 1.90),
        _summary("margin a", "margin", "inside", 1.35),
        _summary("typical a", "typical", "pruned", 2.00),
    ]
    chosen, by_rule = choose(frontier)
    assert chosen["name"] == "fly b"
    assert by_rule == {"fly": frontier[2], "margin": frontier[4], "typical": None}


def test_chooser_refuses_when_nothing_inside_the_budget_beats_exact() -> None:
    outside = [_summary("exact", "exact", "lossless", 1.3), _summary("fly", "fly", "outside", 1.9)]
    assert choose(outside) == (None, {"fly": None})
    slower = [_summary("exact", "exact", "lossless", 1.3), _summary("fly", "fly", "inside", 1.29)]
    assert choose(slower) == (None, {"fly": None})


def _ranked(name: str, family: str, status: str, tau_gain: float, changed: float) -> dict:
    return {
        "name": name, "rule": family.split()[0], "family": family, "lossless": False, "n": 400, "status": status,
        "tau_gain": tau_gain, "meaning_changed": {"rate": changed}, "loose_per_100_tokens": 0.5, "projected_gain": 0.02,
    }  # fmt: skip


def test_families_rank_by_what_they_buy_inside_the_budget_then_at_a_fixed_loss() -> None:
    frontier = [
        _ranked("fly a", "fly W6", "inside", 0.02, 0.0),
        _ranked("fly b", "fly W6", "outside", 0.30, 0.08),  # more τ, but more than 5 % changed
        _ranked("margin a", "margin", "outside", 0.10, 0.04),
        _ranked("margin b", "margin", "outside", 0.12, 0.05),  # exactly at the fixed loss: counts
        _ranked("bild a", "bild", "inside", 0.05, 0.003),
        _ranked("typical a", "typical", "outside", 0.40, 0.20),
    ]
    ranked = rank_families(frontier)
    assert [row["family"] for row in ranked] == ["bild", "fly W6", "margin", "typical"]
    assert ranked[0]["inside"] == {
        "name": "bild a", "tau_gain": 0.05, "loose_per_100_tokens": 0.5, "projected_gain": 0.02
    }  # fmt: skip
    assert ranked[1]["at_loss"]["name"] == "fly a"  # fly b changed 8 %: past the fixed loss
    assert ranked[2]["inside"] is None and ranked[2]["at_loss"]["name"] == "margin b"
    assert ranked[3]["inside"] is None and ranked[3]["at_loss"] is None


def test_verified_lengths_and_projection_from_counted_steps() -> None:
    # 5 forwards: lengths 0, 3, 3, 7, 7 -> proposed_per_position counts forwards reaching each position
    stats = {
        "num_target_forwards": 5,
        "proposed_per_position": [4, 4, 4, 2, 2, 2, 2],
        "num_proposed": 20,
        "num_new_tokens": 15,
    }
    assert verified_lengths(stats) == {0: 1, 3: 2, 7: 2}
    cost = CostModel(StepCost((1, 4, 8), (0.010, 0.013, 0.016)), draft_seconds_per_token=0.001)
    decode = 1 * 0.010 + 2 * 0.013 + 2 * 0.016 + 20 * 0.001
    assert cost.decode_seconds([stats]) == pytest.approx(decode)
    assert cost.speedup([stats]) == pytest.approx(15 * 0.010 / decode)


def test_draft_cost_is_measured_in_units_of_a_target_step_taken_beside_it(models) -> None:
    # a busy machine slows drafts and target steps alike; the ratio to a step timed beside each draft is what
    # the projection needs (scaled by the cached t(1)), so a target step reported twice as slow halves it
    drafter = DraftModelDrafter(models["draft"])
    prompts = [[1, 2, 3, 4, 5, 6]]
    steps: list[int] = []

    def slow_step(context: list[int]) -> float:
        steps.append(len(context))
        return 1e9

    assert 0 < measure_draft_cost(drafter, prompts, 4, slow_step) < 1e-9
    assert steps and all(length >= 6 for length in steps)  # timed beside each draft, after its context
    assert measure_draft_cost(drafter, prompts, 4) > 0  # without a target step: seconds


# --- the whole calibration on a tiny model -----------------------------------------------------------------------


def test_points_cover_the_rules_and_run_as_given(models) -> None:
    grid = points(SpeculationConfig(drafter="ngram", verifier="fly", profile="auto"))
    assert grid[0].name == "exact" and grid[0].lossless
    assert {point.rule for point in grid} == {"exact", "fly", "margin", "typical", "bild", "lenience"}  # n-gram drafts
    assert all(point.speculation.profile == PROFILE_NONE for point in grid)
    assert len(grid) >= 30
    families: dict[str, list] = {}
    for point in grid:
        families.setdefault(point.family, []).append(point.order)
    assert all(orders == sorted(orders) for orders in families.values())
    with pytest.raises(ConfigError, match="unknown rule"):
        points(SpeculationConfig(), rules=("fly", "bogus"))


@pytest.fixture(scope="module")
def calibrated(models, tmp_path_factory) -> tuple[Path, object]:
    """One quick calibration of the tiny target's n-gram drafter on a prompt file."""
    directory = tmp_path_factory.mktemp("calibration")
    data = directory / "prompts.jsonl"
    lines = [{"prompt": text, "reference": text.split()[-1]} for text in PROMPTS] + [{"prompt": "Hello there"}]
    data.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    target = models["target"]
    config = CalibrationConfig(
        speculation=SpeculationConfig(num_draft_tokens=8),
        data=str(data),
        grid="quick",
        out_dir=directory / "out",
        live_check=2,
        use_chat=False,
    )
    result = calibrate(target, config, resources=Resources("float32", models=(target,)))
    return directory, result


def test_a_calibration_writes_its_records_profile_report_and_plot(calibrated) -> None:
    directory, result = calibrated
    out = directory / "out"
    for name in ("records.jsonl", "profile.json", "report.md", "frontier.png", "calibration.json"):
        assert (out / name).is_file(), name
    record = json.loads((out / "profile.json").read_text())
    assert record["flyspec_profile"] == 1 and record["data"]["n"] == 5
    assert record["model"]["weights"] and record["model"]["tokenizer"]
    assert [summary["name"] for summary in record["frontier"]] == [point["name"] for point in result.frontier]
    exact = record["frontier"][0]
    assert exact["status"] == "lossless" and exact["tau_gain"] == 0.0 and exact["n"] == 5
    assert record["chosen"] is None  # 5 prompts can never show a rate below 1 %
    assert record["live_check"]["plain"] == {"checked": 2, "identical": 2}
    report = (out / "report.md").read_text()
    assert "Choice: none" in report and "rerun with more" in report
    assert "## Families ranked" in report and record["families"]  # every family that ran, ranked
    assert {row["family"] for row in record["families"]} == {
        s["family"] for s in record["frontier"] if not s["lossless"] and s["n"]
    }
    lines = (out / "records.jsonl").read_text().splitlines()
    assert sum(json.loads(line)["point"] == "plain" for line in lines) == 5


def _resumed(directory: Path, out: Path, **changes) -> CalibrationConfig:
    """The ``calibrated`` fixture's calibration, resumed in ``out`` (``changes``: e.g. a smaller ``limit``)."""
    return CalibrationConfig(
        speculation=SpeculationConfig(num_draft_tokens=8),
        data=str(directory / "prompts.jsonl"),
        grid="quick",
        out_dir=out,
        resume=True,
        live_check=0,
        use_chat=False,
        **changes,
    )


def test_resume_adds_nothing_to_a_finished_calibration(calibrated, models) -> None:
    directory, _ = calibrated
    out = directory / "out"
    before = (out / "records.jsonl").read_text()
    config = _resumed(directory, out)
    target = models["target"]
    calibrate(target, config, resources=Resources("float32", models=(target,)))
    assert (out / "records.jsonl").read_text() == before
    other = dataclasses.replace(config, speculation=SpeculationConfig(num_draft_tokens=6))
    with pytest.raises(ConfigError, match="--resume"):
        calibrate(target, other, resources=Resources("float32", models=(target,)))


def test_resume_reads_a_state_written_before_a_config_field_was_added(calibrated, models, tmp_path) -> None:
    """A field added since (a new rule's settings, as adasd's) is at its default in the old run's base: it resumes."""
    directory, _ = calibrated
    out = tmp_path / "out"
    shutil.copytree(directory / "out", out)
    state = json.loads((out / "calibration.json").read_text())
    del state["speculation"]["adasd"]
    (out / "calibration.json").write_text(json.dumps(state))
    before = (out / "records.jsonl").read_text()
    target = models["target"]
    calibrate(target, _resumed(directory, out), resources=Resources("float32", models=(target,)))
    assert (out / "records.jsonl").read_text() == before
    state["speculation"]["num_draft_tokens"] = 6  # a field that was there and differs is still refused
    (out / "calibration.json").write_text(json.dumps(state))
    with pytest.raises(ConfigError, match="--resume: .* other speculation"):
        calibrate(target, _resumed(directory, out), resources=Resources("float32", models=(target,)))


def test_resume_with_a_smaller_limit_summarizes_only_those_prompts(calibrated, models, tmp_path) -> None:
    """A run stopped by hand is summarized at a prefix (``--limit N --resume``): the records of later prompts stay
    in records.jsonl but count nowhere."""
    directory, _ = calibrated
    out = tmp_path / "out"
    shutil.copytree(directory / "out", out)
    before = (out / "records.jsonl").read_text()
    target = models["target"]
    calibrate(target, _resumed(directory, out, limit=3), resources=Resources("float32", models=(target,)))
    assert (out / "records.jsonl").read_text() == before  # nothing decoded again, nothing dropped from the file
    record = json.loads((out / "profile.json").read_text())
    assert record["data"]["n"] == 3
    assert record["frontier"][0]["n"] == 3 and all(point["n"] <= 3 for point in record["frontier"])


def test_calibrate_refuses_a_drafter_that_remembers_other_prompts() -> None:
    with pytest.raises(ConfigError, match="ngram-cache"):
        CalibrationConfig(speculation=SpeculationConfig(drafter="ngram-cache"))


# --- the command line ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--budget", "0"], "(0, 1)"),
        (["--budget", "1.5"], "(0, 1)"),
        (["--budget", "-0.01"], "(0, 1)"),
        (["--confidence", "1"], "--confidence"),
        (["--drafter", "bogus"], "invalid choice"),
        (["--drafter", "ngram-cache"], "ngram-cache"),
        (["--rules", "fly,loose"], "unknown rule 'loose'"),
        (["--limit", "0"], "--limit"),
        (["--data", "everything"], "unknown calibration data"),
        (["--data", "missing.jsonl"], "does not exist"),
        (["--grid", "huge"], "invalid choice"),
        (["--seeds", "3"], "--seeds needs a --temperature > 0"),
        (["--temperature", "0.7,warm"], "--temperature must be a number"),
        (["--temperature", "0.7,0.7"], "lists a value twice"),
        (["--temperature", "-1"], "temperature must be a finite number >= 0"),
        (["--temperature", "0.7", "--engine", "vllm"], "not coupled by seed"),
    ],
)
def test_bad_calibrate_input_is_one_line_and_exit_2(capsys, tiny_model_dir, options, message) -> None:
    from test_cli import usage_error

    line = usage_error(capsys, ["calibrate", "--target", str(tiny_model_dir), "--dtype", "float32", *options])
    assert message in line


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "no usable items"),
        ('{"prompt": "fine"}\n{"prompt": \n', "line 2"),
        ('{"prompt": ""}\n', "missing field(s) prompt"),
        ('{"reference": "x"}\n', "prompt"),
    ],
)
def test_an_empty_or_malformed_prompt_file_is_one_line_and_exit_2(
    capsys, tiny_model_dir, tmp_path, content, message
) -> None:
    from test_cli import usage_error

    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    argv = ["calibrate", "--target", str(tiny_model_dir), "--dtype", "float32", "--data", str(path)]
    assert message in usage_error(capsys, [*argv, "--out", str(tmp_path / "out")])


def test_the_calibrate_command_end_to_end(capsys, monkeypatch, tiny_model_dir, tmp_path, auto_dtype) -> None:
    """Calibrated where ``auto`` means one dtype, the profile is used where it means the other (issue 35)."""
    from flyspec.cli.app import main

    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": text}) for text in PROMPTS) + "\n")
    out = tmp_path / "out"
    argv = ["calibrate", "--target", str(tiny_model_dir), "--no-chat", "--data", str(path)]
    assert main([*argv, "--grid", "quick", "-k", "8", "--out", str(out), "--live-check", "1"]) == 0
    printed = capsys.readouterr().out
    assert "no lossy point beat exact inside the budget" in printed and str(out / "profile.json") in printed
    profile = json.loads((out / "profile.json").read_text())
    assert profile["data"]["n"] == len(PROMPTS) and profile["drafter"]["drafter"] == "ngram"
    assert profile["dtype"] == auto_dtype and profile["command"].startswith("flyspec calibrate")
    other = "bfloat16" if auto_dtype == "float32" else "float32"
    monkeypatch.setenv("FLYSPEC_AUTO_DTYPE", other)
    generate = ["generate", "hi", "--target", str(tiny_model_dir), "--profile", str(out / "profile.json")]
    assert main([*generate, "--max-new-tokens", "4", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["dtype"] == auto_dtype
    assert f"in {auto_dtype}, the dtype profile profile.json was calibrated in" in captured.err


def test_a_draft_model_of_another_tokenizer_calibrates_without_the_distribution_rules(models, tmp_path, caplog) -> None:
    """fsd, cascade and adasd read a distribution over the target's vocabulary, which re-tokenized drafts do not have:
    the default rules leave them out with a warning, and naming them in ``rules`` is refused in one line."""
    from test_cross_tokenizer import make_metaspace_tokenizer

    target = models["target"]
    draft = make_tiny_model(make_metaspace_tokenizer(), 3, name="meta-draft-calibrated")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in PROMPTS[:2]))
    spec = SpeculationConfig(drafter="draft-model", draft_model=draft.name, num_draft_tokens=4)

    def config(out: str, **options) -> CalibrationConfig:
        return CalibrationConfig(
            speculation=spec, data=str(data), grid="quick", out_dir=tmp_path / out, live_check=0, use_chat=False,
            **options,
        )  # fmt: skip

    resources = Resources("float32", models=(target, draft))
    with caplog.at_level(logging.WARNING, logger="flyspec.calibration.api"):
        result = calibrate(target, config("default"), resources=resources)
    rules = {point["rule"] for point in result.frontier}
    assert {"margin", "bild", "lenience"} <= rules and not rules & {"fsd", "cascade", "adasd"}
    assert "rules fsd, cascade, adasd left out" in caplog.text and "another tokenizer" in caplog.text
    with pytest.raises(ConfigError, match=r"^--rules fsd: .*another tokenizer.*--drafter layer-skip$"):
        calibrate(target, config("named", rules=("bild", "fsd")), resources=resources)


def test_a_sampled_calibration_judges_each_temperature_against_plain_of_the_same_seed(models, tmp_path) -> None:
    """Greedy and T = 1 under two seeds: every record pairs with plain's of its seed (exact is plain's text), each
    sampling has its own bounds with prompts as clusters, FLy's other T > 0 rules run beside the coupled one, and
    the profile says where it was measured."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": text}) for text in PROMPTS) + "\n")
    target = models["target"]
    config = CalibrationConfig(
        speculation=SpeculationConfig(num_draft_tokens=8),
        data=str(data),
        grid="quick",
        out_dir=tmp_path / "out",
        live_check=2,
        use_chat=False,
        samplings=(SamplingConfig(), SamplingConfig(temperature=1.0)),
        seeds=2,
    )
    result = calibrate(target, config, resources=Resources("float32", models=(target,)))
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    plain = {r["item"]: r for r in records if r["point"] == "plain"}
    assert len(plain) == len(PROMPTS) * 3  # greedy + T1 × 2 seeds
    sampled = [r for r in records if r.get("sampling") == "T1"]
    assert {r["seed"] for r in sampled} == {0, 1} and all(r["prompt"] in r["item"] for r in sampled)
    assert all(r["identical"] for r in records if r["point"] == "exact")  # coupled: plain sampling's own text
    names = {s["name"] for s in result.frontier}
    assert {"fly H>=0.3 W6 two-sample"} <= names  # FLy's reference T > 0 rule, compared
    fly = next(s for s in result.frontier if s["name"] == "fly H>=0.3 W6")
    assert set(fly["by_sampling"]) == {"greedy", "T1"} and fly["by_sampling"]["T1"]["n"] == 2 * len(PROMPTS)
    assert fly["by_sampling"]["T1"]["prompts"] == len(PROMPTS)
    size = fly["by_sampling"]["T1"]["meaning_changed"]["n_effective"]
    assert len(PROMPTS) <= size <= 2 * len(PROMPTS)
    assert result.record["live_check"]["plain"]["identical"] == result.record["live_check"]["plain"]["checked"] > 0
    profile = Profile.load(result.profile_path)
    assert profile.sampling_range == SamplingRange(measured=True, greedy=True, temperature=(1.0, 1.0))
    assert "greedy and T 1 × 2 seeds" in profile.describe()
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Per sampling" in report and "greedy and T 1 (2 seeds per prompt" in report


def test_a_calibration_on_the_edit_workload_decodes_each_prompt_with_its_prediction(tmp_path, monkeypatch) -> None:
    """--data edit: every speculative point and its baseline draft the item's prediction (plain decoding none), and
    the profile says it measured predicted work, the only work where its loose accepts apply to a prediction."""
    from flyspec.calibration import data as calibration_data

    items = calibration_data.load(calibration_data.resolve_tasks("edit"), limit=2)
    assert all(item.prediction for item in items) and items[0].task.name == "edit"
    target = make_tiny_model(make_tokenizer(), 0, name="edit-target")
    target.model.config.max_position_embeddings = 4096  # rotary: the edit prompts are longer than 512 tokens
    config = CalibrationConfig(
        speculation=SpeculationConfig(num_draft_tokens=8), data="edit", limit=2, grid="quick", rules=("fly",),
        out_dir=tmp_path / "out", live_check=0, use_chat=False,
    )  # fmt: skip
    seen: list[tuple[str, bool]] = []
    original = SpeculativeDecoder.generate

    def spy(self, prompt, *args, prediction=None, **kwargs):  # type: ignore[no-untyped-def]
        seen.append((self.verifier.name, prediction is not None))
        return original(self, prompt, *args, prediction=prediction, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, "generate", spy)
    calibrate(target, config, resources=Resources("float32", models=(target,)))
    assert seen and all(predicted for _, predicted in seen), seen
    assert {name for name, _ in seen} >= {"exact", "fly"}
    record = json.loads((tmp_path / "out" / "profile.json").read_text())
    assert record["sampling"]["predicted"] is True and record["data"]["tasks"] == ["edit"]
    assert Profile.load(tmp_path / "out" / "profile.json").sampling_range.predicted
