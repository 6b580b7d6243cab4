"""A calibration's report: ``report.md`` (the choice, the frontier, what cost meaning) and ``frontier.png``.

The plot has two panels sharing the x axis, the share of outputs whose meaning changed (with its
one-sided bound as an error bar): τ gain over the lossless baseline (left) and projected speedup
over plain decoding (right). One line per family (a rule with all else fixed, strict to loose),
filled markers for points inside the budget, hollow for the others; the budget is a dashed
vertical line and the chosen point a star.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from flyspec.calibration.frontier import rank_families
from flyspec.calibration.schedule import schedule_lines

REPORT_FILE = "report.md"
PLOT_FILE = "frontier.png"
EXAMPLES = 8  # meaning changes shown in the report


def _pct(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{100 * value:.{digits}f} %"


def _num(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def frontier_table(frontier: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| point | status | n | τ | τ gain | loose / 100 tok | meaning changed (bound) | loops (bound) "
        "| retention (bound) | projected speedup |",
        "|---|---|---:|---:|---:|---:|---|---|---|---:|",
    ]
    for s in frontier:
        changed, loop, retention = s["meaning_changed"], s["loop"], s["retention"]
        lines.append(
            f"| {s['name']} | {s['status']} | {s['n']} | {_num(s['tau'])} | {_pct(s['tau_gain'])} "
            f"| {_num(s['loose_per_100_tokens'])} | {changed['count']} ({_pct(changed['high'], 2)}) "
            f"| {loop['count']} ({_pct(loop['high'], 2)}) "
            f"| {_num(retention['value'], 3)} ({_num(retention['low'], 3)}) | {_num(s['projected_speedup'])}x |"
        )
    return lines


def sampling_table(frontier: list[dict[str, Any]]) -> list[str]:
    """Sampled: each lossy point's quality per sampling measured (each judged on its own); nothing when greedy."""
    rows = [s for s in frontier if s.get("by_sampling") and not s["lossless"] and s["n"]]
    if not rows:
        return []
    lines = [
        "## Per sampling",
        "",
        "Each sampling is judged on its own (a point is inside only where it is inside at every one). n = outputs "
        "(prompts × seeds); bounds at the effective size with prompts as clusters (in brackets: the size).",
        "",
        "| point | sampling | n | prompts | identical | meaning changed (bound) | loops (bound) | retention (bound) |",
        "|---|---|---:|---:|---:|---|---|---|",
    ]
    for s in rows:
        for label, group in s["by_sampling"].items():
            changed, loop, retention = group["meaning_changed"], group["loop"], group["retention"]
            size = changed.get("n_effective")
            lines.append(
                f"| {s['name']} | {label} | {group['n']} | {group['prompts']} | {group['identical']} "
                f"| {changed['count']} ({_pct(changed['high'], 2)}) [{_num(size, 0)}] "
                f"| {loop['count']} ({_pct(loop['high'], 2)}) "
                f"| {_num(retention['value'], 3)} ({_num(retention['low'], 3)}) |"
            )
    return [*lines, ""]


def _decoding(record: dict[str, Any]) -> str:
    """How the outputs were decoded: greedy, or the samplings measured and their seeds."""
    sampling = record.get("sampling") or {}
    measured = sampling.get("measured") or [{"temperature": 0.0}]
    labels = []
    for entry in measured:
        if entry["temperature"] < 1e-5:
            labels.append("greedy")
            continue
        filters = f", top-p {entry['top_p']:g}" * (entry.get("top_p", 1) < 1)
        filters += f", top-k {entry['top_k']}" * bool(entry.get("top_k"))
        labels.append(f"T {entry['temperature']:g}{filters}")
    seeds = sampling.get("seeds", 1)
    sampled = any(entry["temperature"] >= 1e-5 for entry in measured)
    tail = f" ({seeds} seeds per prompt at T > 0, against plain sampling's output of the same seed)" if sampled else ""
    return " and ".join(labels) + tail


