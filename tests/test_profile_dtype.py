"""A profile brings its dtype (issue 35): ``--dtype auto`` loads the models in the dtype the profile was
calibrated in, on a CPU whose ``auto`` means the other one; ``$FLYSPEC_AUTO_DTYPE`` forces what ``auto``
means, so one machine runs what the other class of machine would."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import flyspec
from flyspec.api import build_decoder
from flyspec.cli.app import main
from flyspec.config import PROFILE_NONE, ConfigError, DecodeConfig, SpeculationConfig
from flyspec.profiles import DtypeChoice, Profile, load_dtype
from flyspec.runtime.loading import AUTO_DTYPE_VARIABLE, default_dtype, resolve_dtype
from server_helpers import one_torch_thread  # noqa: F401 - autouse fixture
from test_profile import FLY_POINT, make_profile


@pytest.mark.parametrize("forced", ["float32", "bfloat16", "fp32", "bf16"])
def test_the_switch_forces_what_auto_means(monkeypatch, forced) -> None:
    monkeypatch.setenv(AUTO_DTYPE_VARIABLE, forced)
    expected = torch.float32 if forced.startswith(("float32", "fp32")) else torch.bfloat16
    assert resolve_dtype("auto") == expected == default_dtype(torch.device("cpu"))
    assert resolve_dtype("float32") == torch.float32  # an explicit dtype is never forced


def test_a_bad_switch_value_says_what_to_set(monkeypatch) -> None:
    monkeypatch.setenv(AUTO_DTYPE_VARIABLE, "int8")
    with pytest.raises(ConfigError, match=r"FLYSPEC_AUTO_DTYPE='int8': choose one of .*bfloat16.*or unset it"):
        resolve_dtype("auto")


@pytest.fixture
def float32_profile(tiny_model_dir: Path, tiny_target, tmp_path: Path) -> Path:
    """A profile of the tiny target (as loaded from its directory), calibrated in float32."""
    record = make_profile(tiny_target)
    record["model"]["name"] = str(tiny_model_dir)
    path = tmp_path / "profile.json"
    Profile(record).save(path)
    return path


def test_auto_takes_the_profiles_dtype_and_says_so(monkeypatch, float32_profile: Path, tiny_model_dir) -> None:
    spec = SpeculationConfig(profile=str(float32_profile))
    monkeypatch.setenv(AUTO_DTYPE_VARIABLE, "bfloat16")
    choice = load_dtype([spec], str(tiny_model_dir))
    assert choice.dtype == "float32"
    assert choice.note == (
        f"loading {tiny_model_dir} in float32, the dtype profile profile.json was calibrated in "
        "(--dtype auto means bfloat16 on this machine; pass --dtype to choose)"
    )
    # nothing to say where auto already means the profile's dtype, an explicit dtype stays, no profile: auto
    monkeypatch.setenv(AUTO_DTYPE_VARIABLE, "float32")
    assert load_dtype([spec], str(tiny_model_dir)).note is None
    monkeypatch.setenv(AUTO_DTYPE_VARIABLE, "bfloat16")
    assert load_dtype([spec], str(tiny_model_dir), "bfloat16").dtype == "bfloat16"
    assert load_dtype([SpeculationConfig(profile=PROFILE_NONE, verifier="fly")], "x").dtype == "auto"
    assert load_dtype([SpeculationConfig(), spec], str(tiny_model_dir)).dtype == "float32"  # any spec's profile


def test_the_shipped_profiles_bring_float32_to_a_bfloat16_machine(monkeypatch) -> None:
    """The packaged models' shipped profiles (read by name, nothing loaded), as ``--verifier fly`` picks them."""
    monkeypatch.setenv(AUTO_DTYPE_VARIABLE, "bfloat16")
    fly = SpeculationConfig(verifier="fly")
    choice = load_dtype([fly], "smollm2-135m-instruct")
    assert choice.dtype == "float32" and "smollm2-135m-instruct-ngram-float32.json" in (choice.note or "")
    layer_skip = SpeculationConfig(verifier="fly", drafter="layer-skip")
    assert "layer-skip-float32" in (load_dtype([layer_skip], "smollm2-135m-instruct").note or "")
    draft = SpeculationConfig(verifier="fly", drafter="draft-model", draft_model="smollm2-135m-instruct")
    assert "gemma3-270m-draft-model-float32" in (load_dtype([draft], "gemma3-270m").note or "")
    # no shipped profile applies: a lossless verifier, the caller's own settings, --profile none, another model
    for spec in (
        SpeculationConfig(),
        SpeculationConfig(verifier="fly", num_draft_tokens=8),
        SpeculationConfig(verifier="fly", profile=PROFILE_NONE),
        SpeculationConfig(verifier="fly", drafter="draft-model", draft_model="gemma3-270m"),
    ):
        assert load_dtype([spec], "smollm2-135m-instruct") == DtypeChoice("auto"), spec
    assert load_dtype([fly], "another-model").dtype == "auto"
    # where auto already means the profile's dtype nothing changes
    monkeypatch.setenv(AUTO_DTYPE_VARIABLE, "float32")
    assert load_dtype([fly], "smollm2-135m-instruct").note is None


