"""The documentation is tested: every Python and shell example of README.md and docs/ runs (how: see
``docs_examples.py``), every skip says why, and the README's links point at files that exist.

One test per example, in document order; a page's examples share a namespace and a working directory,
so an example may use what an earlier one on its page made (running one example alone runs the ones
before it first). The site itself (links, anchors, the generated references) is checked by
``mkdocs build --strict`` in ``make test``.
"""

from __future__ import annotations

import re
import unittest
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sybil import Document, Example
from sybil.example import NotEvaluated

from conftest import AUTO_DTYPES
from docs_examples import (
    DOCUMENTS,
    EXAMPLE_LANGUAGES,
    REPO,
    parse,
    resolve_to_tiny,
    server_starter,
    tiny_model_dirs,
)

_PARSED = {path: parse(path) for path in DOCUMENTS}
EXAMPLES = [(path, index) for path, document in _PARSED.items() for index, _ in enumerate(document)]


class _Page:
    """A page's examples, its namespace and its working directory; examples run once each, in order."""

    def __init__(self, document: Document, namespace: dict[str, Any]) -> None:
        self.examples: list[Example] = list(document)
        self.document = document
        document.namespace.update(namespace)
        self.outcomes: dict[int, BaseException | None] = {}

    def run_through(self, index: int) -> None:
        for position in range(len(self.outcomes), index + 1):
            try:
                self.examples[position].evaluate()
                self.outcomes[position] = None
            except (NotEvaluated, unittest.SkipTest, Exception) as error:
                self.outcomes[position] = error
        outcome = self.outcomes[index]
        if isinstance(outcome, unittest.SkipTest):
            pytest.skip(str(outcome))
        if outcome is not None:
            raise outcome


@pytest.fixture(scope="module", params=AUTO_DTYPES)
def pages(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[Path], _Page]]:
    """The pages, their examples run with ``--dtype auto`` meaning each of ``AUTO_DTYPES`` in turn (a reader's
    machine has one or the other: a profile calibrated in float32 must work on both)."""
    dirs = tiny_model_dirs(tmp_path_factory.mktemp("docs-models"))
    cleanups: list[Callable[[], None]] = []
    made: dict[Path, _Page] = {}

    def page(path: Path) -> _Page:
        if path not in made:
            cwd = tmp_path_factory.mktemp(f"docs-{path.stem}")
            (cwd / "examples").symlink_to(REPO / "examples")
            made[path] = _Page(parse(path), {"_cwd": cwd, "MODEL_DIR": dirs["smollm2-135m-instruct"]})
            namespace = made[path].document.namespace  # what the examples see
            namespace["start_server"] = server_starter(namespace, cleanups)
        return made[path]

    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as monkeypatch:
        resolve_to_tiny(monkeypatch, dirs)
        monkeypatch.setenv("FLYSPEC_AUTO_DTYPE", request.param)
        # the examples' caches (eval's plain outputs, calibrations) must not mix tiny models into the user's
        monkeypatch.setenv("FLYSPEC_CACHE", str(tmp_path_factory.mktemp("docs-cache")))
        yield page
        for cleanup in reversed(cleanups):
            cleanup()
    torch.set_num_threads(threads)


def _example_id(item: tuple[Path, int]) -> str:
    path, index = item
    example = list(_PARSED[path])[index]
    return f"{path.relative_to(REPO)}:{example.line}"


@pytest.mark.parametrize("item", EXAMPLES, ids=[_example_id(item) for item in EXAMPLES])
def test_example_runs(item: tuple[Path, int], pages: Callable[[Path], _Page]) -> None:
    path, index = item
    pages(path).run_through(index)


_FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)", re.MULTILINE)
_SKIP = re.compile(r"<!--\s*skip:\s*(\w+)(.*?)-->", re.DOTALL)


@pytest.mark.parametrize("path", DOCUMENTS, ids=[str(path.relative_to(REPO)) for path in DOCUMENTS])
def test_every_skip_has_a_reason_and_every_example_a_runner(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    for action, reason in _SKIP.findall(text):
        assert action == "next" and reason.strip().startswith('"'), f"{path.name}: skip without a reason"
    languages = {language for _, language in _FENCE.findall(text) if language}
    shells = languages & {"sh", "shell", "console", "zsh", "py", "python3", "pycon"}
    assert not shells, f"{path.name}: write examples as ```python or ```bash, not {shells}"
    assert {"python", "bash"} >= set(EXAMPLE_LANGUAGES)


_LINK = re.compile(r"(?<!!)\[[^\]]+\]\(([^)\s]+)\)")


def test_readme_links_point_at_files_that_exist() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    missing = [
        target
        for target in _LINK.findall(readme)
        if not re.match(r"^[a-z]+:|^#", target) and not (REPO / target.partition("#")[0]).exists()
    ]
    assert missing == []


def test_readme_is_short() -> None:
    """Issue 30: the README says what flyspec is and where to go; the rest lives in docs/."""
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) <= 250


def test_the_verifier_page_names_every_rule_and_whether_it_is_lossless() -> None:
    from flyspec.config.names import LOSSLESS_VERIFIERS, VERIFIERS

    rows = re.findall(r"^\| `(\w+)`[^|]*\|[^|]*\| (yes|no)", (REPO / "docs/concepts/verifiers.md").read_text(), re.M)
    assert {name for name, _ in rows} == set(VERIFIERS)
    assert {name for name, lossless in rows if lossless == "yes"} == set(LOSSLESS_VERIFIERS)
