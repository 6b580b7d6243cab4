"""Benchmark outputs: a JSON file of everything, a Markdown report, and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flyspec.bench.summary import OVERALL
from flyspec.harness.methods import PLAIN

LOSSY_NOTE = "lossy: output may differ from plain decoding"
SUSPECT = "sampler suspect"
# the bench's orders (``--order``, bench/loop.py: run_order) and how the report names them
ORDER_NOTES = {
    "interleaved": "methods interleaved per prompt",
    "blocks": "methods in blocks (each on the first half of the prompts, then each on the second half in reverse "
    "order)",
}
ORDERS = tuple(ORDER_NOTES)


def write_json(path: Path, meta: dict[str, Any], summary: dict[str, Any], records: list[dict]) -> None:
    payload = {"meta": meta, "summary": summary, "records": records}
    path.write_text(json.dumps(payload, indent=1, ensure_ascii=False))


def _fmt(value: float | None, pattern: str = "{:.2f}") -> str:
    return "–" if value is None else pattern.format(value)


def overall_table(overall: dict[str, dict]) -> list[str]:
    lines = [
        "| method | lossless | tok/s | TTFT median / p90 ms | speedup (min–max) | τ | drafts verified per step "
        "| τ-limit | % of τ-limit | cost limit | % of cost limit | in-run limit | % of in-run limit | identical "
        "| loose accepts | target / draft / other ms per step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, figures in overall.items():
        spread = ""
        if figures["speedup_min"] is not None and len(figures["speedup_per_repeat"]) > 1:
            spread = f" ({figures['speedup_min']:.2f}–{figures['speedup_max']:.2f})"
        own = figures.get("speedup_vs_own_plain")
        own_note = f"; {own:.2f}x vs its own plain" if own is not None else ""
        steps = (figures["target_ms_per_step"], figures["draft_ms_per_step"], figures["other_ms_per_step"])
        ttft = (figures.get("ttft_median_s"), figures.get("ttft_p90_s"))
        lines.append(
            f"| {method} | {'yes' if figures['lossless'] else 'no'} | {figures['tokens_per_s']:.1f} "
            f"| {' / '.join(_fmt(None if value is None else 1000 * value, '{:.0f}') for value in ttft)} "
            f"| {_fmt(figures['speedup'], '{:.2f}x')}{spread}{own_note} | {_fmt(figures['tau'])} "
            f"| {_fmt(figures.get('drafts_per_step'), '{:.1f}')} "
            f"| {_fmt(figures['tau_limit'], '{:.2f}x')} | {_fmt(figures['fraction_of_limit'], '{:.0%}')} "
            f"| {_fmt(figures['cost_limit'], '{:.2f}x')} | {_fmt(figures['fraction_of_cost_limit'], '{:.0%}')} "
            f"| {_fmt(figures['in_run_limit'], '{:.2f}x')} | {_fmt(figures['fraction_of_in_run_limit'], '{:.0%}')} "
            f"| {figures['num_identical']}/{figures['num_prompts']} | {_fmt(figures['num_loose_accepts'], '{}')} "
            f"| {' / '.join(_fmt(value, '{:.1f}') for value in steps)} |"
        )
    return lines


def _beside_plain(figures: dict[str, Any], name: str, pattern: str) -> str:
    """A sampled-text figure with plain sampling's over the same prompts in brackets."""
    return f"{_fmt(figures[name], pattern)} ({_fmt(figures['plain_' + name], pattern)})"