@pytest.mark.parametrize("forced", ["float32", "bfloat16"])
def test_generate_loads_the_profiles_dtype_on_either_machine(
    monkeypatch, capsys, float32_profile: Path, tiny_model_dir, forced
) -> None:
    monkeypatch.setenv(AUTO_DTYPE_VARIABLE, forced)
    argv = ["generate", "hi", "--target", str(tiny_model_dir), "--profile", str(float32_profile)]
    assert main([*argv, "--max-new-tokens", "4", "--json"]) == 0
    captured = capsys.readouterr()
    record = json.loads(captured.out)
    assert record["dtype"] == "float32" and record["verifier"] == "fly" and record["profile"] == str(float32_profile)
    notes = [line for line in captured.err.splitlines() if "calibrated in" in line]
    assert notes == ([] if forced == "float32" else [f"[profile] {load_dtype_note(tiny_model_dir)}"])
    # an explicit other dtype is still refused, with the message that says what to pass
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--dtype", "bfloat16"])
    assert exited.value.code == 2
    assert "it was calibrated in float32, this model runs in bfloat16 (use --dtype float32)" in capsys.readouterr().err


def load_dtype_note(model_dir: Path) -> str:
    return (
        f"loading {model_dir} in float32, the dtype profile profile.json was calibrated in "
        "(--dtype auto means bfloat16 on this machine; pass --dtype to choose)"
    )


def test_the_python_api_loads_the_profiles_dtype(monkeypatch, caplog, float32_profile: Path, tiny_model_dir) -> None:
    monkeypatch.setenv(AUTO_DTYPE_VARIABLE, "bfloat16")
    with caplog.at_level(logging.WARNING, logger="flyspec.api"):
        result = flyspec.generate(
            "hi", str(tiny_model_dir), SpeculationConfig(profile=str(float32_profile)), max_new_tokens=4
        )
    assert result.stats.num_new_tokens > 0 and load_dtype_note(tiny_model_dir) in caplog.text
    decoder = build_decoder(str(tiny_model_dir), SpeculationConfig(profile=str(float32_profile)), DecodeConfig())
    assert decoder.target.dtype == torch.float32 and decoder.speculation.fly == FLY_POINT.fly
    assert decoder.profile is not None


def test_bench_eval_and_serve_take_the_profiles_dtype(monkeypatch, float32_profile: Path, tiny_model_dir) -> None:
    """Their models load through ``engine_options`` with the specs each command runs."""
    from flyspec.cli.app import build_parser
    from flyspec.cli.options import engine_options
    from flyspec.cli.speculation import speculation_config
    from flyspec.harness.methods import parse_methods, speculations

    monkeypatch.setenv(AUTO_DTYPE_VARIABLE, "bfloat16")
    parser = build_parser()
    common = ["--target", str(tiny_model_dir), "--profile", str(float32_profile)]
    for command in (["bench", "--methods", "ngram+fly"], ["eval", "--methods", "fly"], ["serve", "--verifier", "fly"]):
        args = parser.parse_args([*command, *common])
        base = speculation_config(args)
        specs = [base] if command[0] == "serve" else speculations(parse_methods(args.methods), base)
        assert engine_options(args, specs)["dtype"] == "float32", command
        args = parser.parse_args([*command, *common, "--dtype", "bfloat16"])
        assert engine_options(args, specs)["dtype"] == "bfloat16", command
