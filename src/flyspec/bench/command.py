"""``flyspec bench``: every method on the same prompts in one run, with peers, τ-limits and plots."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from flyspec.bench.report import ORDERS
from flyspec.cli.extras import require_extra
from flyspec.cli.options import add_model_options, engine_options
from flyspec.cli.speculation import add_speculation_options
from flyspec.config.names import LOSSY_VERIFIERS

QUICK_LIMIT = 2
QUICK_MAX_NEW_TOKENS = 48
DEFAULT_MAX_NEW_TOKENS = 128
# per --workload: (default, --quick) new tokens; an edit's reply is a whole function (up to ~300 tokens)
MAX_NEW_TOKENS = {"spec-bench": (DEFAULT_MAX_NEW_TOKENS, QUICK_MAX_NEW_TOKENS), "edit": (200, 128)}


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "bench",
        help="benchmark speedup and acceptance on Spec-Bench (or your prompts), with peers",
        description="Run plain decoding, flyspec's speculative methods and peer implementations (transformers "
        "generate: plain, prompt lookup, assisted; llama.cpp when installed) on the same prompts in one run, "
        "interleaved per prompt. Writes results.json (every record), report.md and PNG plots to --out. "
        "Speedup = method tokens/s ÷ plain decoding tokens/s over the same prompts. Lossy methods ("
        f"{', '.join(LOSSY_VERIFIERS)}) are labelled; measure their quality with `flyspec eval`. At --temperature > 0 "
        "the report puts each method's sampled-text NLL under the target beside its speed.",
    )
    parser.set_defaults(handler=run)
    data = parser.add_argument_group("prompts")
    data.add_argument(
        "--workload",
        choices=tuple(MAX_NEW_TOKENS),
        default="spec-bench",
        help="spec-bench (default): Spec-Bench's prompts, or --dataset's; edit: 34 requests to edit a real function "
        "(rename, comment, constant, docstring, delete; regenerate: the code not in the prompt), each with the code "
        "before the edit as its prediction; default methods plain, ngram+exact, prediction+exact, hf-lookup, 200 new "
        "tokens (--quick: 128)",
    )
    data.add_argument(
        "--dataset", help='JSONL of prompts: Spec-Bench records or {"prompt": ...} (default: vendored Spec-Bench)'
    )
    data.add_argument("--categories", help="comma-separated categories to run (default: all in the dataset)")
    data.add_argument("--limit", type=int, help="first N prompts per category (default: all; --quick: 2)")
    data.add_argument("--skip-bad-lines", action="store_true", help="skip malformed JSONL lines (default: stop)")
    run_group = parser.add_argument_group("run")
    run_group.add_argument(
        "--methods",
        help="comma-separated: plain, [prediction+][<ngram|ngram-cache|draft|multilevel|layer-skip|stack>+]<verifier>"
        "[+bare|+guard|+digits|+names|+identifiers] (no drafter: --speculative-config's, default ngram; +bare: a "
        "lossy verifier without the trust guards, +guard/+digits/...: which tokens they protect; prediction+: given "
        "each prompt's prediction, as on --workload edit), hf-plain, "
        "hf-lookup, hf-assisted, llamacpp-plain, llamacpp-lookup, vllm-plain, vllm-ngram, vllm-ngram+fly, "
        "vllm-ngram+fly+bare (default: plain, ngram+{exact,fly,fly+bare,margin,typical}, hf-plain, hf-lookup; "
        "with --draft-model also draft+exact, draft+fly, multilevel+fly, hf-assisted; `baseline` is the old name "
        "of plain); with --concurrency also vllm-flyspec-ngram, vllm-plain-twin (a second vllm-plain engine, a "
        "control: how far two identical engines in separate processes land apart) and vllm-plain-colocated (a plain "
        "engine in the flyspec-proposer method's own process: the verdict's plain peer, without that spread)",
    )
    run_group.add_argument("--repeats", type=int, default=1, help="runs per prompt and method; medians reported")
    run_group.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the warm-up generations")
    run_group.add_argument(
        "--order",
        choices=ORDERS,
        default="interleaved",
        help="interleaved (default): every method on each prompt before the next, the method order rotated and "
        "reversed; blocks: each method on the first half of the prompts back to back, then each on the second half "
        "in reverse method order (each engine in its steady state: on a small machine the first request after "
        "another engine's process ran is slower)",
    )
    run_group.add_argument(
        "--max-new-tokens",
        type=int,
        help=f"per turn (default {DEFAULT_MAX_NEW_TOKENS}; --quick: {QUICK_MAX_NEW_TOKENS})",
    )
    run_group.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 = greedy (default); above 0 every method samples (the vLLM peers too, seeded per request) and each "
        "output is scored by the target: its mean NLL per token at the sampling distribution, the share of tokens of "
        "NLL > 8 and of tokens outside top-k/top-p, beside plain sampling's, and a method whose text is less likely "
        "than plain's beyond chance (a paired test over prompts) is flagged 'sampler suspect'",
    )
    run_group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling at temperature > 0 (1 = off)")
    run_group.add_argument("--top-k", type=int, default=0, help="top-k sampling at temperature > 0 (0 = off)")
    run_group.add_argument("--seed", type=int, default=0, help="base seed (prompt i uses seed + i)")
    run_group.add_argument(
        "--hf-lookup-tokens", type=int, default=10, help="transformers prompt_lookup_num_tokens (default 10)"
    )
    run_group.add_argument(
        "--quick", action="store_true", help="a few-minute run: --limit 2 and --max-new-tokens 48 unless given"
    )
    vllm = parser.add_argument_group("vLLM peers (vllm-*: run in their own venv, see DEPLOYMENT.md)")
    vllm.add_argument(
        "--vllm-venv", help="the vLLM venv (default: $FLYSPEC_VLLM_VENV, else .venv-vllm as `make vllm-setup`)"
    )
    vllm.add_argument(
        "--vllm-eager", action="store_true", help="vLLM's enforce_eager: starts ~3x faster, runs ~15%% slower"
    )
    vllm.add_argument(
        "--llama-server",
        help="llama.cpp's server for the --online llama-server methods (default: $FLYSPEC_LLAMA_SERVER, else "
        "build/llama-server/bin/llama-server as `make llama-server` builds it)",
    )
    load = parser.add_argument_group(
        "under load (vLLM engines: throughput against batch size, and a batch schedule that never costs throughput)"
    )
    load.add_argument(
        "--concurrency",
        help="batch sizes to measure, e.g. 1,2,4,8,16,32: each vllm-* method's total tokens/s with that many requests "
        "decoded together (default methods: vllm-plain, vllm-ngram, vllm-ngram+fly); writes report.md, load.json, "
        "throughput.png",
    )
    load.add_argument(
        "--derive-schedule",
        action="store_true",
        help="sweep draft lengths on flyspec's proposer at each concurrency and derive the batch schedule (how many "
        "tokens to speculate per batch size; 0 = none) into schedule.json, then measure the methods with it",
    )
    load.add_argument("--schedule", help="measure flyspec's proposer with this schedule.json too")
    load.add_argument(
        "--online",
        action="store_true",
        help="measure OpenAI-compatible servers instead, with that many concurrent streaming clients: vLLM's (the "
        "vllm-* methods), flyspec-serve and llama.cpp's (llama-server, llama-server-ngram: --llama-server) (default: "
        "vllm-plain, vllm-ngram, vllm-ngram+fly, flyspec-serve); total and per-request tokens/s, time to first token "
        "and per output token, p50/p99; a target without a chat template gets completions",
    )
    load.add_argument("--load-prompts", type=int, default=8, help="prompts per point at least (default 8; --quick: 4)")
    load.add_argument(
        "--draft-lengths", default="0,2,4,8,15", help="draft lengths the sweep tries (default 0,2,4,8,15; capped at -k)"
    )
    add_model_options(parser)
    add_speculation_options(parser, components=False)
    out = parser.add_argument_group("output")
    out.add_argument("--out", default="bench-results", help="output directory (default bench-results)")
    out.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG plots")
    out.add_argument("-v", "--verbose", action="store_true", help="log model loading")


def run(args: argparse.Namespace) -> int:
    require_extra("bench", "flyspec bench")
    if args.concurrency or args.derive_schedule or args.schedule:
        return _run_load(args)
    # Heavy imports only when benchmarking (keeps `flyspec generate` quick to start).
    from flyspec.bench.backends import BackendSettings, conversation_ids
    from flyspec.bench.live import LiveView
    from flyspec.bench.loop import BenchSettings, VllmSettings, bench_methods, forward_times, make_backends, run_bench
    from flyspec.bench.nll import NllScorer
    from flyspec.cli.speculation import speculation_config
    from flyspec.config import ConfigError, SamplingConfig
    from flyspec.drafters.prediction import MAX_PREDICTION_DRAFT_TOKENS
    from flyspec.harness.data import RECORDS_FILE, JsonlWriter
    from flyspec.harness.methods import speculations
    from flyspec.resources import Resources
    from flyspec.runtime.loading import set_threads
    from flyspec.runtime.memory_floor import memory_floor

    limit = args.limit if args.limit is not None else (QUICK_LIMIT if args.quick else None)
    max_new_tokens = args.max_new_tokens or MAX_NEW_TOKENS[args.workload][args.quick]
    if args.repeats < 1 or max_new_tokens < 1 or args.hf_lookup_tokens < 1:
        raise ConfigError("--repeats, --max-new-tokens and --hf-lookup-tokens must be >= 1")
    methods = bench_methods(args.methods, has_draft_model=args.draft_model is not None, workload=args.workload)
    prompts = _prompts(args, limit)
    if any(method.prediction for method in methods) and not any(prompt.prediction for prompt in prompts):
        raise ConfigError("a prediction+... method needs prompts with a prediction: --workload edit, or a --dataset "
                          'whose records carry "prediction"')  # fmt: skip
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    speculation = speculation_config(args)
    out_dir = _prepare_out_dir(Path(args.out))

    set_threads(args.threads)
    # this run's models, calibrations (and each method's own caches)
    resources = Resources(**engine_options(args, speculations(methods, speculation)))
    target = resources.model(args.target)
    draft = resources.model(args.draft_model) if args.draft_model else None
    settings = BackendSettings(sampling, speculation, args.use_chat, args.hf_lookup_tokens, resources)
    skipped: dict[str, str] = {}
    vllm = VllmSettings(args.vllm_venv, args.vllm_eager)
    backends = make_backends(methods, target, draft, settings, vllm, skipped)

    k = speculation.num_draft_tokens
    context = conversation_ids(target, prompts[0].turns[:1], [], args.use_chat)
    context = (context * (1 + 200 // len(context)))[:200]  # a typical mid-generation context length
    longest = k + 1  # a prediction's draft may be longer than k (drafters/prediction.py): the cost limit needs t(n)
    if any(method.prediction for method in methods):
        longest = max(longest, MAX_PREDICTION_DRAFT_TOKENS + 1)
    times = forward_times(target, context, tuple(range(1, longest + 1)), repeats=3 if args.quick else 7)
    floor = memory_floor(target.model, target.device, target.weight_bytes)  # what t(1) cannot go below here
    meta = _meta(args, target, prompts, max_new_tokens, k, limit)
    meta.update(forward_context=len(context), forward_times_ms={str(size): 1000 * t for size, t in times.items()})
    meta["memory_floor"] = floor.as_dict()
    meta["skipped_peers"] = skipped
    startup = {name: getattr(backend, "startup_s", None) for name, backend in backends.items()}
    meta["vllm_startup_s"] = {name: seconds for name, seconds in startup.items() if seconds is not None}
    meta["vllm_eager"] = args.vllm_eager
    scorer = None if sampling.greedy else NllScorer(target, sampling)  # each sampled text's NLL (bench/nll.py)

    records_path = out_dir / RECORDS_FILE
    bench = BenchSettings(max_new_tokens, args.repeats, args.warmup, args.seed, args.order)
    with JsonlWriter(records_path, append=False) as sink, LiveView(len(prompts), k) as view:

        def on_record(record: dict) -> None:
            sink.write(record)
            view.add(record)

        failures: dict[str, str] = {}
        meta["failed_peers"] = failures
        try:
            run_bench(prompts, backends, target, bench, args.use_chat, on_record, view.prompt_done, failures, scorer)
            meta["vllm_batched"] = _run_batched(backends, target, prompts, max_new_tokens, args.use_chat, args.seed)
        except BaseException:
            meta["interrupted"] = True  # write what was measured, then re-raise
            raise
        finally:
            _close_peers(backends)
            _write_outputs(out_dir, meta, view.records, times, k, args.plots, view.console)
    return 0


def _prompts(args: argparse.Namespace, limit: int | None) -> list:
    """``--workload``'s prompts (``bench/data.py``), the asked categories, ``limit`` per category."""
    from flyspec.bench.data import load_edit_prompts, load_prompts
    from flyspec.config import ConfigError

    categories = tuple(c.strip() for c in (args.categories or "").split(",") if c.strip())
    if args.workload == "spec-bench":
        return load_prompts(args.dataset, categories=categories, limit=limit, skip_bad_lines=args.skip_bad_lines)
    if args.dataset:
        raise ConfigError("--workload edit brings its own prompts: drop --dataset (or give it without --workload)")
    return load_edit_prompts(categories=categories, limit=limit)


