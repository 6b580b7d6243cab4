"""``flyspec serve --engine vllm``: vLLM's own OpenAI server with the flyspec-vllm plugin, from ``flyspec serve``'s
command line.

It starts ``python -m vllm.entrypoints.openai.api_server`` in the vLLM venv (``--vllm-venv``; ``vllm serve`` fails with
the CPU wheel, DEPLOYMENT.md) and stays its parent: requests go to vLLM's server itself, nothing stands in front of
it. What it does that a user otherwise does by hand:

- the model: a packaged name or ``.gguf`` file becomes the complete Hugging Face directory vLLM loads
  (``runtime/loading.py``; ``flyspec export --hf`` writes the same for users who start vLLM themselves);
- the speculation: flyspec's n-gram proposer (``custom_class``) with ``-k`` drafts; a profile's chosen point, guards,
  breaker and batch schedule as the plugin reads them (``FLYSPEC_VLLM_PROFILE``, ``FLYSPEC_VLLM_FLY``,
  ``FLYSPEC_VLLM_SCHEDULE``: the profile's ``deploy`` block), the profile checked first against the model, dtype and
  engine exactly as ``flyspec serve`` checks it (a profile measured on flyspec's engine is refused unless the two
  engines were shown to agree);
- the machine: the KV cache in bytes (the same on every VM), vLLM-CPU's threads bound to this process's CPUs;
- the metrics: a fresh ``PROMETHEUS_MULTIPROC_DIR``, so that vLLM's ``/metrics`` (which then reads every process's
  counters, ``vllm/v1/metrics/prometheus.py``) shows the plugin's ``flyspec_vllm_*`` counters, counted in the engine
  core process that verifies. ``prometheus_client`` fixes its storage when it is first imported, so the variable must
  be in the environment before vLLM starts: only a launcher can set it.

Options of ``flyspec serve`` that vLLM has no spelling for are refused in one line (exit 2), never dropped.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flyspec.config import DEFAULT_DEVICE, PROFILE_AUTO, PROFILE_NONE, ConfigError, SpeculationConfig

logger = logging.getLogger(__name__)

PREFIX = "flyspec serve --engine vllm: "
PROPOSER = "flyspec_vllm.NgramProposer"
METRICS_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
THREADS_VARIABLE = "VLLM_CPU_OMP_THREADS_BIND"
# flyspec serve's speculation flags the vLLM path takes (the rest have no server-wide spelling there)
TAKEN_FLAGS = ("drafter", "verifier", "num_draft_tokens", "profile", "bare_rule", "max_ngram", "min_ngram")
# flyspec serve options with no vLLM spelling: (dest, flag, the default that means "not given")
UNMAPPED: tuple[tuple[str, str, object], ...] = (
    ("draft_model", "--draft-model", None),
    ("kernels", "--kernels", "auto"),
    ("compile", "--compile", False),
    ("ngram_cache_file", "--ngram-cache-file", None),
    ("allowed_host", "--allowed-host", []),
    ("share_ngram_cache", "--share-ngram-cache", False),
    ("allow_special_tokens_in_messages", "--allow-special-tokens-in-messages", False),
)
# what vLLM offers instead, where it offers something
INSTEAD = {
    "--max-prompt-tokens": "vLLM refuses prompts longer than --max-model-len",
    "--default-max-tokens": "vLLM's default is what --max-model-len leaves",
    "--max-queue": "vLLM batches requests (--max-num-seqs) instead of queueing them",
}


@dataclass
class Launch:
    """What is started: the command, the environment it adds, and the one line that says so."""

    command: list[str]
    environment: dict[str, str]
    summary: str
    url: str
    metrics_dir: Path | None = None  # made here: removed when the server stops
    notes: list[str] = field(default_factory=list)


def check_options(args: argparse.Namespace) -> None:
    """Refuse, naming the option, what ``flyspec serve`` takes and vLLM's server cannot do."""
    from flyspec.cli.speculation import FLAG_NAMES
    from flyspec.server.settings import LIMIT_FLAGS, ServerLimits

    if args.drafter not in (None, "ngram"):
        raise ConfigError(
            f"--drafter {args.drafter}: --engine vllm drafts with flyspec's n-gram proposer only (--drafter ngram); "
            "vLLM's own drafters (a draft model, EAGLE) are started with vLLM itself"
        )
    if args.verifier not in (None, "exact", "fly"):
        raise ConfigError(
            f"--verifier {args.verifier}: on --engine vllm a server-wide rule is exact, fly, or a profile's chosen "
            'point (--profile); per request any of them: "vllm_xargs": {"flyspec_rule": "' + args.verifier + '"}'
        )
    others = [name for name in FLAG_NAMES if name not in (*TAKEN_FLAGS, "draft_model")]
    given = [name for name in others if getattr(args, name, None) is not None]
    if args.speculative_config or given:
        option = "--speculative-config" if args.speculative_config else "--" + given[0].replace("_", "-")
        raise ConfigError(
            f"{option}: --engine vllm sets a server-wide rule from --verifier fly or a calibration profile only "
            "(flyspec calibrate --engine vllm, then --profile); a request sets its own in vllm_xargs "
            "(docs/guides/vllm.md, 'Request fields')"
        )
    if args.device != DEFAULT_DEVICE:
        raise ConfigError(f"--device {args.device}: vLLM runs on the device its build is for; leave --device out")
    for dest, flag, default in UNMAPPED:
        if getattr(args, dest, default) != default:
            raise ConfigError(f"{flag}: flyspec's engine only; vLLM's server has no such option (leave it out)")
    defaults = ServerLimits()
    for flag, name, _ in LIMIT_FLAGS:
        if getattr(args, name) != getattr(defaults, name):
            instead = INSTEAD.get(flag, "vLLM's server has no such limit")
            raise ConfigError(f"{flag}: flyspec's engine only ({instead}); leave it out with --engine vllm")
    if args.ngram_cache_save_interval != 300.0 or args.ngram_cache_file_max_entries != 1_000_000:
        raise ConfigError("the --ngram-cache-* options are flyspec's engine's (its ngram-cache drafter)")


