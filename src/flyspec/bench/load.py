"""``flyspec bench --concurrency 1,2,4,...``: throughput against batch size on vLLM, and a batch schedule from it.

Speculation spends compute a lone request leaves idle, and a batch uses that compute up. This measures
where it stops paying. Each vLLM method is one engine (``flyspec_vllm.worker``), started once; at
concurrency ``c`` the first ``c·⌈min_prompts / c⌉`` prompts (first turns, categories interleaved) are
submitted in waves of ``c`` (one ``LLM.generate`` each, so a wave ends with its slowest request), and the
figure is total new tokens ÷ total time. At each concurrency every method runs before the next
concurrency starts, so drift on a shared machine hits them alike.

``--derive-schedule`` first sweeps draft lengths on flyspec's proposer (the first ``vllm-flyspec-ngram`` /
``vllm-ngram+fly*`` method): at each concurrency, at most ``k`` drafts per request for every ``k`` in
``draft_lengths`` (0: none), on the same engine. :func:`flyspec.config.schedule.derive_schedule` turns the
sweep into a batch-size schedule (schedule.json, vLLM's ``num_speculative_tokens_per_batch_size``), and every
flyspec-proposer method then also runs with it (``<method> scheduled``). ``--schedule FILE`` runs a given one.
The verdict compares each scheduled method with ``max(vllm-plain, vllm-ngram)`` of the same run, round by round
(:func:`verdicts`); with ``vllm-plain-colocated`` among the methods, the plain peer is a plain engine in the
scheduled method's own process (same memory, threads and start-up), so that only speculation separates them.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flyspec.config import ConfigError
from flyspec.config.schedule import DEFAULT_MARGIN, BatchSchedule, derive_schedule
from flyspec.harness.vllm_worker import ColocatedPlain, VllmOptions, VllmWorker

DEFAULT_CONCURRENCIES = (1, 2, 4, 8, 16, 32)
DEFAULT_DRAFT_LENGTHS = (0, 2, 4, 8, 15)
DEFAULT_METHODS = ("vllm-plain", "vllm-ngram", "vllm-ngram+fly")
FLYSPEC_PROPOSER = ("vllm-flyspec-ngram", "vllm-ngram+fly", "vllm-ngram+fly+bare")
# a control: a second vllm-plain engine in a process of its own; how far it lands from the first is the spread that
# separate processes alone put between the methods' figures (benchmarks/2026-11-26-load: up to 8 % on a 2-core VM)
TWIN = "vllm-plain-twin"
# a plain engine in the process of the first flyspec-proposer method's engine (the scheduled method's): the plain
# peer of the verdict when present, so that the goal is judged without the spread between processes
COLOCATED = "vllm-plain-colocated"
LOAD_METHODS = ("vllm-plain", "vllm-ngram", *FLYSPEC_PROPOSER, TWIN, COLOCATED)
SCHEDULED = " scheduled"
PEERS = ("vllm-plain", "vllm-ngram")  # what a scheduled method is held against: vLLM without flyspec
Engine = VllmWorker | ColocatedPlain  # what a method's figures come from
FAIR_SHARE = 0.97  # the goal: a scheduled method keeps at least this share of the best non-flyspec method


def engine_method(name: str) -> str:
    """The worker method behind a load method's name (the twin control is a plain engine)."""
    return "vllm-plain" if name == TWIN else name


