"""What ``flyspec bench`` shows while it runs: a progress bar over a table of speedups so far."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from flyspec.bench.summary import OVERALL, summarize


def speedup_table(summary: dict[str, Any]) -> Table:
    """Rows: methods; columns: speedup (τ) per category and overall; sampled runs: the overall NLL (plain's), red
    where the sampler is suspect (``summary.py``)."""
    categories = [name for name in summary if name != OVERALL]
    sampled = any("nll_mean" in figures for figures in summary.get(OVERALL, {}).values())
    table = Table(title="speedup over plain decoding (τ = tokens per target forward)", title_justify="left")
    table.add_column("method")
    table.add_column("lossless")
    for category in [*categories, OVERALL]:
        table.add_column(category, justify="right")
    if sampled:
        table.add_column("NLL (plain)", justify="right")
    for method, figures in summary.get(OVERALL, {}).items():
        cells = []
        for category in [*categories, OVERALL]:
            entry = summary[category].get(method)
            if entry is None or entry["speedup"] is None:
                cells.append("–")
                continue
            tau = f" ({entry['tau']:.2f})" if entry["tau"] is not None else ""
            cells.append(f"{entry['speedup']:.2f}x{tau}")
        if sampled:
            cells.append(_nll_cell(figures))
        table.add_row(method, "yes" if figures["lossless"] else "[red]no[/red]", *cells)
    return table


def _nll_cell(figures: dict[str, Any]) -> str:
    if figures.get("nll_mean") is None:
        return "–"
    plain = figures["plain_nll_mean"]
    cell = f"{figures['nll_mean']:.2f}" + (f" ({plain:.2f})" if plain is not None else "")
    return f"[red]{cell} suspect[/red]" if figures["sampler_suspect"] else cell


class LiveView:
    """A rich Live display: the table of results so far above a progress bar over prompts."""

    def __init__(self, total_prompts: int, num_draft_tokens: int, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        if not self.console.is_terminal:
            self.console.width = max(self.console.width, 160)  # logs: no wrapping of the wide table
        self.num_draft_tokens = num_draft_tokens
        self.records: list[dict] = []
        self.progress = Progress(
            TextColumn("[bold]bench"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("prompts"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
        )
        self.task = self.progress.add_task("bench", total=total_prompts)
        self.live = Live(self._render(), console=self.console, refresh_per_second=2, transient=False)

    def _render(self) -> Group:
        if not self.records:
            return Group(self.progress)
        return Group(speedup_table(summarize(self.records, None, self.num_draft_tokens)), self.progress)

    def add(self, record: dict) -> None:
        self.records.append(record)

    def prompt_done(self) -> None:
        self.progress.advance(self.task)
        self.live.update(self._render())

    def __enter__(self) -> LiveView:
        self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.__exit__(*exc)  # type: ignore[arg-type]
