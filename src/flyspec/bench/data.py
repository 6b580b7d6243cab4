"""Benchmark prompts: the vendored Spec-Bench set, the edit workload, or a user's own JSONL.

Accepted record shapes, one JSON object per line:

* Spec-Bench: ``{"question_id": ..., "category": ..., "turns": ["...", ...]}`` (``reference`` ignored);
* plain: ``{"prompt": "..."}`` with optional ``"id"``, ``"category"`` (default ``custom``) and ``"prediction"``
  (OpenAI's predicted output: the text a ``prediction+...`` method is given with the request).

A record with several turns is run as a chat, turn after turn, each turn seeing the model's own
earlier answers (as Spec-Bench runs MT-bench); a prediction goes with a single-turn prompt only.

The edit workload (``--workload edit``, :func:`load_edit_prompts`) is ``harness/edits.py``'s items: one category
per kind of edit, each item's prediction the code before the edit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flyspec.harness.data import DataError, bad_line, read_jsonl, spec_bench_path
from flyspec.harness.edits import KINDS, load_edits

logger = logging.getLogger(__name__)

SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
# Spec-Bench labels its MT-bench prompts (ids 81-160) with MT-bench's own subcategories.
_MT_BENCH_SUBCATEGORIES = frozenset(
    ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
)


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark item: a single prompt, or the user turns of a multi-turn chat."""

    id: str
    category: str
    turns: tuple[str, ...]
    prediction: str | None = None  # what a ``prediction+...`` method is given with the (single) turn


def load_prompts(
    path: str | Path | None = None,
    *,
    categories: tuple[str, ...] = (),
    limit: int | None = None,
    skip_bad_lines: bool = False,
) -> list[BenchPrompt]:
    """Read prompts, keep the asked categories (all if empty), the first ``limit`` per category.

    A malformed line raises :class:`~flyspec.harness.data.DataError` naming the file and line, or
    with ``skip_bad_lines`` is logged as a warning and skipped (the count is logged too).
    """
    file = Path(path) if path is not None else spec_bench_path()
    prompts, skipped = _read(file, skip_bad_lines)
    if skipped:
        logger.warning("%s: skipped %d malformed line(s)", file, skipped)
    return _select(prompts, file.name, categories, limit)


def load_edit_prompts(*, categories: tuple[str, ...] = (), limit: int | None = None) -> list[BenchPrompt]:
    """The edit workload (``harness/edits.py``): each kind of edit a category, each item with its prediction."""
    prompts = [BenchPrompt(item.id, item.kind, (item.prompt,), item.prediction) for item in load_edits()]
    return _select(prompts, f"the edit workload (kinds: {', '.join(KINDS)})", categories, limit)


def interleaved(prompts: list[BenchPrompt]) -> list[BenchPrompt]:
    """Prompts taking turns by category, so that every wave mixes the kinds of requests."""
    by_category: dict[str, list[BenchPrompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    queues = list(by_category.values())
    return [queue[i] for i in range(max(map(len, queues), default=0)) for queue in queues if i < len(queue)]


def _select(
    prompts: list[BenchPrompt], source: str, categories: tuple[str, ...], limit: int | None
) -> list[BenchPrompt]:
    """The asked categories (all if empty), the first ``limit`` per category."""
    if limit is not None and limit < 1:
        raise DataError(f"--limit must be >= 1 (got {limit})")
    present = list(dict.fromkeys(prompt.category for prompt in prompts))
    unknown = [category for category in categories if category not in present]
    if unknown:
        raise DataError(
            f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)} in {source}; "
            f"it has: {', '.join(present)}"
        )
    counts: dict[str, int] = {}
    chosen = []
    for prompt in prompts:
        if categories and prompt.category not in categories:
            continue
        if limit is not None and counts.get(prompt.category, 0) >= limit:
            continue
        counts[prompt.category] = counts.get(prompt.category, 0) + 1
        chosen.append(prompt)
    if not chosen:
        raise DataError(f"{source} has no prompts to run")
    return chosen


def _read(file: Path, skip_bad_lines: bool) -> tuple[list[BenchPrompt], int]:
    prompts: list[BenchPrompt] = []
    skipped: list[str] = []
    seen: set[str] = set()
    for number, record in read_jsonl(file, skip_bad_lines=skip_bad_lines, on_skip=skipped.append):
        try:
            prompt = parse_record(record, default_id=str(number))
            if prompt.id in seen:
                raise ValueError(f"duplicate id {prompt.id!r}")
        except (ValueError, TypeError) as error:
            bad_line(f"{file}:{number}: {error}", skip_bad_lines, skipped.append)
            continue
        seen.add(prompt.id)
        prompts.append(prompt)
    return prompts, len(skipped)


def parse_record(record: Any, default_id: str) -> BenchPrompt:
    """One JSON record → :class:`BenchPrompt`; ``ValueError`` says what is wrong with it."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            raise ValueError("'turns' must be a non-empty list of strings")
    elif "prompt" in record:
        turns = [record["prompt"]]
    else:
        raise ValueError("a record needs a 'prompt' string or a 'turns' list")
    if not all(isinstance(turn, str) and turn.strip() for turn in turns):
        raise ValueError("every prompt/turn must be a non-empty string")
    category = record.get("category", "custom")
    if not isinstance(category, str) or not category:
        raise ValueError("'category' must be a non-empty string")
    if category in _MT_BENCH_SUBCATEGORIES:
        category = "mt_bench"
    identifier = record.get("question_id", record.get("id", default_id))
    prediction = record.get("prediction")
    if prediction is not None and (not isinstance(prediction, str) or not prediction):
        raise ValueError("'prediction' must be a non-empty string")
    if prediction is not None and len(turns) > 1:
        raise ValueError("a 'prediction' goes with a single-turn prompt, not a list of turns")
    return BenchPrompt(id=str(identifier), category=category, turns=tuple(turns), prediction=prediction)
