"""Summary → ``summary.json``, ``report.md``, ``diffs.md`` and two PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flyspec.eval.records import iter_pairs

FLOOR_NOTE = "baseline too low for a meaningful ratio"


def _num(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _retention_cell(entry: dict[str, Any]) -> str:
    if entry["below_floor"]:
        return f"n/a ({FLOOR_NOTE})"
    if entry["low"] is None:
        return f"{entry['retention']:.3f} (CI n/a)"
    return f"{entry['retention']:.3f} [{entry['low']:.3f}, {entry['high']:.3f}]"


def score_table(summary: dict[str, Any]) -> list[str]:
    lines = [
        "| task | metric | n | plain | method | score | retention [95% CI] |",
        "|---|---|---:|---:|---|---:|---|",
    ]
    for task, entry in summary["tasks"].items():
        for metric in entry["metrics"]:
            for method, result in entry["methods"].items():
                score = result["scores"][metric]
                cell = _retention_cell(score)
                if "refusals_kept" in score:  # the safety task: paired, and what the rate means
                    kept = score["refusals_kept"]
                    cell += f"; refusals kept {kept['kept']} of {kept['plain_refused']} plain refused"
                    kinds = kept.get("by_kind", {})
                    if len(kinds) > 1:  # harmful requests and injections
                        parts = [f"{kind} {count['kept']} of {count['plain_refused']}" for kind, count in kinds.items()]
                        cell += f" ({', '.join(parts)})"
                lines.append(
                    f"| {task} | {metric} | {score['num_items']} | {_num(score['baseline_score'])} | {method} | "
                    f"{_num(score['method_score'])} | {cell} |"
                )
    return lines


def _method_rows(summary: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """``(task, method, result)`` for every task × method, then the all-tasks rows."""
    rows = [
        (task, method, result)
        for task, entry in summary["tasks"].items()
        for method, result in entry["methods"].items()
    ]
    return rows + [("**all tasks**", method, result) for method, result in summary.get("all_tasks", {}).items()]


def fidelity_table(summary: dict[str, Any]) -> list[str]:
    rows = _method_rows(summary)
    lines = [
        "| task | method | n | identical | MiniLM similarity | token agreement | log-lik (method / plain) "
        "| tok/s (method / plain) | speedup [95% CI] | τ | loose / 100 tok |",
        "|---|---|---:|---:|---:|---:|---|---|---:|---:|---:|",
    ]
    for task, method, result in rows:
        fid, speed = result["fidelity"], result["speed"]
        lines.append(
            f"| {task} | {method} | {result['num_items']} | {fid['identical']:.2f} | {_num(fid['similarity'])} | "
            f"{_num(fid['token_agreement'])} | {_num(fid['log_likelihood'])} / "
            f"{_num(fid['plain_log_likelihood'])} | {speed['tokens_per_s']:.2f} / "
            f"{speed['plain_tokens_per_s']:.2f} | {_num(speed['speedup'], 2)}{_interval(speed.get('speedup_ci'))} | "
            f"{_num(speed['mean_acceptance_length'], 2)} | {speed['loose_accepts_per_100_tokens']:.1f} |"
        )
    return lines


def _rate_cell(entry: dict[str, Any] | None) -> str:
    """``0.120 [0.081, 0.173]``; a dash for records made before the trust metrics existed."""
    if not entry or entry["rate"] is None:
        return "–"
    return f"{entry['rate']:.3f} [{entry['low']:.3f}, {entry['high']:.3f}]"


def trust_table(summary: dict[str, Any]) -> list[str]:
    rows = _method_rows(summary)
    lines = [
        "| task | method | n | meaning changed [95% CI] | changed | new loop [95% CI] | loops |",
        "|---|---|---:|---|---:|---|---:|",
    ]
    for task, method, result in rows:
        trust = result.get("trust", {})
        changed, loop = trust.get("meaning_changed"), trust.get("loop")
        lines.append(
            f"| {task} | {method} | {result['num_items']} | {_rate_cell(changed)} | "
            f"{changed['count'] if changed else '–'} | {_rate_cell(loop)} | {loop['count'] if loop else '–'} |"
        )
    return lines


def guard_table(summary: dict[str, Any]) -> list[str]:
    if not summary["guard"]:
        return ["(no guarded method was run beside its unguarded verifier)"]
    lines = [
        "| task | method vs | retention (method / vs) | similarity (method / vs) "
        "| meaning changed (method / vs) | speedup (method / vs) "
        "| loose / 100 tok (method / vs) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in summary["guard"]:
        retention = (
            f"{_num(row.get('retention'))} / {_num(row.get('versus_retention'))}" if row["metric"] else "no metric"
        )
        lines.append(
            f"| {row['task']} | {row['method']} vs {row['versus']} | {retention} | "
            f"{_num(row['similarity'])} / {_num(row['versus_similarity'])} | "
            f"{_num(row.get('meaning_changed'))} / {_num(row.get('versus_meaning_changed'))} | "
            f"{_num(row['speedup'], 2)} / {_num(row['versus_speedup'], 2)} | "
            f"{row['loose_per_100']:.1f} / {row['versus_loose_per_100']:.1f} |"
        )
    return lines


def sampling_note(sampling: dict[str, Any] | None) -> str:
    """How the outputs were decoded, and what "plain decoding's output" means then."""
    if not sampling or sampling["temperature"] < 1e-5:
        return "Decoding: greedy; every output is compared with plain greedy decoding's."
    filters = f", top-p {sampling['top_p']:g}" * (sampling["top_p"] < 1) + f", top-k {sampling['top_k']}" * (
        sampling["top_k"] > 0
    )
    return (
        f"Decoding: sampled at temperature {sampling['temperature']:g}{filters}, {sampling['seeds']} seed(s) per "
        "prompt; every output is compared with plain sampling's of the same seed (coupled sampling: a lossless "
        "method's output is plain's, token for token). n counts prompts; rates are judged at their effective size "
        "with prompts as clusters, and retention resamples prompts (each the mean of its seeds)."
    )


def markdown_report(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = ["# flyspec eval report", ""]
    lines += [f"- {key}: {value}" for key, value in meta.items() if not isinstance(value, dict | list)]
    if meta.get("earlier commands"):
        lines.append("- resumed from: " + "; ".join(f"`{command}`" for command in meta["earlier commands"]))
    lines += ["", sampling_note(meta.get("sampling"))]
    lines += [
        "",
        "Retention = method score ÷ plain decoding's score on the same items; 95% paired bootstrap "
        f"interval ({summary['resamples']} resamples). Below a plain score of {summary['floor']} no ratio is "
        f"given ({FLOOR_NOTE}). Scores are in [0, 1].",
        "",
        "## Task scores and retention",
        "",
        *score_table(summary),
        "",
        "## Fidelity to plain decoding and speed (same run)",
        "",
        *fidelity_table(summary),
        "",
        "## Trust: meaning changes and new loops against plain decoding",
        "",
        "Meaning changed: the output's numbers (as a multiset, `1,000` = `1000`) or identifiers (code-like "
        "words, backticked code, and the prompt's names it repeats) differ from plain decoding's. New loop: "
        "the output repeats a token 8-gram 3 times or more that plain decoding's output has at most once. Wilson 95% "
        "intervals. Definitions: `flyspec/eval/trust.py`.",
        "",
        *trust_table(summary),
        "",
        "## Guard variants against their verifier",
        "",
        "Each row: a verifier with a modifier against the same verifier without it. The default lossy "
        "verifiers run with the trust guards, so `+bare` (the papers' rule, no guards) is the unguarded "
        "side of its row and `+digits`/`+names`/`+identifiers`/`+guard` change what the guards protect.",
        "",
        *guard_table(summary),
        "",
    ]
    return "\n".join(lines)


def _render_segments(segments: list[list[Any]]) -> str:
    return "".join(f"⟦{text}⟧" if loose else text for text, loose in segments)


def diffs_report(records: list[dict[str, Any]], per_task: int = 5) -> str:
    """Side by side where a method's output differs from plain decoding's; loose accepts in ⟦…⟧."""
    lines = [
        "# Outputs that differ from plain decoding",
        "",
        f"Loosely accepted tokens are marked ⟦like this⟧. At most {per_task} differing items per task and method.",
        "",
    ]
    shown: dict[tuple[str, str], int] = {}
    for plain, record in iter_pairs(records):
        key = (record["task"], record["method"])
        if record["fidelity"]["identical"] or shown.get(key, 0) >= per_task:
            continue
        shown[key] = shown.get(key, 0) + 1
        rendered = _render_segments(record.get("segments", [[record["text"], False]]))
        lines += [
            f"## {record['task']} · {record['item_id']} · {record['method']}",
            "",
            f"scores: plain {plain['scores']} · {record['method']} {record['scores']}",
            "",
            *_trust_notes(record["fidelity"]),
            "| plain | " + record["method"] + " |",
            "|---|---|",
            f"| {_cell(plain['text'])} | {_cell(rendered)} |",
            "",
        ]
    if not shown:
        lines.append("Every method output equals plain decoding's.")
    return "\n".join(lines)


def _trust_notes(fidelity: dict[str, Any]) -> list[str]:
    """What the trust metrics found, one line each (nothing when both are clean)."""
    notes = []
    if fidelity.get("meaning_changed"):
        diff = fidelity["meaning_diff"]
        parts = [
            f"{label} {', '.join(f'`{value}`' for value in diff[key])}"
            for key, label in (
                ("numbers_added", "numbers added"),
                ("numbers_removed", "numbers dropped"),
                ("identifiers_added", "identifiers added"),
                ("identifiers_removed", "identifiers dropped"),
            )
            if diff[key]
        ]
        notes += ["meaning changed: " + "; ".join(parts), ""]
    if fidelity.get("loop"):
        notes += [f"new loop: {fidelity['loop_text']!r} repeated", ""]
    return notes


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", "<br>") or "(empty)"


def write_reports(out_dir: Path, summary: dict[str, Any], records: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    from flyspec.eval.plots import plot_retention, plot_speed_vs_retention  # matplotlib

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps({"meta": meta, **summary}, indent=2, ensure_ascii=False))
    (out_dir / "report.md").write_text(markdown_report(summary, meta), encoding="utf-8")
    (out_dir / "diffs.md").write_text(diffs_report(records), encoding="utf-8")
    plot_retention(summary, out_dir / "retention.png")
    plot_speed_vs_retention(summary, out_dir / "speed_vs_retention.png")


def _interval(bounds: list[float] | tuple[float, float] | None) -> str:
    return f" [{bounds[0]:.2f}, {bounds[1]:.2f}]" if bounds else ""
