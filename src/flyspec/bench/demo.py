"""``flyspec demo``: a two-minute benchmark on the packaged model, plain vs lossless vs FLy.

Three rows on the same prompt ids, interleaved per prompt (``bench/loop.run_bench``), greedy:

plain
    autoregressive decoding, one target forward per token: the denominator of every speedup;
lossless
    n-gram drafts + exact verification with the cost-aware draft length: the library defaults,
    token for token plain decoding's output;
fly
    n-gram drafts + FLy loose verification (arXiv 2511.22972) at the shipped calibration profile for
    this model, drafter and dtype (``profile="auto"``, ``profiles/profile.py``); without one, flyspec's guarded
    FLy defaults. Lossy: "changed in meaning" is ``flyspec eval``'s scorer (``eval/trust.py``: the
    numbers or identifiers of the output differ from plain decoding's).

One prompt per Spec-Bench category (first turn only, chat template as ``flyspec bench``), a short
length limit, and every figure from this one run: a first look, not a measurement
(``flyspec bench`` repeats, reports spreads and limits).

Then a second table, on a few requests to edit a function (``flyspec bench --workload edit``'s: the kinds taking
turns, the shortest of each, the first a rename and the second a regeneration whose earlier answer the prompt does
not hold), where the answer copies text the user holds: plain, lossless, and **prediction** — the code before the
edit as OpenAI's ``prediction`` beside the n-gram drafts, exact verification. Chat beside edit shows where
speculation pays and where it does not.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import shlex
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from flyspec.cli.extras import require_extra
from flyspec.cli.options import add_target_option
from flyspec.config import DEFAULT_DTYPE, ConfigError
from flyspec.config.names import DEFAULT_MODEL, DTYPE_NAMES, LOSSLESS_VERIFIERS

if TYPE_CHECKING:
    from flyspec.decoding.speculative import SpeculativeDecoder

DEMO_MAX_NEW_TOKENS = 48
# the table's rows: (row name, bench method, what it runs)
ROWS = (
    ("plain", "plain", "autoregressive"),
    ("lossless", "ngram+exact", "n-gram drafts + exact, cost-aware k"),
    ("fly", "ngram+fly", "n-gram drafts + FLy (lossy)"),
)
LEGEND = (
    "prediction tokens = draft tokens taken from the prediction that exact verification kept / scored and "
    "rejected (OpenAI's accepted_prediction_tokens / rejected_prediction_tokens); a regenerate request's "
    "prompt does not hold the earlier answer its prediction is, so only the prediction row can copy it"
)
LEGEND = (
    "speedup = tokens/s ÷ plain's, measured in this run; τ = tokens committed per target forward; "
    "loose accepts = draft tokens FLy kept where the target would have chosen another; "
    "identical = outputs equal to plain's token for token; changed in meaning = outputs whose numbers or "
    "identifiers differ from plain's (flyspec eval's scorer)"
)


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "demo",
        help="a two-minute benchmark: plain, lossless and FLy on one prompt per Spec-Bench category, and edits",
        description="Run plain decoding, lossless speculative decoding (n-gram drafts + exact verification) and "
        "FLy (n-gram drafts + loose verification at the shipped calibration profile) on a few Spec-Bench prompts, "
        "greedy, and print tokens/s, speedup, τ, loose accepts, and how many outputs are identical to plain "
        "decoding's or changed in meaning; then plain, lossless and prediction (the code before the edit as "
        "OpenAI's prediction, exact verification) on a few requests to edit a function, where speculation pays "
        "most. For real measurements: flyspec bench and flyspec eval.",
    )
    parser.set_defaults(handler=run)
    add_target_option(
        parser, f"target model: packaged name, .gguf file, HF directory or hub id (default {DEFAULT_MODEL})"
    )
    parser.add_argument(
        "--dtype",
        default=DEFAULT_DTYPE,
        choices=sorted(DTYPE_NAMES),
        help="weights/compute dtype (default auto: the dtype of the calibration profile flyspec ships for the "
        "model, so fly runs at the profile's operating point — float32 for the packaged models, in which "
        "lossless matches plain token for token; the machine's auto dtype where no profile is shipped)",
    )
    parser.add_argument(
        "--prompts",
        type=int,
        default=6,
        metavar="N",
        help="how many Spec-Bench prompts, one per category in turn (default 6: one of each)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=DEMO_MAX_NEW_TOKENS, help=f"per prompt (default {DEMO_MAX_NEW_TOKENS})"
    )
    parser.add_argument(
        "--edit-prompts",
        type=int,
        default=2,
        metavar="N",
        help="how many requests to edit a function, in a second table with a prediction row (default 2: a rename "
        "and a regeneration; 0: none); 128 new tokens each",
    )
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log model loading")


def run(args: argparse.Namespace) -> int:
    require_extra("bench", "flyspec demo")
    if args.prompts < 1 or args.max_new_tokens < 1:
        raise ConfigError("--prompts and --max-new-tokens must be >= 1")
    if args.edit_prompts < 0:
        raise ConfigError("--edit-prompts must be >= 0 (0: no edit table)")
    # Heavy imports only when the demo runs (keeps `flyspec --help` instant).
    from rich.console import Console

    from flyspec.bench.backends import BackendSettings, FlyspecBackend
    from flyspec.bench.loop import make_backends
    from flyspec.config import SamplingConfig, SpeculationConfig
    from flyspec.decoding.speculative import SpeculativeDecoder
    from flyspec.harness.methods import Method, parse_method
    from flyspec.profiles import load_dtype
    from flyspec.resources import Resources
    from flyspec.runtime.loading import set_threads

    prompts = demo_prompts(args.prompts)
    set_threads(args.threads)
    out, err = Console(), Console(stderr=True)
    if not out.is_terminal:
        out.width = max(out.width, 120)  # logs: no wrapping of the table
    choice = load_dtype([SpeculationConfig(verifier="fly")], args.target, args.dtype)  # the fly row's profile
    resources = Resources(choice.dtype)
    with err.status(f"loading {args.target}"):
        target = resources.model(args.target)
    out.print(header(target, len(prompts), args.max_new_tokens), highlight=False, soft_wrap=True)
    methods: list[Method] = [parse_method(method, ()) for _, method, _ in ROWS]
    settings = BackendSettings(SamplingConfig(), SpeculationConfig(), resources=resources)
    building = err.status("building the decoders (the cost-aware draft length times the target once per machine)")
    with building, said_here("flyspec.profiles"):  # the profile's decision is the one [profile] line below
        backends = make_backends(methods, target, None, settings)
    fly = backends["ngram+fly"]
    assert isinstance(fly, FlyspecBackend) and isinstance(fly.decoder, SpeculativeDecoder)
    line = profile_line(fly.decoder, choice.note is not None)
    out.print(f"[profile] {line}", highlight=False, markup=False, soft_wrap=True)
    fly_verifier = fly.decoder.speculation.verifier  # a profile without a FLy point falls back to exact
    records = decode(err, "plain, lossless, fly", prompts, backends, target, args.max_new_tokens)
    rows = row_figures(records, prompts, args.max_new_tokens, fly_verifier)
    out.print(table(rows, len(prompts)))
    say(out, [LEGEND, verdict(rows, len(prompts))])
    if args.edit_prompts:  # the edit requests: plain and lossless as above, and the prediction row
        say(out, run_edits(args.edit_prompts, backends, target, settings, out, err))
    commands = next_commands(args.target, str(target.dtype).removeprefix("torch."))
    say(out, ["Next:", *(f"  {command}" for command in commands)])
    return 0


def say(out: Any, lines: list[str]) -> None:
    for line in lines:
        out.print(line, highlight=False, markup=False, soft_wrap=True)


def run_edits(count: int, backends: dict[str, Any], target: Any, settings: Any, out: Any, err: Any) -> list[str]:
    """Decode ``count`` edit requests with the chat table's plain and lossless backends and a prediction one; print
    the table; return the legend and verdict lines."""
    from flyspec.bench import demo_edit as edit
    from flyspec.bench.loop import make_backends
    from flyspec.harness.methods import parse_method

    prompts = edit.edit_prompts(count)
    methods = [method for _, method, _ in edit.EDIT_ROWS]
    with err.status("building the prediction decoder"), said_here("flyspec.profiles"):
        missing = [parse_method(method, ()) for method in methods if method not in backends]
        built = {**backends, **make_backends(missing, target, None, settings)}
    rows_backends = {method: built[method] for method in methods}
    records = decode(err, "plain, lossless, prediction", prompts, rows_backends, target, edit.DEMO_EDIT_MAX_NEW_TOKENS)
    rows = edit.edit_figures(records)
    say(out, [edit.edit_title(prompts)])
    out.print(edit.edit_table(rows, len(prompts)))
    return [edit.EDIT_LEGEND, edit.edit_verdict(rows, len(prompts))]


def decode(
    err: Any, label: str, prompts: list[Any], backends: dict[str, Any], target: Any, max_new_tokens: int
) -> list[dict[str, Any]]:
    """``backends`` (by method name) on ``prompts``, interleaved (``bench/loop.run_bench``), greedy, with a progress
    bar on ``err``."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from flyspec.bench.loop import BenchSettings, run_bench

    columns = (SpinnerColumn(), TextColumn(f"decoding {label}"), BarColumn(), MofNCompleteColumn())
    progress = Progress(*columns, TextColumn("prompts"), TimeElapsedColumn(), console=err, redirect_stdout=False)
    records: list[dict[str, Any]] = []
    with progress:
        task = progress.add_task("decoding", total=len(prompts))
        bench = BenchSettings(max_new_tokens=max_new_tokens)
        run_bench(prompts, backends, target, bench, None, records.append, lambda: progress.advance(task))
    return records