def family_table(frontier: list[dict[str, Any]]) -> list[str]:
    """The families ranked by what they buy inside the budget, then at a fixed quality loss."""
    ranked = rank_families(frontier)
    if not ranked:
        return ["No lossy point ran."]
    loss = ranked[0]["fixed_loss"]
    lines = [
        f"| rank | family | points | best τ gain inside the budget | best τ gain, ≤ {loss:.0%} of meanings changed |",
        "|---:|---|---:|---|---|",
    ]
    for index, row in enumerate(ranked, 1):
        best = row["inside"]
        inside = (
            f"{_pct(best['tau_gain'])} ({best['name']}; {_num(best['loose_per_100_tokens'])} loose / 100 tok, "
            f"projected {_pct(best['projected_gain'])} against exact)"
            if best
            else "none"
        )
        at_loss = row["at_loss"]
        fixed = (
            f"{_pct(at_loss['tau_gain'])} ({at_loss['name']}, {_pct(at_loss['meaning_changed'])})"
            if at_loss
            else "none"
        )
        lines.append(f"| {index} | {row['family']} | {row['points']} | {inside} | {fixed} |")
    return lines


def _choice(record: dict[str, Any]) -> list[str]:
    chosen, baseline = record["chosen"], record["baseline"]
    budget = record["budget"]
    limits = (
        f"meaning changed ≤ {budget['max_meaning_change']:.1%}, loops ≤ {budget['max_loop']:.1%}, retention ≥ "
        f"{budget['min_retention']:.2f}, as one-sided {budget['confidence']:.0%} bounds"
    )
    lines = [f"**Budget**: {limits}.", ""]
    base = f"{baseline['name']} (τ {_num(baseline['tau'])}, projected {_num(baseline['projected_speedup'])}x)"
    if chosen is None:
        lines.append(
            f"**Choice: none.** No lossy point stayed inside the budget and beat the lossless {base} by at "
            "least 1 %: loose acceptance does not pay here. Use `exact`."
        )
    else:
        lines.append(
            f"**Choice: {chosen['name']}** — τ {_num(chosen['tau'])} ({_pct(chosen['tau_gain'])} over exact), "
            f"projected {_num(chosen['projected_speedup'])}x over plain decoding (lossless best: {base}); "
            f"meaning changed in {chosen['meaning_changed']['count']} of {chosen['n']} (bound "
            f"{_pct(chosen['meaning_changed']['high'], 2)}), loops {chosen['loop']['count']}, retention "
            f"{_num(chosen['retention']['value'], 3)} (bound {_num(chosen['retention']['low'], 3)}). Circuit breaker: "
            f"{chosen['speculation']['breaker']['max_loose_per_100']:g} loose accepts per 100 tokens."
        )
    lines += [
        "",
        "Best point per rule: "
        + ", ".join(f"{rule}: {p['name'] if p else 'none'}" for rule, p in record["by_rule"].items())
        + ".",
    ]
    if baseline["projected_speedup"] < 1:
        lines += [
            "",
            f"Even lossless speculation with this drafter is projected slower than plain decoding "
            f"({baseline['projected_speedup']:.2f}x): its drafts cost more than the forwards they save. "
            "Use plain decoding or a cheaper drafter on this machine.",
        ]
    if record["data"]["n"] < record["min_items"]:
        lines += [
            "",
            f"With {record['data']['n']} prompts no point can show a rate below the budget "
            f"(that needs {record['min_items']}): rerun with more.",
        ]
    return lines