VLLM_ONLY = (
    ("vllm_venv", "--vllm-venv", None),
    ("tensor_parallel_size", "--tensor-parallel-size", 1),
    ("max_model_len", "--max-model-len", 4096),
    ("kv_cache_memory_bytes", "--kv-cache-memory-bytes", None),
    ("gpu_memory_utilization", "--gpu-memory-utilization", None),
    ("max_num_seqs", "--max-num-seqs", None),
    ("vllm_eager", "--no-vllm-eager", True),
)


def check_flyspec_options(args: argparse.Namespace) -> None:
    """``flyspec serve`` on its own engine: refuse the options that only size a vLLM engine."""
    for dest, flag, default in VLLM_ONLY:
        if getattr(args, dest, default) != default:
            raise ConfigError(f"{flag} sizes a vLLM engine: add --engine vllm, or leave it out")


def vllm_platform(python: Path) -> dict[str, Any]:
    """The vLLM distribution in the venv: its version and whether it is the CPU build (read from its metadata,
    without importing vLLM)."""
    probe = (
        "import importlib.metadata as m, json\n"
        "def v(name):\n"
        "    try:\n        return m.version(name)\n    except m.PackageNotFoundError:\n        return None\n"
        "print(json.dumps({'cpu': v('vllm-cpu'), 'gpu': v('vllm')}))"
    )
    completed = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    try:
        found = json.loads(completed.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        found = {"cpu": None, "gpu": None}
    return {"version": found["cpu"] or found["gpu"] or "unknown", "cpu": found["cpu"] is not None}


def cpu_binding(threads: int | None, ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for this process's CPUs (the first ``threads`` of them): one range per
    tensor-parallel rank, ``|`` between ranks (vLLM-CPU's syntax)."""
    cpus = sorted(os.sched_getaffinity(0))
    if threads is not None:
        if threads < 1:
            raise ConfigError(f"--threads must be >= 1 (got {threads})")
        cpus = cpus[:threads]
    if len(cpus) < ranks:
        raise ConfigError(f"--tensor-parallel-size {ranks} needs a CPU per rank; this process may use {len(cpus)}")
    share = len(cpus) // ranks
    return "|".join(_ranges(cpus[rank * share : (rank + 1) * share]) for rank in range(ranks))


def _ranges(cpus: list[int]) -> str:
    parts: list[str] = []
    start = previous = cpus[0]
    for cpu in [*cpus[1:], None]:
        if cpu is not None and cpu == previous + 1:
            previous = cpu
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if cpu is not None:
            start = previous = cpu
    return ",".join(parts)


def plan(args: argparse.Namespace) -> Launch:
    """Everything checked and decided before vLLM starts: a :class:`ConfigError` says what was wrong."""
    from flyspec.cli.options import vllm_options
    from flyspec.cli.speculation import speculation_config
    from flyspec.harness.vllm_worker import check_venv, venv_python
    from flyspec.server.settings import api_keys_from, is_loopback

    check_options(args)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535] (got {args.port})")
    options = vllm_options(args)
    python = venv_python(args.vllm_venv)
    check_venv(python)
    spec = speculation_config(args)
    model_path, dtype, spec, profile = _model_and_rule(args, spec)
    if spec.verifier not in ("exact", "fly"):
        raise ConfigError(
            f"profile {profile.name if profile else ''}: its point is {spec.verifier}, and on vLLM the plugin applies "
            'a server-wide rule for FLy only; serve it per request ("vllm_xargs": {"flyspec_rule": ...}) or choose '
            "--verifier fly (its best FLy point)"
        )
    notes: list[str] = []
    environment: dict[str, str] = {}
    switch, rule = _switch(args, spec, profile, notes)
    environment["FLYSPEC_VLLM_FLY"] = switch
    if spec.guard.is_bare and spec.verifier == "fly":
        environment["FLYSPEC_VLLM_GUARDS"] = "bare"
    speculative: dict[str, Any] = {
        "method": "custom_class",
        "model": PROPOSER,
        "num_speculative_tokens": spec.num_draft_tokens,
    }
    defaults = SpeculationConfig().ngram
    if spec.ngram.max_ngram != defaults.max_ngram or spec.ngram.min_ngram != defaults.min_ngram:
        speculative.update(prompt_lookup_max=spec.ngram.max_ngram, prompt_lookup_min=spec.ngram.min_ngram)
    if profile is not None:
        plugin = profile.record.get("deploy", {}).get("vllm_plugin", {})
        for name, value in plugin.get("environment", {}).items():
            if name == "FLYSPEC_VLLM_SCHEDULE":
                environment[name] = value
        if profile.point() is not None or profile.point("fly") is not None:
            environment["FLYSPEC_VLLM_PROFILE"] = str(Path(profile.path).resolve()) if profile.path else ""
    platform = vllm_platform(python)
    if platform["cpu"] and THREADS_VARIABLE not in os.environ:
        environment[THREADS_VARIABLE] = cpu_binding(args.threads, options.tensor_parallel_size)
    elif args.threads is not None and not platform["cpu"]:
        raise ConfigError("--threads binds vLLM-CPU's threads; this venv's vLLM is not the CPU build")
    metrics_dir: Path | None = None
    if METRICS_VARIABLE not in os.environ:
        metrics_dir = Path(tempfile.mkdtemp(prefix="flyspec-vllm-metrics-"))
        environment[METRICS_VARIABLE] = str(metrics_dir)
    name = args.served_model_name or args.target
    settings = options.to_dict()
    memory = (
        ["--kv-cache-memory-bytes", str(settings["kv_cache_memory_bytes"])]
        if options.gpu_memory_utilization is None
        else ["--gpu-memory-utilization", str(options.gpu_memory_utilization)]
    )
    command = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--served-model-name", name,
        "--host", args.host, "--port", str(args.port), "--dtype", dtype,
        "--tensor-parallel-size", str(options.tensor_parallel_size), "--max-model-len", str(options.max_model_len),
        *memory, *(["--max-num-seqs", str(options.max_num_seqs)] if options.max_num_seqs else []),
        *(["--enforce-eager"] if options.eager else []), "--uvicorn-log-level", args.log_level,
    ]  # fmt: skip
    command += ["--speculative-config", json.dumps(speculative)]
    keys = api_keys_from(args)
    if len(keys) == 1:
        environment["VLLM_API_KEY"] = keys[0]  # vLLM's own variable: the key stays out of the process list
    elif keys:
        command += ["--api-key", *keys]
    if not keys and not is_loopback(args.host):
        notes.append(
            f"!!! NO API KEY: {args.host} is not a loopback address, so anyone who can reach this port can use the "
            "model. Pass --api-key (or $FLYSPEC_API_KEY) unless a proxy in front authenticates clients. !!!"
        )
    if os.environ.get("FLYSPEC_VLLM_TRUST_REQUESTS", "0").strip().lower() in ("1", "true"):
        notes.append("FLYSPEC_VLLM_TRUST_REQUESTS is set: requests may set the trust guards (never on a shared server)")
    if args.cors_origin:
        command += ["--allowed-origins", json.dumps(list(args.cors_origin))]
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    url = f"http://{host}:{args.port}"
    memory_text = (
        f"KV cache {settings['kv_cache_memory_bytes'] / 2**30:.3g} GiB"
        if options.gpu_memory_utilization is None
        else f"KV cache {options.gpu_memory_utilization:g} of the device's memory"
    )
    drafts = f"flyspec's n-gram proposer, k {spec.num_draft_tokens}"
    binding = environment.get(THREADS_VARIABLE, os.environ.get(THREADS_VARIABLE))
    summary = (
        f"{PREFIX}{name} ({model_path}) on vLLM {platform['version']} "
        f"({python.parent.parent}), {dtype}, {drafts}, {rule}; {memory_text}"
        + (f", threads bound to CPUs {binding}" if binding else "")
        + (", eager" if options.eager else "")
        + (f", {len(keys)} API key{'s' if len(keys) > 1 else ''}" if keys else "")
        + f"; http://{args.host}:{args.port}/v1, plugin counters at /metrics (flyspec_vllm_*"
        + f", through {environment.get(METRICS_VARIABLE) or os.environ[METRICS_VARIABLE]})"
    )
    return Launch(command, environment, summary, url, metrics_dir, notes)


def _model_and_rule(args: argparse.Namespace, spec: SpeculationConfig) -> tuple[str, str, SpeculationConfig, Any]:
    """The model directory vLLM loads, the dtype it runs in, and the server-wide rule with the profile that decided
    it (held against the model, its dtype and the engine, as ``flyspec serve`` does)."""
    from flyspec.profiles import load_dtype, resolution
    from flyspec.runtime.loading import hf_source, load_served, resolve_dtype

    dtype = load_dtype([spec], args.target, args.dtype, DEFAULT_DEVICE).dtype
    dtype = str(resolve_dtype(dtype)).removeprefix("torch.")
    source = hf_source(args.target)
    if not Path(source).is_dir():  # a hub id: vLLM downloads it; no profile can be held against it here
        if spec.profile not in (PROFILE_AUTO, PROFILE_NONE):
            raise ConfigError(f"--profile with a hub id: download {args.target} first and pass the directory")
        return source, dtype, spec, None
    served = load_served(args.target, dtype)
    resolved = resolution(spec, served, engine="vllm")
    return served.path, dtype, resolved.spec, resolved.profile


def _switch(args: argparse.Namespace, spec: SpeculationConfig, profile: Any, notes: list[str]) -> tuple[str, str]:
    """``FLYSPEC_VLLM_FLY`` and the words for what every request gets. A server-wide lossy rule (``--verifier fly``,
    a profile's lossy point) is ``all``: every greedy request, unless it sends ``rejection_sample_method:
    "standard"``. Otherwise ``--allow-request-speculative`` decides whether a request may ask for a lossy rule:
    ``all`` → ``request``; ``lossless`` (the default) and ``none`` → ``off`` (a request's lossy rule is not applied)."""
    lossy = spec.verifier != "exact"
    where = f" (profile {profile.name})" if profile is not None else ""
    if lossy:
        guards = "bare rule, no trust guards" if spec.guard.is_bare else "trust guards"
        return "all", f"{spec.verifier}{where} for every greedy request (LOSSY, {guards}); sampled requests lossless"
    if args.allow_request_speculative == "all":
        return "request", f"exact{where}; a request may ask for a lossy rule (vllm_xargs)"
    return (
        "off",
        f"exact (lossless){where}; a request's lossy rule is not applied (allowed by --allow-request-speculative all)",
    )


def serve_on_vllm(args: argparse.Namespace) -> int:
    """Start vLLM's server, say where, wait until it answers, and stop it on Ctrl-C or SIGTERM."""
    from flyspec.server.supervisor import Supervisor

    logging.getLogger("flyspec").setLevel(getattr(logging, args.log_level.upper()))
    launch = plan(args)
    logger.info("%s", launch.summary)
    for note in launch.notes:
        logger.warning("%s%s", PREFIX, note)
    try:
        return Supervisor(launch.command, launch.environment, launch.url, PREFIX).run()
    finally:
        if launch.metrics_dir is not None:
            shutil.rmtree(launch.metrics_dir, ignore_errors=True)