def demo_prompts(count: int) -> list[Any]:
    """``count`` Spec-Bench prompts, one per category in turn, first turn only."""
    from flyspec.bench.data import SPEC_BENCH_CATEGORIES, BenchPrompt, load_prompts

    per_category = math.ceil(count / len(SPEC_BENCH_CATEGORIES))
    loaded = load_prompts(categories=SPEC_BENCH_CATEGORIES, limit=per_category)
    rank: dict[str, int] = {}
    ordered = []
    for prompt in loaded:
        rank[prompt.category] = rank.get(prompt.category, 0) + 1
        ordered.append((rank[prompt.category], SPEC_BENCH_CATEGORIES.index(prompt.category), prompt))
    chosen = [prompt for _, _, prompt in sorted(ordered, key=lambda item: item[:2])][:count]
    if len(chosen) < count:
        raise ConfigError(f"--prompts {count}: the packaged Spec-Bench set has {len(chosen)} to choose from")
    return [BenchPrompt(prompt.id, prompt.category, prompt.turns[:1]) for prompt in chosen]


def header(target: Any, num_prompts: int, max_new_tokens: int) -> str:
    import torch

    from flyspec.runtime.loading import cpu_isa, device_name

    dtype = str(target.dtype).removeprefix("torch.")
    where = device_name(target.device) if target.device.type == "cuda" else f"CPU with {cpu_isa()}"
    threads = torch.get_num_threads()
    where += f", {threads} torch thread{'' if threads == 1 else 's'}"
    return (
        f"flyspec demo: {target.name} in {dtype} on {where}; {num_prompts} Spec-Bench prompts, "
        f"greedy, {max_new_tokens} new tokens each"
    )