def _what_cost_meaning(records: list[dict[str, Any]]) -> list[str]:
    """The loose accepts in outputs whose meaning changed: by source and kept/target token, with examples."""
    changed = [r for r in records if r.get("meaning_changed") and r["point"] != "plain"]
    loosened = [r for r in records if r["point"] != "plain" and r["stats"]["num_loose_accepts"]]
    share = sum(bool(r["meaning_changed"]) for r in loosened) / len(loosened) if loosened else 0.0
    summary = (
        f"Of the {len(loosened)} outputs (all points) that kept at least one loose accept, "
        f"{share:.0%} changed meaning: that is the price of a loose accept here, and a budget of a few in a "
        "hundred answers affords only as many loosened outputs."
    )
    if not changed:
        return [summary, "", "No output's meaning changed."]
    sources: Counter[str] = Counter()
    pairs: Counter[tuple[str, str]] = Counter()
    for record in changed:
        for loose in record["loose_accepts"][:1]:  # the first loose accept is where the output left plain's
            sources[loose.get("source") or "?"] += 1
            pairs[(repr(loose.get("draft_text")), repr(loose.get("target_text")))] += 1
    lines = [
        summary,
        "",
        f"{len(changed)} outputs changed meaning (all points). Their first loose accept — where each output "
        f"left plain decoding's — came from: "
        + ", ".join(f"{name} {count}" for name, count in sources.most_common())
        + ".",
        "",
        "Most frequent first loose accepts (kept instead of the target's choice): "
        + "; ".join(f"{kept} for {wanted} ({count})" for (kept, wanted), count in pairs.most_common(6))
        + ".",
        "",
        "| point | prompt | first loose accept | what changed |",
        "|---|---|---|---|",
    ]
    for record in changed[:EXAMPLES]:
        first = record["loose_accepts"][0] if record["loose_accepts"] else {}
        diff = record.get("meaning_diff", {})
        what = "; ".join(
            f"{key.replace('_', ' ')}: {', '.join(map(str, values))}" for key, values in diff.items() if values
        )
        kept = f"{first.get('draft_text')!r} for {first.get('target_text')!r} (evidence {_num(first.get('evidence'))})"
        lines.append(f"| {record['point']} | {record['item']} | {kept if first else '–'} | {what[:160]} |")
    return lines


def engine_line(engine: dict[str, Any]) -> str:
    """Where the points were decoded: flyspec's engine (one prompt at a time), or vLLM with its batch."""
    if engine.get("name") != "vllm":
        return "flyspec's own, one prompt at a time (points replayed from shared target forwards)"
    memory = (
        f"KV cache {engine['kv_cache_memory_bytes'] / 2**30:.2f} GiB"
        if engine.get("kv_cache_memory_bytes")
        else f"gpu_memory_utilization {engine.get('gpu_memory_utilization')}"
    )
    return (
        f"vLLM {engine.get('version')} with the flyspec-vllm plugin, waves of {engine.get('wave_size')} prompts, "
        f"up to {engine.get('largest_batch')} requests submitted together; tensor parallel "
        f"{engine.get('tensor_parallel_size')}, {memory}, {'eager' if engine.get('enforce_eager') else 'compiled'}; "
        f"{engine.get('counter_mismatches', 0)} of {engine.get('submissions')} submissions' replayed drafts differed "
        f"from vLLM's counters; {engine.get('draft_tokens_cut', 0)} baseline draft tokens cut past what the shadows "
        f"read, {engine.get('baselines_redecoded', 0)} baselines decoded again uncut"
    )


def write_report(record: dict[str, Any], records: list[dict[str, Any]], out_dir: Path) -> Path:
    machine = record["machine"]
    data = record["data"]
    cost = record["cost_model"]
    lines = [
        f"# Calibration: {record['model']['name']} ({record['dtype']}), drafter {record['drafter']['drafter']}",
        "",
        f"- **Date**: {record['created']}; flyspec {record['flyspec_version']}",
        f"- **Machine**: {machine['cpu']} ({machine['isa']}), {machine['cores']} cores, {machine['threads']} threads",
        f"- **Data**: {data['sources']} ({', '.join(data['tasks'])}), {data['n']} prompts",
        f"- **Decoding**: {_decoding(record)}",
        f"- **Command**: `{record['command']}`" if record.get("command") else "- **Command**: the Python API",
        f"- **Engine**: {engine_line(record.get('engine') or {})}",
        f"- **Cost model** (projection): t(1) = {cost['t1_ms']:.1f} ms, t(16)/t(1) = "
        f"{cost['t_relative'].get('16', float('nan')):.2f}, drafter {cost['draft_ms_per_token']:.2f} ms "
        f"per draft token ({cost['draft_relative_to_t1']:.2f} t(1))"
        + (
            " (fitted on vLLM, one prompt at a time: t(n) linear in n, the proposer included)"
            if (record.get("engine") or {}).get("name") == "vllm"
            else ""
        ),
        "",
        *_choice(record),
        "",
        "## Families ranked",
        "",
        "Each family's best τ gain inside the budget (the points whose bounds fit), and its best τ gain among the "
        "points whose measured share of changed meanings is at most 5 %: what the rule buys per unit of quality. "
        "A τ gain with no loose accepts comes from the draft length, not the rule (FLy drafts at least W + 1 "
        "tokens, so its cost-aware length differs from exact's): the projected gain says whether it pays.",
        "",
        *family_table(record["frontier"]),
        "",
        "## Frontier",
        "",
        "τ = tokens per target forward; τ gain against `exact` on the same prompts; bounds one-sided "
        f"{record['budget']['confidence']:.0%} (Wilson for rates, paired bootstrap for retention). Status: "
        "`inside`/`outside` the budget after every prompt; `outside` early = surely above the budget, the "
        "run stopped; `pruned` = looser than a point of its family that was surely outside.",
        "",
        *frontier_table(record["frontier"]),
        "",
        *sampling_table(record["frontier"]),
        "## What cost meaning",
        "",
        *_what_cost_meaning(records),
        "",
        *schedule_lines(record.get("schedule")),
        "## Live check",
        "",
        "Replayed outputs against a live run (no replay) on the first prompts: "
        + ", ".join(f"{name} {c['identical']}/{c['checked']} identical" for name, c in record["live_check"].items())
        + ".",
        "",
        f"![frontier]({PLOT_FILE})",
        "",
    ]
    path = out_dir / REPORT_FILE
    path.write_text("\n".join(lines))
    return path