def _run_load(args: argparse.Namespace) -> int:
    """``--concurrency``: vLLM engines under load (``bench/load.py``)."""
    from rich.console import Console

    from flyspec.bench import llama_server, load, online
    from flyspec.bench.backends import conversation_ids
    from flyspec.bench.data import interleaved
    from flyspec.cli.speculation import speculation_config
    from flyspec.config import ConfigError
    from flyspec.config.schedule import BatchSchedule
    from flyspec.harness.meta import run_metadata
    from flyspec.harness.vllm_worker import VllmOptions, check_venv, venv_python
    from flyspec.runtime.loading import cpu_isa, load_served

    if not args.concurrency:
        raise ConfigError("--derive-schedule and --schedule measure under load: give --concurrency too (e.g. 1,2,4,8)")
    defaults = (*load.DEFAULT_METHODS, online.FLYSPEC_SERVE) if args.online else load.DEFAULT_METHODS
    names = [name.strip() for name in (args.methods or ",".join(defaults)).split(",") if name.strip()]
    schedule = BatchSchedule.load(args.schedule) if args.schedule else None
    if args.online and args.derive_schedule:
        raise ConfigError("--derive-schedule measures offline: derive it first, then pass --online --schedule FILE")
    if args.online and load.COLOCATED in names:
        raise ConfigError(f"--online: {load.COLOCATED} shares an offline engine's process, and each server has its "
                          f"own; use {load.TWIN} for the spread between servers")  # fmt: skip
    servers = (online.FLYSPEC_SERVE, *llama_server.METHODS)  # online only: not vLLM engines
    if not args.online and any(name in llama_server.METHODS for name in names):
        raise ConfigError("llama-server is a server: measure it with --online")
    engines = [name for name in names if not (args.online and name in servers)]
    load.check_methods(engines, args.derive_schedule, schedule)
    k = speculation_config(args).num_draft_tokens
    lengths = tuple(sorted({min(int(part), k) for part in args.draft_lengths.split(",") if part.strip()} | {0}))
    max_new_tokens = args.max_new_tokens or (QUICK_MAX_NEW_TOKENS if args.quick else 96)
    minimum = 4 if args.quick and args.load_prompts == 8 else args.load_prompts
    if minimum < 1 or max_new_tokens < 1 or args.repeats < 1:
        raise ConfigError("--load-prompts, --max-new-tokens and --repeats must be >= 1")
    settings = load.LoadSettings(load.parse_concurrencies(args.concurrency), max_new_tokens, minimum, k, lengths,
                                 args.derive_schedule, schedule, repeats=args.repeats)  # fmt: skip
    python = venv_python(args.vllm_venv)
    check_venv(python)
    out_dir = _prepare_out_dir(Path(args.out))
    target = load_served(args.target, args.dtype)
    dataset = _prompts(args, None)  # the edit workload's too: vLLM's engines run its prompts without predictions
    console = Console(stderr=True)
    if args.online:
        return online.run_servers(args, names, target, interleaved(dataset), settings, schedule, python, out_dir,
                                  console)  # fmt: skip
    needed = settings.prompts_at(settings.concurrencies[-1])
    prompts = [conversation_ids(target, p.turns[:1], [], args.use_chat) for p in interleaved(dataset)[:needed]]
    options = VllmOptions(eager=args.vllm_eager)
    workers = load.start_workers(names, python, target.path, target.dtype_name, settings, options)
    try:
        first = next(iter(workers.values()))
        meta = {**run_metadata(target, getattr(args, "command_line", None)), "cpu_isa": cpu_isa(),
                "vllm_version": first.vllm_version, "eager": args.vllm_eager, "num_draft_tokens": k,
                "max_new_tokens": max_new_tokens, "min_prompts": minimum, "repeats": args.repeats,
                "concurrencies": list(settings.concurrencies)}  # fmt: skip
        run = load.LoadRun()
        try:
            run = load.run_load(workers, prompts, settings, console.print)
        finally:
            run.startup_s = {name: worker.startup_s for name, worker in workers.items()}
            written = load.write_outputs(out_dir, meta, run, args.plots)
    finally:
        load.close_workers(workers)
    console.print("wrote " + ", ".join(str(path) for path in written))
    return 0


