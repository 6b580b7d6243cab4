"""``flyspec demo``'s second table: a few requests to edit a function, where speculation pays most.

The requests are ``flyspec bench --workload edit``'s (``harness/edits.py``): the kinds take turns in
:data:`DEMO_EDIT_KINDS` order, the shortest request of each (the first a rename, whose code the prompt holds; the
second a regeneration, whose earlier answer it does not). Three rows, greedy, :data:`DEMO_EDIT_MAX_NEW_TOKENS`
new tokens each:

plain
    autoregressive decoding, as in the chat table;
lossless
    n-gram drafts + exact verification, as in the chat table: here the drafts copy the code from the prompt;
prediction
    the code before the edit as OpenAI's ``prediction`` (what a client holds and sends), drafted beside the n-gram
    drafts, exact verification: token for token plain decoding's output, and the only row that can copy what the
    prompt does not hold.
"""

from __future__ import annotations

from typing import Any

# the edit table's rows: (row name, bench method, what it runs)
EDIT_ROWS = (
    ("plain", "plain", "autoregressive"),
    ("lossless", "ngram+exact", "n-gram drafts + exact"),
    ("prediction", "prediction+exact", "prediction + n-gram drafts, exact"),
)
DEMO_EDIT_MAX_NEW_TOKENS = 128  # an edit's answer is the whole function
DEMO_EDIT_KINDS = ("rename", "regenerate", "constant", "comment", "docstring", "delete")
EDIT_LEGEND = (
    "prediction = the code before the edit, sent as OpenAI's prediction (a regenerate request's: the earlier "
    "answer, which its prompt does not hold); accepted / rejected = draft tokens taken from it that exact "
    "verification kept / scored and rejected (OpenAI's accepted_prediction_tokens / rejected_prediction_tokens)"
)


def edit_prompts(count: int) -> list[Any]:
    """``count`` edit requests: the kinds in :data:`DEMO_EDIT_KINDS` order, the shortest of each, then the next
    shortest of each, and so on."""
    from flyspec.bench.data import load_edit_prompts
    from flyspec.config import ConfigError

    loaded = load_edit_prompts()
    by_kind = {kind: sorted((p for p in loaded if p.category == kind), key=lambda p: len(p.prediction or ""))
               for kind in DEMO_EDIT_KINDS}  # fmt: skip
    ordered = [queue[i] for i in range(max(map(len, by_kind.values()))) for queue in by_kind.values() if i < len(queue)]
    if count > len(ordered):
        raise ConfigError(f"--edit-prompts {count}: the edit workload has {len(ordered)} requests")
    return ordered[:count]


def edit_title(prompts: list[Any]) -> str:
    kinds = ", ".join(prompt.category for prompt in prompts)
    return (
        f"Edit requests: {len(prompts)} ({kinds}), greedy, {DEMO_EDIT_MAX_NEW_TOKENS} new tokens each; "
        "the answer copies the code the user holds"
    )


def edit_figures(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per row: tokens/s, speedup over plain, τ, identical to plain, prediction tokens accepted and rejected."""
    from flyspec.bench.summary import OVERALL, summarize

    overall = summarize(records, None, 0)[OVERALL]
    rows = []
    for name, method, what in EDIT_ROWS:
        figures = overall[method]
        rows.append(
            {
                "row": name,
                "what": what,
                "tokens_per_s": figures["tokens_per_s"],
                "speedup": figures["speedup"],
                "speedup_vs_context": figures.get("speedup_vs_context"),
                "tau": figures["tau"],
                "identical": None if method == "plain" else figures["num_identical"],
                "accepted": figures.get("num_accepted_prediction_tokens"),
                "rejected": figures.get("num_rejected_prediction_tokens"),
            }
        )
    return rows


def edit_table(rows: list[dict[str, Any]], num_prompts: int) -> Any:
    from rich.table import Table

    grid = Table(title_justify="left")
    grid.add_column("row")
    grid.add_column("what it runs")
    for column in ("tokens/s", "speedup", "τ", "accepted / rejected", "identical"):
        grid.add_column(column, justify="right")
    for row in rows:
        counts = "–" if row["accepted"] is None else f"{row['accepted']} / {row['rejected']}"
        grid.add_row(
            row["row"],
            row["what"],
            f"{row['tokens_per_s']:.1f}",
            f"{row['speedup']:.2f}x",
            f"{row['tau']:.2f}" if row["tau"] is not None else "–",
            counts,
            "–" if row["identical"] is None else f"{row['identical']}/{num_prompts}",
        )
    return grid


def edit_verdict(rows: list[dict[str, Any]], num_prompts: int) -> str:
    """One line: which row was fastest on the edits, what the prediction added, whether both matched plain."""
    by_name = {row["row"]: row for row in rows}
    lossless, prediction = by_name["lossless"], by_name["prediction"]
    fastest = max(rows, key=lambda row: row["tokens_per_s"])
    if fastest["row"] == "plain":
        speed = "plain was fastest: speculation did not pay off in this run"
    else:
        speed = f"{fastest['row']} was fastest ({fastest['speedup']:.2f}x plain)"
    added = prediction["speedup_vs_context"]
    against = "" if added is None else f"; the prediction ran at {added:.2f}x lossless's speed"
    same = [name for name in ("lossless", "prediction") if by_name[name]["identical"] == num_prompts]
    exact = (
        "both matched plain on every request"
        if len(same) == 2
        else f"lossless matched plain on {lossless['identical']}/{num_prompts}, prediction on "
        f"{prediction['identical']}/{num_prompts} (rounding: not float32?)"
    )
    return f"Edits: {speed}{against}; {exact}."