def parse_concurrencies(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` → (1, 2, 4); a clear error for anything else."""
    try:
        values = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise ConfigError(f"--concurrency {text!r}: give batch sizes such as 1,2,4,8,16,32") from None
    if not values or values[0] < 1:
        raise ConfigError(f"--concurrency {text!r}: give batch sizes >= 1 such as 1,2,4,8,16,32")
    return values


def check_methods(names: Sequence[str], derive: bool, schedule: BatchSchedule | None) -> None:
    unknown = [name for name in names if name not in LOAD_METHODS]
    if unknown:
        raise ConfigError(
            f"--concurrency measures vLLM engines ({', '.join(LOAD_METHODS)}), not {', '.join(unknown)}; flyspec's "
            "own engine decodes one request at a time (flyspec serve runs one decoder per request)"
        )
    if (derive or schedule is not None) and not any(name in FLYSPEC_PROPOSER for name in names):
        raise ConfigError(
            "--derive-schedule / --schedule need a method with flyspec's proposer: " + ", ".join(FLYSPEC_PROPOSER)
        )
    if COLOCATED in names and not any(name in FLYSPEC_PROPOSER for name in names):
        raise ConfigError(
            f"{COLOCATED} is a plain engine in the process of a flyspec-proposer method's engine: add one of "
            + ", ".join(FLYSPEC_PROPOSER)
        )


@dataclass(frozen=True)
class LoadSettings:
    concurrencies: tuple[int, ...] = DEFAULT_CONCURRENCIES
    max_new_tokens: int = 96
    min_prompts: int = 8  # prompts per point at least (a lone request's figure is not one prompt's)
    num_draft_tokens: int = 15  # each speculative engine's k (the sweep's largest)
    draft_lengths: tuple[int, ...] = DEFAULT_DRAFT_LENGTHS
    derive: bool = False
    schedule: BatchSchedule | None = None
    margin: float = DEFAULT_MARGIN
    repeats: int = 1  # each point this many times, the median run kept (this VM's runs of one point differ by ~10 %)

    def prompts_at(self, concurrency: int) -> int:
        return concurrency * math.ceil(self.min_prompts / concurrency)


@dataclass
class LoadRun:
    """Everything measured: one row per (method, concurrency), the sweep's rows, the schedule."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    sweep: list[dict[str, Any]] = field(default_factory=list)
    schedule: BatchSchedule | None = None
    startup_s: dict[str, float] = field(default_factory=dict)


def measure(worker: Engine, prompts: list[list[int]], concurrency: int, max_tokens: int, **call: Any) -> dict:
    """One point: ``prompts`` in waves of ``concurrency``; totals over the waves (``call``: the worker's draft cap)."""
    tokens = seconds = drafts = accepted = 0.0
    for start in range(0, len(prompts), concurrency):
        reply = worker.request({"prompts": prompts[start : start + concurrency], "max_tokens": max_tokens, **call})
        tokens += sum(len(ids) for ids in reply["outputs"])
        seconds += reply["seconds"]
        drafts += reply.get("draft_tokens", 0)
        accepted += reply.get("accepted", 0)
    return {
        "concurrency": concurrency,
        "num_prompts": len(prompts),
        "num_new_tokens": int(tokens),
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "draft_tokens": int(drafts),
        "accepted": int(accepted),
        "tau": tokens / (tokens - accepted) if tokens > accepted else None,  # each request-step commits accepted + 1
    }


def interleaved(
    calls: Mapping[str, tuple[Engine, dict[str, Any]]], prompts: list[list[int]], concurrency: int,
    settings: LoadSettings,
) -> dict[str, dict]:  # fmt: skip
    """Every call (label → worker and its draft cap) measured ``settings.repeats`` times, round-robin (a drift of
    the machine's speed during the point hits every call alike); per call the run with the median tokens/s, and
    every run's figure.

    First, untimed, every engine decodes one token of each of the point's prompts: vLLM caches prompt prefixes,
    and an engine meeting a prompt for the first time would pay its prefill in the first round only, where an
    engine that shares its process with an earlier call (a scheduled method) would not. Each engine warms with its
    first call's request settings (``extra_args``: a rule), so its requests look like the timed ones."""
    firsts: dict[int, tuple[Engine, dict[str, Any]]] = {}
    for worker, call in calls.values():
        firsts.setdefault(id(worker), (worker, call))
    for worker, call in firsts.values():
        measure(worker, prompts, concurrency, 1, **{key: call[key] for key in ("extra_args",) if key in call})
    runs: dict[str, list[dict]] = {label: [] for label in calls}
    for _ in range(settings.repeats):
        for label, (worker, call) in calls.items():
            runs[label].append(measure(worker, prompts, concurrency, settings.max_new_tokens, **call))
    medians = {}
    for label, rows in runs.items():
        figures = [row["tokens_per_s"] for row in rows]
        rows = sorted(rows, key=lambda row: row["tokens_per_s"])
        medians[label] = {**rows[len(rows) // 2], "tokens_per_s_runs": figures}
    return medians


def sweep(
    worker: Engine,
    prompts: list[list[int]],
    settings: LoadSettings,
    extra_args: dict[str, Any] | None = None,
    on_row: Callable[[str], None] = lambda line: None,
) -> tuple[list[dict[str, Any]], BatchSchedule]:
    """On one engine with flyspec's proposer: throughput at every concurrency with at most k drafts per request, for
    every k of ``settings.draft_lengths`` (0: none), and the schedule derived from it. ``extra_args``: every
    request's ``SamplingParams.extra_args`` (its rule: ``flyspec calibrate --derive-schedule`` sweeps its choice)."""
    rows: list[dict[str, Any]] = []
    rule = {"extra_args": extra_args} if extra_args else {}
    for concurrency in settings.concurrencies:
        batch = prompts[: settings.prompts_at(concurrency)]
        calls = {str(k): (worker, {"num_draft_tokens": k, **rule}) for k in settings.draft_lengths}
        for k, median in interleaved(calls, batch, concurrency, settings).items():
            rows.append({"method": worker.method, "k": int(k), **median})
            on_row(f"sweep {worker.method} k={k} at {concurrency}: {median['tokens_per_s']:.1f} tok/s")
    throughput: dict[int, dict[int, float]] = {}
    for row in rows:
        throughput.setdefault(row["k"], {})[row["concurrency"]] = row["tokens_per_s"]
    schedule = derive_schedule(throughput, settings.margin)
    on_row(f"schedule: {schedule.describe()}")
    return rows, schedule


def run_load(
    workers: dict[str, Engine],
    prompts: list[list[int]],
    settings: LoadSettings,
    on_row: Callable[[str], None] = lambda line: None,
) -> LoadRun:
    """The sweep (if deriving), then every method and every scheduled method at every concurrency."""
    run = LoadRun(schedule=settings.schedule)
    for worker in workers.values():
        worker.request({"prompts": prompts[:1], "max_tokens": 8})  # warm-up
    scheduled = [name for name in workers if name in FLYSPEC_PROPOSER]
    if settings.derive:
        run.sweep, run.schedule = sweep(workers[scheduled[0]], prompts, settings, on_row=on_row)
    for concurrency in settings.concurrencies:
        batch = prompts[: settings.prompts_at(concurrency)]
        calls: dict[str, tuple[Engine, dict[str, Any]]] = {name: (worker, {}) for name, worker in workers.items()}
        if run.schedule is not None:
            calls |= {name + SCHEDULED: (workers[name], {"schedule": run.schedule.to_vllm()}) for name in scheduled}
        for label, median in interleaved(calls, batch, concurrency, settings).items():
            run.rows.append({"method": label, **median})
            on_row(f"{label} at {concurrency}: {median['tokens_per_s']:.1f} tok/s")
    return run


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency and scheduled method: its share of ``max(vllm-plain, vllm-ngram)`` and of vllm-plain.

    With repeats, the goal is judged **paired**: in each round (every method ran once, back to back) the scheduled
    method's tokens/s over the best peer's of that round, and the median of those shares. A drift of this shared
    machine's speed moves a round's methods together, so it cancels in a round's ratio; a ratio of the methods'
    separate medians (``share_of_best``) mixes rounds and keeps that drift. One run per point: the two are equal."""
    table = {(row["method"], row["concurrency"]): row for row in rows}
    result = []
    for (method, concurrency), row in table.items():
        if not method.endswith(SCHEDULED):
            continue
        plain_peer = COLOCATED if (COLOCATED, concurrency) in table else "vllm-plain"
        names = (plain_peer if name == "vllm-plain" else name for name in PEERS)
        peers = {name: table[name, concurrency] for name in names if (name, concurrency) in table}
        if not peers:
            continue
        best = max(peer["tokens_per_s"] for peer in peers.values())
        shares = round_shares(row, list(peers.values()))
        plain = peers.get(plain_peer)
        paired = statistics.median(shares)
        twin, separate = table.get((TWIN, concurrency)), table.get(("vllm-plain", concurrency))
        control = statistics.median(round_shares(twin, [separate])) if twin and separate else None
        result.append(
            {
                "method": method,
                "concurrency": concurrency,
                "plain_peer": plain_peer,
                "share_of_best": row["tokens_per_s"] / best,
                "over_plain": row["tokens_per_s"] / plain["tokens_per_s"] if plain else None,
                "paired_share": paired,
                "round_shares": shares,
                "over_plain_paired": statistics.median(round_shares(row, [plain])) if plain else None,
                "meets_goal": paired >= FAIR_SHARE,
                # the twin's paired share of plain: 1 but for the spread between processes
                "control_share": control,
                # the spread between processes excuses a miss against a peer in another process only
                "inside_spread": plain_peer != COLOCATED
                and control is not None
                and paired >= FAIR_SHARE - abs(1 - control),
            }
        )
    return result


def round_shares(row: dict[str, Any], peers: list[dict[str, Any]]) -> list[float]:
    """Round by round, ``row``'s tokens/s over the best of ``peers`` in the same round (one round per run kept in
    ``tokens_per_s_runs``; rows without per-run figures count as one round of their median)."""
    runs = [r.get("tokens_per_s_runs") or [r["tokens_per_s"]] for r in (row, *peers)]
    rounds = min(len(figures) for figures in runs)
    return [runs[0][i] / max(figures[i] for figures in runs[1:]) for i in range(rounds)]


def start_workers(
    names: Sequence[str], python: Path, model_path: str, dtype: str, settings: LoadSettings, options: VllmOptions
) -> dict[str, Engine]:
    """One engine per method; all started before any is timed (their start-up reported separately). The colocated
    plain engine is started by the first flyspec-proposer method's worker, in its process."""
    workers: dict[str, Engine] = {}
    host = next((name for name in names if name in FLYSPEC_PROPOSER), None) if COLOCATED in names else None
    try:
        for name in names:
            if name != COLOCATED:
                method, k = engine_method(name), settings.num_draft_tokens
                worker = VllmWorker(python, model_path, method, dtype, k, options, colocated_plain=name == host)
                workers[name] = worker
                if name == host:
                    workers[COLOCATED] = ColocatedPlain(worker)
    except BaseException:
        close_workers(workers)
        raise
    return {name: workers[name] for name in names}


def close_workers(workers: dict[str, Engine]) -> None:
    for worker in workers.values():
        worker.close()


def load_report(meta: dict[str, Any], run: LoadRun) -> str:
    """report.md of a load run: the throughput table, the verdicts, the sweep and the schedule."""
    methods = list(dict.fromkeys(row["method"] for row in run.rows))
    concurrencies = sorted({row["concurrency"] for row in run.rows})
    table = {(row["method"], row["concurrency"]): row for row in run.rows}
    lines = [
        "# flyspec bench --concurrency: throughput against batch size on vLLM",
        "",
        f"- {meta['date']}; {meta['machine']} (CPU flags: {meta['cpu_isa']}); {meta['versions']}",
        f"- target {meta['target']}, {meta['dtype']}, vLLM {meta['vllm_version']}, "
        f"{'enforce_eager' if meta['eager'] else 'compiled'}; k = {meta['num_draft_tokens']}, "
        f"{meta['max_new_tokens']} new tokens, waves of c prompts (at least {meta['min_prompts']} per point), "
        f"median of {meta.get('repeats', 1)} run(s) per point",
        "- engine start-up (not in the figures): "
        + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in run.startup_s.items()),
        "",
        "Total tokens/s (τ in brackets where the method speculates):",
        "",
        "| method | " + " | ".join(f"c = {c}" for c in concurrencies) + " |",
        "|---|" + "---:|" * len(concurrencies),
    ]
    for method in methods:
        cells = []
        for concurrency in concurrencies:
            row = table.get((method, concurrency))
            tau = f" ({row['tau']:.2f})" if row and row["draft_tokens"] and row["tau"] else ""
            cells.append(f"{row['tokens_per_s']:.1f}{tau}" if row else "–")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    found = verdicts(run.rows)
    if found:
        goal = f"Goal: a scheduled method keeps ≥ {FAIR_SHARE:.0%} of max(vllm-plain, vllm-ngram) at every c"
        lines += ["", goal + ", judged on the median of the rounds' paired shares (each round ran every method once,"
                  " back to back).", ""]  # fmt: skip
        if any(verdict["plain_peer"] == COLOCATED for verdict in found):
            lines += [f"Plain peer: {COLOCATED}, a plain engine in the scheduled method's own process (the same "
                      "memory, threads and start-up), in place of vllm-plain, whose own process puts the spread "
                      "between processes into the comparison; vllm-plain stays in the table above.", ""]  # fmt: skip
        if any(verdict["control_share"] is not None for verdict in found):
            lines += [f"Control: {TWIN}, a second vllm-plain engine in a process of its own; its paired share of "
                      "vllm-plain would be 1 but for the spread between processes. A miss by less than that spread "
                      "is marked *inside the spread*: this run cannot tell it from no difference.", ""]  # fmt: skip
        plain_name = found[0]["plain_peer"]
        lines += [f"| method | c | share of the best, paired (rounds: min–max) | over {plain_name}, paired | "
                  "medians' ratio | control: twin / plain | goal |", "|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
        for verdict in found:
            plain, control = verdict["over_plain_paired"], verdict["control_share"]
            shares = verdict["round_shares"]
            goal = "met" if verdict["meets_goal"] else "MISSED" + (" (inside the spread)" * verdict["inside_spread"])
            lines.append(
                f"| {verdict['method']} | {verdict['concurrency']} | {verdict['paired_share']:.3f} "
                f"({min(shares):.2f}–{max(shares):.2f}) | {'–' if plain is None else f'{plain:.3f}x'} "
                f"| {verdict['share_of_best']:.3f} | {'–' if control is None else f'{control:.3f}'} | {goal} |"
            )
    if run.sweep:
        ks = sorted({row["k"] for row in run.sweep})
        lines += ["", f"Draft-length sweep on {run.sweep[0]['method']} (tokens/s; k = 0: no drafts):", ""]
        lines += ["| c | " + " | ".join(f"k = {k}" for k in ks) + " |", "|---:|" + "---:|" * len(ks)]
        sweep = {(row["concurrency"], row["k"]): row["tokens_per_s"] for row in run.sweep}
        for concurrency in sorted({row["concurrency"] for row in run.sweep}):
            lines.append(f"| {concurrency} | " + " | ".join(f"{sweep.get((concurrency, k), 0):.1f}" for k in ks) + " |")
    if run.schedule is not None:
        origin = "derived from the sweep above" if run.sweep else "given with --schedule, not derived in this run"
        lines += ["", f"Schedule ({run.schedule.describe()}; {origin}), as vLLM's speculative_config key:", "",
                  f"    \"num_speculative_tokens_per_batch_size\": {json.dumps(run.schedule.to_vllm())}"]  # fmt: skip
    return "\n".join(lines) + "\n"


def write_outputs(out_dir: Path, meta: dict[str, Any], run: LoadRun, plots: bool) -> list[Path]:
    """load.json, report.md, schedule.json (when this run derived one: a schedule given with ``--schedule`` was
    measured elsewhere, and a copy stamped with this run's machine and dtype would misstate that) and throughput.png."""
    written = [out_dir / "load.json", out_dir / "report.md"]
    payload = {"meta": meta, "rows": run.rows, "sweep": run.sweep, "verdicts": verdicts(run.rows),
               "schedule": run.schedule.to_vllm() if run.schedule else None, "startup_s": run.startup_s}  # fmt: skip
    written[0].write_text(json.dumps(payload, indent=1), encoding="utf-8")
    written[1].write_text(load_report(meta, run), encoding="utf-8")
    if run.schedule is not None and run.sweep:
        measured = {key: meta[key] for key in ("date", "machine", "cpu_isa", "target", "dtype", "vllm_version")}
        written.append(run.schedule.save(out_dir / "schedule.json", measured, run.sweep[0]["method"]))
    if plots and run.rows:
        written.append(plot(out_dir / "throughput.png", meta, run.rows))
    return written


def plot(path: Path, meta: dict[str, Any], rows: list[dict[str, Any]]) -> Path:
    import matplotlib  # heavy; only when writing plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.5, 4.2))
    for method in dict.fromkeys(row["method"] for row in rows):
        points = sorted((row["concurrency"], row["tokens_per_s"]) for row in rows if row["method"] == method)
        axes.plot([c for c, _ in points], [rate for _, rate in points], marker="o", label=method,
                  linestyle="--" if method.endswith(SCHEDULED) else "-")  # fmt: skip
    axes.set_xscale("log", base=2)
    axes.set_xlabel("concurrency (requests decoded together)")
    axes.set_ylabel("total tokens/s")
    title = f"{Path(meta['target']).name}, {meta['dtype']}, {meta['cpu_isa']}, vLLM {meta['vllm_version']}"
    axes.set_title(title, fontsize=9)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
