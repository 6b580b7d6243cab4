"""The documentation is tested: every Python and shell example of README.md and docs/ runs (how: see
``docs_examples.py``), every skip says why, and the README's links point at files that exist.

One test per example, in document order; a page's examples share a namespace and a working directory,
so an example may use what an earlier one on its page made (running one example alone runs the ones
before it first). The site itself (links, anchors, the generated references) is checked by
``mkdocs build --strict`` in ``make test``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
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
    command_lines,
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


@pytest.mark.parametrize("name", ["README.md", "BENCHMARKS.md", "EVALUATION.md", "DEPLOYMENT.md", "ARCHITECTURE.md"])
def test_top_level_links_point_at_files_that_exist(name: str) -> None:
    text = (REPO / name).read_text(encoding="utf-8")
    missing = [
        target
        for target in _LINK.findall(text)
        if not re.match(r"^[a-z]+:|^#", target) and not (REPO / target.partition("#")[0]).exists()
    ]
    assert missing == []


@pytest.mark.parametrize("name", ["BENCHMARKS.md", "EVALUATION.md"])
def test_the_results_pages_show_current_figures_in_at_most_300_lines(name: str) -> None:
    """Issue 54: the current figures with machine, flags, dtype and date; older runs linked, not repeated."""
    text = (REPO / name).read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    assert "## Current state" in text and "## Run logs" in text


def test_run_logs_are_data_no_dated_folder_holds_a_script() -> None:
    """Issue 54: a dated folder keeps records, a README and the command; a maintained tool lives beside them
    (``benchmarks/<name>.py``, tested in tests/test_benchmark_tools.py) and the rest is in git history."""
    dated = [path for root in ("benchmarks", "evaluation") for path in (REPO / root).glob("20*") if path.is_dir()]
    assert dated
    scripts = [
        str(path.relative_to(REPO))
        for folder in dated
        for path in folder.rglob("*")
        if path.suffix in {".py", ".sh"} and path.is_file()
    ]
    assert scripts == []
    assert all((folder / "README.md").exists() for folder in dated if any(folder.iterdir()))


def test_readme_is_short() -> None:
    """Issue 30: the README says what flyspec is and where to go; the rest lives in docs/."""
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) <= 250


def test_the_verifier_page_names_every_rule_and_whether_it_is_lossless() -> None:
    from flyspec.config.names import LOSSLESS_VERIFIERS, VERIFIERS

    rows = re.findall(r"^\| `(\w+)`[^|]*\|[^|]*\| (yes|no)", (REPO / "docs/concepts/verifiers.md").read_text(), re.M)
    assert {name for name, _ in rows} == set(VERIFIERS)
    assert {name for name, lossless in rows if lossless == "yes"} == set(LOSSLESS_VERIFIERS)


ACTIVATE = "source .venv/bin/activate"
_SUBSTITUTION = re.compile(r"\$\([^()]*\)")


def _shell_blocks(text: str) -> list[str]:
    """The ```bash blocks of a page, skipped ones too, but for those another machine runs (a GPU build)."""
    blocks = []
    for match in re.finditer(r"(<!--\s*skip:([^>]*)-->\s*)?```bash\n(.*?)```", text, re.DOTALL):
        if "GPU" not in (match.group(2) or ""):
            blocks.append(match.group(3))
    return blocks


def _programs(line: str) -> list[str]:
    """The program each command of a shell line runs (``VAR=value`` prefixes and comments left out)."""
    lexer = shlex.shlex(_SUBSTITUTION.sub("X", line), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    programs, starting = [], True
    for word in lexer:
        if word in ("|", "||", "&&", ";", "&"):
            starting = True
        elif starting and not re.fullmatch(r"[A-Za-z_]\w*=.*", word):
            programs.append(word)
            starting = False
    return programs


def test_a_fresh_shell_finds_flyspec_after_the_readmes_line(tmp_path: Path) -> None:
    """The README's way to run ``flyspec`` after the two set-up commands, in a shell that inherits nothing."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert f"{ACTIVATE}   #" in readme
    if not (REPO / ".venv/bin/activate").is_file():
        pytest.skip("no .venv here: `make setup` makes it (CI runs the suite from it)")
    clean = {"HOME": str(tmp_path), "PATH": "/usr/local/bin:/usr/bin:/bin"}
    before = subprocess.run(["bash", "-c", "command -v flyspec"], cwd=REPO, env=clean, capture_output=True, text=True)
    assert before.returncode != 0, "flyspec is on the bare PATH: this test would prove nothing"
    shell = subprocess.run(
        ["bash", "-c", f"{ACTIVATE} && flyspec --version && command -v python curl make"],
        cwd=REPO, env=clean, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert shell.returncode == 0, shell.stderr
    assert shell.stdout.startswith("flyspec ")


@pytest.mark.parametrize("path", DOCUMENTS, ids=[str(path.relative_to(REPO)) for path in DOCUMENTS])
def test_every_shell_command_names_a_program_an_activated_shell_has(path: Path) -> None:
    """Each command line of every ```bash block (skipped ones too) starts with a program found on the PATH of a
    fresh shell after the README's activation line: the venv's scripts, then the system's."""
    venv_bin = REPO / ".venv" / "bin"
    if not venv_bin.is_dir():
        pytest.skip("no .venv here: `make setup` makes it")
    search = os.pathsep.join([str(venv_bin), "/usr/local/bin", "/usr/bin", "/bin"])
    builtins = {"source", "export", "cd", "echo", "for", "do", "done", "if", "then", "fi", "cat", "wait", "kill"}
    missing = {
        program
        for block in _shell_blocks(path.read_text(encoding="utf-8"))
        for line in command_lines(block)
        for program in _programs(line)
        if program not in builtins and not (REPO / program).exists() and shutil.which(program, path=search) is None
    }
    assert sorted(missing) == [], f"{path.name}: programs a fresh, activated shell does not have"