def plot_frontier(record: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frontier = [s for s in record["frontier"] if not s["lossless"] and s["n"]]
    families: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for summary in frontier:
        families[summary["family"]].append(summary)
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 5), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (family, members) in enumerate(sorted(families.items())):
        members.sort(key=lambda s: s["order"])
        color = colors[index % len(colors)]
        for axes, key, scale in ((left, "tau_gain", 100.0), (right, "projected_speedup", 1.0)):
            xs = [100 * (s["meaning_changed"]["rate"] or 0) for s in members]
            ys = [scale * (s[key] or 0) for s in members]
            axes.plot(xs, ys, "-", color=color, alpha=0.5, label=family if axes is left else None)
            for s, x, y in zip(members, xs, ys, strict=True):
                high = 100 * s["meaning_changed"]["high"]
                inside = s["status"] == "inside"
                axes.errorbar(
                    [x], [y], xerr=[[x - 100 * s["meaning_changed"]["low"]], [high - x]], fmt="o", color=color,
                    mfc=color if inside else "white", ms=6, capsize=2, alpha=0.9,
                )  # fmt: skip
    budget = 100 * record["budget"]["max_meaning_change"]
    chosen = record["chosen"]
    baseline = record["baseline"]
    for axes, key, scale, label in (
        (left, "tau_gain", 100.0, "τ gain over exact (%)"),
        (right, "projected_speedup", 1.0, "projected speedup over plain (x)"),
    ):
        axes.axvline(budget, linestyle="--", color="gray", label="budget" if axes is left else None)
        if chosen is not None:
            x, y = 100 * chosen["meaning_changed"]["rate"], scale * (chosen[key] or 0)
            axes.plot([x], [y], "*", color="black", ms=16, label="chosen" if axes is left else None)
        if key == "projected_speedup" and baseline is not None:
            axes.axhline(baseline["projected_speedup"], color="black", linewidth=0.8, label=None)
            axes.annotate(f"lossless best {baseline['projected_speedup']:.2f}x", (0, baseline["projected_speedup"]),
                          fontsize=8, va="bottom")  # fmt: skip
        axes.set_xscale("symlog", linthresh=1.0)  # linear up to 1 %, where budgets sit; logarithmic beyond
        axes.set_xlim(left=-0.1)
        axes.set_xlabel("meaning changed (% of outputs, linear to 1 % then log; bar: one-sided bounds)")
        axes.set_ylabel(label)
        axes.grid(alpha=0.3)
    left.legend(fontsize=7, loc="best")
    title = (
        f"{record['model']['name']} {record['dtype']}, drafter {record['drafter']['drafter']}, n={record['data']['n']}"
    )
    figure.suptitle(f"Quality-budget frontier: {title} (filled: inside the budget)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