def _run_batched(
    backends: dict, target: Any, prompts: list, max_new_tokens: int, use_chat: bool | None, seed: int
) -> dict:
    """The batched vLLM figure: every prompt's first turn submitted at once (vllm-plain, vllm-ngram+fly); prompt i
    seeded ``seed + i`` as in the run."""
    if not any(name.startswith("vllm-") for name in backends):
        return {}
    from flyspec.bench.backends import conversation_ids
    from flyspec.bench.vllm import run_batched

    first_turns = [conversation_ids(target, prompt.turns[:1], [], use_chat) for prompt in prompts]
    return run_batched(backends, first_turns, max_new_tokens, seed)


def _close_peers(backends: dict) -> None:
    for backend in backends.values():
        close = getattr(backend, "close", None)
        if close is not None:
            close()


def _prepare_out_dir(path: Path) -> Path:
    from flyspec.config import ConfigError

    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"cannot create output directory {str(path)!r}: {error.strerror}") from None
    if not os.access(path, os.W_OK):
        raise ConfigError(f"output directory {str(path)!r} is not writable")
    return path


def _write_outputs(
    out_dir: Path, meta: dict, records: list[dict], times: dict[int, float], k: int, plots: bool, console: Any
) -> None:
    from flyspec.bench.report import markdown_report, write_json, write_plots
    from flyspec.bench.summary import summarize

    if not records:
        console.print("no measurements to report")
        return
    summary = summarize(records, times, k)
    write_json(out_dir / "results.json", meta, summary, records)
    (out_dir / "report.md").write_text(markdown_report(meta, summary), encoding="utf-8")
    written = [out_dir / "results.json", out_dir / "report.md", out_dir / "records.jsonl"]
    if plots:
        written += write_plots(out_dir, summary)
    console.print("wrote " + ", ".join(str(path) for path in written))


def _meta(
    args: argparse.Namespace, target: Any, prompts: list, max_new_tokens: int, k: int, limit: int | None
) -> dict[str, Any]:
    from flyspec.config import SamplingConfig
    from flyspec.harness.meta import run_metadata

    greedy = SamplingConfig(args.temperature, args.top_k, args.top_p).greedy
    return {
        **run_metadata(target, getattr(args, "command_line", None)),
        "draft_model": args.draft_model,
        "dataset": args.dataset or ("the edit workload" if args.workload == "edit" else "Spec-Bench") + " (vendored)",
        "workload": args.workload,
        "categories": list(dict.fromkeys(prompt.category for prompt in prompts)),
        "limit_per_category": limit,
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "num_draft_tokens": k,
        "compile": args.compile,
        "temperature": args.temperature,
        # sampled runs only (greedy records stay as they were): what the NLL columns score against
        **({} if greedy else {"top_p": args.top_p, "top_k": args.top_k, "seed": args.seed}),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "order": args.order,
    }
