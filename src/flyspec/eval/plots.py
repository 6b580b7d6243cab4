"""PNG plots (matplotlib, Agg backend): retention with CI bars, and speed against retention."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend


def _methods(summary: dict[str, Any]) -> list[str]:
    names: dict[str, None] = {}
    for entry in summary["tasks"].values():
        names.update(dict.fromkeys(entry["methods"]))
    return list(names)


def _note_if_empty(axes: Any, plotted: bool) -> None:
    if not plotted:
        axes.text(
            0.5,
            0.25,
            "no task's plain score is above the floor:\nno meaningful retention ratio",
            ha="center",
            va="center",
            transform=axes.transAxes,
            color="gray",
        )


def plot_retention(summary: dict[str, Any], path: Path) -> None:
    """Primary-metric retention per task (x) and method (marker), 95% CI as error bars."""
    tasks = [task for task, entry in summary["tasks"].items() if entry["metrics"]]
    methods = _methods(summary)
    figure, axes = plt.subplots(figsize=(max(6.0, 1.6 * len(tasks) + 2), 4.5))
    width = 0.8 / max(1, len(methods))
    plotted = False
    for offset, method in enumerate(methods):
        for x, task in enumerate(tasks):
            entry = summary["tasks"][task]
            result = entry["methods"].get(method)
            if result is None:
                continue
            score = result["scores"][entry["metrics"][0]]
            position = x - 0.4 + width * (offset + 0.5)
            if score["retention"] is None:
                axes.annotate("below\nfloor", (position, 1.0), ha="center", fontsize=7, color="gray")
                continue
            low = score["low"] if score["low"] is not None else score["retention"]
            high = score["high"] if score["high"] is not None else score["retention"]
            error = [[score["retention"] - low], [high - score["retention"]]]
            axes.errorbar(position, score["retention"], yerr=error, fmt="o", capsize=3, color=f"C{offset}")
            plotted = True
        axes.plot([], [], "o", color=f"C{offset}", label=method)
    _note_if_empty(axes, plotted)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.axhline(0.99, color="gray", linewidth=0.8, linestyle="--", label="99% (FLy paper's claim)")
    axes.set_xlim(-0.5, len(tasks) - 0.5)
    axes.set_xticks(range(len(tasks)), [f"{t}\n({summary['tasks'][t]['metrics'][0]})" for t in tasks])
    axes.set_ylabel("retention = method ÷ plain (95% CI)")
    axes.set_title("Quality retention per task")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_speed_vs_retention(summary: dict[str, Any], path: Path) -> None:
    """Left: speedup vs primary-metric retention; right: speedup vs MiniLM similarity (always defined)."""
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    methods = _methods(summary)
    plotted = False
    for task_index, (task, entry) in enumerate(summary["tasks"].items()):
        marker = "osD^v<>ph"[task_index % 9]
        for method, result in entry["methods"].items():
            speedup = result["speed"]["speedup"]
            if speedup is None:
                continue
            color = f"C{methods.index(method)}"
            if entry["metrics"]:
                kept = result["scores"][entry["metrics"][0]]["retention"]
                if kept is not None:
                    left.scatter(speedup, kept, color=color, marker=marker)
                    plotted = True
            similarity = result["fidelity"]["similarity"]
            if similarity is not None:
                right.scatter(speedup, similarity, color=color, marker=marker)
        right.scatter([], [], color="black", marker=marker, label=task)
    for index, method in enumerate(methods):
        left.scatter([], [], color=f"C{index}", label=method)
    _note_if_empty(left, plotted)
    for axes, ylabel in ((left, "retention (primary metric)"), (right, "MiniLM similarity to plain")):
        axes.axvline(1.0, color="gray", linewidth=0.8)
        axes.set_xlabel("speedup = method tok/s ÷ plain tok/s (same run)")
        axes.set_ylabel(ylabel)
        axes.legend(fontsize=8)
    left.set_title("Speed vs retention")
    right.set_title("Speed vs fidelity")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