def sampled_table(overall: dict[str, dict]) -> list[str]:
    """At temperature > 0: each method's speed beside how likely the target finds its text, and plain's (summary.py's
    NLL figures); no rows when the run was greedy."""
    if not any("nll_mean" in figures for figures in overall.values()):
        return []
    lines = [
        "| method | lossless | tok/s | speedup | τ | identical | NLL (plain) | NLL > 8 (plain) | outside (plain) "
        "| NLL excess (lower bound) | sampler |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, figures in overall.items():
        if "nll_mean" not in figures:
            continue
        excess = figures["nll_excess"]
        bound = "–" if excess is None else f"{excess:+.3f} ({_fmt(figures['nll_excess_lower_bound'], '{:+.3f}')})"
        verdict = {None: "–", True: f"**{SUSPECT}**", False: "ok"}[figures["sampler_suspect"]]
        lines.append(
            f"| {method} | {'yes' if figures['lossless'] else 'no'} | {figures['tokens_per_s']:.1f} "
            f"| {_fmt(figures['speedup'], '{:.2f}x')} | {_fmt(figures['tau'])} "
            f"| {figures['num_identical']}/{figures['num_prompts']} | {_beside_plain(figures, 'nll_mean', '{:.3f}')} "
            f"| {_beside_plain(figures, 'nll_high_share', '{:.1%}')} "
            f"| {_beside_plain(figures, 'outside_share', '{:.1%}')} | {bound} | {verdict} |"
        )
    return lines


def sampled_section(meta: dict[str, Any], overall: dict[str, dict]) -> list[str]:
    """The report's section on the sampled text (temperature > 0 only), with what its columns mean."""
    table = sampled_table(overall)
    if not table:
        return []
    levels = [figures.get("sampler_test_level") for figures in overall.values()]
    level = next((value for value in levels if value), None)
    at = f"at level {level:.2g} each (1 % over the run's tests, Bonferroni)" if level else "(no method beside plain)"
    return [
        "",
        "## Sampled text: speed beside how likely the target finds it",
        "",
        f"Sampled at temperature {meta['temperature']}, top-p {meta.get('top_p', 1.0)}, top-k {meta.get('top_k', 0)} "
        f"(0: off), prompt i seeded {meta.get('seed', 0)} + i. Every output is scored by the target in float32 "
        "(one teacher-forced forward of prompt + output per turn) at that distribution: NLL = mean negative "
        "log-likelihood per generated token, in nats, over the tokens inside it; NLL > 8 = the share of tokens of "
        "probability below 0.03 % (outside ones included); outside = the share top-k / top-p remove (a correct "
        "sampler emits none); in brackets plain sampling's figure over the same prompts. Identical: outputs equal "
        "to plain's token for token (at T > 0 `exact` commits plain's very text for the same seed). NLL excess = "
        "the mean over prompts of (the method's mean NLL − plain's), in brackets its one-sided paired t lower "
        f"bound {at}; **{SUSPECT}**: that bound, or the same bound on the share outside, is above 0 — the method's "
        "text is less likely under the target than plain sampling's beyond what chance over these prompts allows, "
        "so its speed is not that of a correct sampler (a lossy rule may trip it by design).",
        "",
        *table,
    ]


def prediction_section(overall: dict[str, dict]) -> list[str]:
    """The methods given predictions (``prediction+...``): speedup over plain and over drafting from the context
    alone (their context twin), and the prediction tokens accepted and rejected; none when no method was given one."""
    rows = [
        (method, figures) for method, figures in overall.items()
        if figures.get("num_accepted_prediction_tokens") is not None or "context_method" in figures
    ]  # fmt: skip
    if not rows:
        return []
    lines = [
        "",
        "## Predictions: drafts from the text the client expects",
        "",
        "Each request's prediction (OpenAI's predicted output; on the edit workload the code before the edit) drafts "
        "beside the context drafter. Speedup vs context drafts = tokens/s ÷ the same method's without the "
        "prediction (its context twin) over the same prompts; accepted / rejected = OpenAI's usage counts "
        "(`accepted_prediction_tokens`, `rejected_prediction_tokens`), summed over the prompts. `vllm-prediction` "
        "is the flyspec-vllm plugin drafting each request's prediction alone inside vLLM (vLLM's own API has no "
        "such field); `vllm-plain` and `vllm-ngram` have none.",
        "",
        "| method | lossless | tok/s | speedup | context twin | speedup vs context drafts | τ | identical "
        "| prediction tokens accepted / rejected |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for method, figures in rows:
        counts = (figures.get("num_accepted_prediction_tokens"), figures.get("num_rejected_prediction_tokens"))
        lines.append(
            f"| {method} | {'yes' if figures['lossless'] else 'no'} | {figures['tokens_per_s']:.1f} "
            f"| {_fmt(figures['speedup'], '{:.2f}x')} | {figures.get('context_method') or '– (not run)'} "
            f"| {_fmt(figures.get('speedup_vs_context'), '{:.2f}x')} | {_fmt(figures['tau'])} "
            f"| {figures['num_identical']}/{figures['num_prompts']} | {' / '.join(_fmt(c, '{}') for c in counts)} |"
        )
    return lines


def category_table(summary: dict[str, dict]) -> list[str]:
    categories = [name for name in summary if name != OVERALL]
    methods = list(summary[OVERALL])
    lines = [
        "| method | " + " | ".join(categories) + " | overall |",
        "|---|" + "---|" * (len(categories) + 1),
    ]
    for method in methods:
        cells = []
        for category in [*categories, OVERALL]:
            figures = summary[category].get(method)
            cells.append(
                "–" if figures is None else f"{_fmt(figures['speedup'], '{:.2f}x')} (τ {_fmt(figures['tau'])})"
            )
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines


def vllm_section(meta: dict[str, Any]) -> list[str]:
    """Start-up times (excluded from tok/s), the batched figure, and peers skipped or dropped."""
    lines: list[str] = []
    startup = meta.get("vllm_startup_s") or {}
    if startup:
        eager = "enforce_eager" if meta.get("vllm_eager") else "compiled (not enforce_eager)"
        lines += ["", "## vLLM", "", f"Engine start-up ({eager}; excluded from tok/s): " + ", ".join(
            f"{name} {seconds:.1f} s" for name, seconds in startup.items())]  # fmt: skip
    batched = meta.get("vllm_batched") or {}
    if batched:
        header = "| method | prompts | new tokens | wall s | tok/s | τ | loose accepts |"
        lines += ["", "All prompts' first turns submitted at once:", "", header, "|---|---|---|---|---|---|---|"]
        for name, figures in batched.items():
            lines.append(
                f"| {name} | {figures['num_prompts']} | {figures['num_new_tokens']} | {figures['wall_time_s']:.2f} "
                f"| {figures['tokens_per_s']:.1f} | {_fmt(figures['tau'])} | {figures['num_loose_accepts']} |"
            )
    for name, reason in (meta.get("skipped_peers") or {}).items():
        lines += ["", f"- skipped {name}: {reason}"]
    for name, reason in (meta.get("failed_peers") or {}).items():
        lines += ["", f"- dropped {name}: {reason}"]
    return lines


def _floor_line(floor: dict[str, float] | None, t1_ms: float | None) -> list[str]:
    """The report's line on the memory floor of a one-token step (``runtime/memory_floor.py``); none in older runs."""
    if not floor:
        return []
    ratio = f"; t(1) is {t1_ms / floor['floor_ms']:.2f}x it" if t1_ms else ""
    return [
        f"- Memory floor of a one-token step: {floor['weight_mb']:.0f} MB of weights ÷ {floor['read_gb_s']:.1f} GB/s "
        f"read (measured at this run's start) = {floor['floor_ms']:.1f} ms{ratio}: no engine's batch-1 step in this "
        "dtype goes below it"
    ]


def _sampling_note(meta: dict[str, Any]) -> str:
    """A sampled run's top-p, top-k and seed (greedy runs record none)."""
    if "seed" not in meta:
        return ""
    return f" (top-p {meta['top_p']}, top-k {meta['top_k']}, seed {meta['seed']} + prompt index)"


def markdown_report(meta: dict[str, Any], summary: dict[str, Any]) -> str:
    times = meta.get("forward_times_ms") or {}
    k = meta["num_draft_tokens"]
    lines = [
        f"# flyspec bench — {meta['date']}",
        "",
        f"- Command: `{meta['command']}`",
        f"- Machine: {meta['machine']}; {meta.get('versions', '')}",
        f"- Target: {meta['target']} ({meta['dtype']}, {meta.get('kernels', 'stock')} kernels"
        f"{', compiled' if meta.get('compile') else ''}); draft model: {meta['draft_model'] or 'none'}",
        f"- Prompts: {meta['num_prompts']} from {meta['dataset']} ({', '.join(meta['categories'])}); "
        f"max_new_tokens {meta['max_new_tokens']}, k = {k}, temperature {meta['temperature']}"
        f"{_sampling_note(meta)}, "
        f"repeats {meta['repeats']}, warm-up {'yes' if meta['warmup'] else 'no'}; "
        f"{ORDER_NOTES[meta.get('order', 'interleaved')]}",
        f"- Target forward after {meta.get('forward_context', '?')} cached tokens: t(1) = "
        f"{_fmt(times.get('1'), '{:.1f}')} ms, t(k+1 = {k + 1}) = {_fmt(times.get(str(k + 1)), '{:.1f}')} ms",
        *_floor_line(meta.get("memory_floor"), times.get("1")),
        f"- Speedup = method tokens/s ÷ {PLAIN} (flyspec plain decoding, the baseline) tokens/s over the same prompts; "
        f"lossy methods ({LOSSY_NOTE}) are marked lossless = no; their quality is measured by `flyspec eval`.",
        "- Drafts verified per step: the draft tokens scored per target forward (k under a fixed draft length, "
        "fewer under the cost-aware one or when the drafter found nothing). "
        "τ-limit = τ × t(1)/t(k+1) (every step one full (k+1)-token forward, prefill left out); cost limit = "
        "the speedup with each step charged the forward of its actual size t(1 + drafts proposed) and each "
        "side's prefill as timed in the run (speedups are over wall time, prefill included); in-run limit = "
        "the speedup if drafting and engine work were free (tokens per second of prefill + target-forward "
        "time, measured inside the run, relative to plain decoding's). Per-step times split the wall time "
        "into target verification forwards, drafting, and the engine's own work (other = overhead). "
        "TTFT: time to first token per turn, median / 90th percentile (flyspec: from the loop's start, prefill "
        "included; vLLM: its own request metrics; transformers: to generate's first streamed token).",
        "",
        "## Overall",
        "",
        *overall_table(summary[OVERALL]),
        *prediction_section(summary[OVERALL]),
        *sampled_section(meta, summary[OVERALL]),
        "",
        "## Speedup by category",
        "",
        *category_table(summary),
    ]
    lines += vllm_section(meta)
    return "\n".join(lines) + "\n"


def write_plots(directory: Path, summary: dict[str, Any]) -> list[Path]:
    """speedup_by_category.png, tau_by_method.png, acceptance_by_position.png."""
    import matplotlib  # heavy; only when writing plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    overall = summary[OVERALL]
    methods = [method for method in overall if method != PLAIN]
    categories = [name for name in summary if name != OVERALL]
    paths = [
        directory / name for name in ("speedup_by_category.png", "tau_by_method.png", "acceptance_by_position.png")
    ]

    figure, axes = plt.subplots(figsize=(max(6, 1.2 * len(categories) * max(1, len(methods)) / 3), 4))
    width = 0.8 / max(1, len(methods))
    for index, method in enumerate(methods):
        values = [(summary[c].get(method) or {}).get("speedup") or 0.0 for c in [*categories, OVERALL]]
        axes.bar([x + index * width for x in range(len(values))], values, width, label=method)
    axes.set_xticks([x + 0.4 - width / 2 for x in range(len(categories) + 1)], [*categories, OVERALL], rotation=20)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_ylabel("speedup over plain decoding")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(paths[0], dpi=120)
    plt.close(figure)

    figure, axes = plt.subplots(figsize=(6, 4))
    with_tau = [method for method in methods if overall[method]["tau"] is not None]
    axes.bar(with_tau, [overall[method]["tau"] for method in with_tau])
    axes.set_ylabel("τ (tokens per target forward)")
    axes.tick_params(axis="x", rotation=20)
    figure.tight_layout()
    figure.savefig(paths[1], dpi=120)
    plt.close(figure)

    figure, axes = plt.subplots(figsize=(6, 4))
    for method in with_tau:
        rates = overall[method]["acceptance_by_position"]
        axes.plot(range(1, len(rates) + 1), rates, marker="o", label=method)
    axes.set_xlabel("draft position")
    axes.set_ylabel("accepted ÷ proposed")
    axes.set_ylim(0, 1.05)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(paths[2], dpi=120)
    plt.close(figure)
    return paths