@contextlib.contextmanager
def said_here(logger_name: str) -> Iterator[None]:
    """Hold back ``logger_name``'s warnings while the demo builds its decoders: it says the same in one line."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def profile_line(decoder: SpeculativeDecoder, brought_dtype: bool = False) -> str:
    """The fly row's operating point, once: the shipped profile's (``Profile.describe``), what the fly row runs where
    the profile has no FLy point, and the dtype it brought (``brought_dtype``); or the guarded defaults."""
    profile = decoder.profile
    if profile is None:
        return "no shipped profile: guarded FLy defaults"
    verifier = decoder.speculation.verifier
    line = profile.describe() + ("" if verifier == "fly" else f"; the fly row runs {verifier}")
    if brought_dtype:
        line += f"; the models load in {profile.dtype}, the profile's dtype (--dtype chooses another)"
    return line


def row_figures(
    records: list[dict[str, Any]], prompts: list[Any], max_new_tokens: int, fly_verifier: str = "fly"
) -> list[dict[str, Any]]:
    """Per row: tokens/s, speedup, τ, loose accepts, identical and changed-in-meaning counts.

    ``fly_verifier``: what the fly row ran (``exact`` where the shipped profile found no FLy point)."""
    from flyspec.bench.summary import OVERALL, summarize
    from flyspec.eval.trust import meaning_change

    overall = summarize(records, None, 0)[OVERALL]
    plain = {record["prompt_id"]: record for record in records if record["method"] == "plain"}
    prompt_text = {prompt.id: prompt.turns[0] for prompt in prompts}
    rows = []
    for name, method, what in ROWS:
        figures = overall[method]
        changed = 0
        for record in (r for r in records if r["method"] == method and method != "plain"):
            reference = plain[record["prompt_id"]]
            change = meaning_change(
                "".join(record["texts"]),
                "".join(reference["texts"]),
                prompt_text[record["prompt_id"]],
                method_truncated=record["num_new_tokens"] >= max_new_tokens,
                plain_truncated=reference["num_new_tokens"] >= max_new_tokens,
            )
            changed += change.changed
        verifier = fly_verifier if name == "fly" else None
        if verifier not in (None, "fly"):
            what = f"n-gram drafts + {verifier} (profile: no FLy point)"
        rows.append(
            {
                "row": name,
                "what": what,
                "lossy": verifier not in (None, *LOSSLESS_VERIFIERS),
                "tokens_per_s": figures["tokens_per_s"],
                "speedup": figures["speedup"],
                "tau": figures["tau"],
                "loose_accepts": figures["num_loose_accepts"] or 0,
                "identical": None if method == "plain" else figures["num_identical"],
                "changed": None if method == "plain" else changed,
            }
        )
    return rows


def table(rows: list[dict[str, Any]], num_prompts: int) -> Any:
    from rich.table import Table

    grid = Table(title_justify="left")
    grid.add_column("row")
    grid.add_column("what it runs")
    for column in ("tokens/s", "speedup", "τ", "loose accepts", "identical", "changed in meaning"):
        grid.add_column(column, justify="right")
    for row in rows:
        lossy = row["lossy"]
        count = "–" if row["identical"] is None else f"{row['identical']}/{num_prompts}"
        changed = "–" if row["changed"] is None else f"{row['changed']}/{num_prompts}"
        grid.add_row(
            f"[red]{row['row']}[/red]" if lossy else row["row"],
            row["what"],
            f"{row['tokens_per_s']:.1f}",
            f"{row['speedup']:.2f}x",
            f"{row['tau']:.2f}" if row["tau"] is not None else "–",
            "–" if row["row"] == "plain" else str(row["loose_accepts"]),
            count,
            changed,
        )
    return grid


def verdict(rows: list[dict[str, Any]], num_prompts: int) -> str:
    """One honest line: which row was fastest, whether lossless matched plain, what fly changed. A fly row that ran
    as exact runs what the lossless row runs: it is no contender of its own, and their gap is this run's noise."""
    by_name = {row["row"]: row for row in rows}
    lossless, fly = by_name["lossless"], by_name["fly"]
    contenders = rows if fly["lossy"] else [row for row in rows if row is not fly]
    fastest = max(contenders, key=lambda row: row["tokens_per_s"])
    if fastest["row"] == "plain":
        speed = "plain was fastest: speculation did not pay off in this run"
    else:
        speed = f"{fastest['row']} was fastest ({fastest['speedup']:.2f}x plain)"
    exact = (
        "lossless matched plain on every prompt"
        if lossless["identical"] == num_prompts
        else f"lossless matched plain on {lossless['identical']}/{num_prompts} (rounding: not float32?)"
    )
    if not fly["lossy"]:
        loose = (
            "fly ran as exact (the shipped profile found no FLy setting inside its budget), the lossless row's rule: "
            f"its {fly['speedup']:.2f}x against lossless's {lossless['speedup']:.2f}x is this run's noise"
        )
    elif fly["loose_accepts"] == 0:
        loose = "fly made no loose accept, so it was lossless here"
    else:
        loose = (
            f"fly is lossy: {fly['loose_accepts']} loose accepts changed {num_prompts - fly['identical']}/"
            f"{num_prompts} outputs, {fly['changed']}/{num_prompts} in meaning"
        )
    return f"Verdict: {speed}; {exact}; {loose}."


def next_commands(target: str, dtype: str) -> list[str]:
    """What to run next, with the demo's model and dtype."""
    model = "" if target == DEFAULT_MODEL else f" --model {shlex.quote(target)}"
    common = f"{model} --dtype {dtype}"
    return [
        f"flyspec bench --quick{common} --methods plain,ngram+exact,ngram+fly   "
        "# every category, with peers; report + plots in bench-results/",
        f"flyspec bench --workload edit --quick{common}   "
        "# edit requests: plain, context drafts, the prediction beside them, transformers' prompt lookup",
        f"flyspec eval --tasks extract,numbers,code --limit 50 --methods exact,fly{common}   "
        "# what FLy costs in quality, with 95% intervals",
        f"flyspec serve{common} --verifier fly   # OpenAI-compatible API on http://127.0.0.1:8000/v1",
    ]
