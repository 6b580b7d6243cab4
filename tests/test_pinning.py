"""tests/pinning.py: each xdist worker on its own cores, and the heavy tests at the front of the workers' shares."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pinning import first_shares, heaviest_first, shares, thread_variables

REPO = Path(__file__).resolve().parents[1]


def test_cores_are_split_in_equal_disjoint_shares() -> None:
    assert shares([0, 1], 2) == [[0], [1]]
    assert shares([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3]]
    assert shares([4], 2) is None and shares([0, 1], 1) is None
    variables = thread_variables([2, 3])
    assert variables == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "2,3"}


def test_the_first_shares_are_the_worksteal_schedulers() -> None:
    from xdist.scheduler.worksteal import WorkStealingScheduling

    assert first_shares(11, 2) == [5, 6] and first_shares(10, 3) == [3, 3, 4] and sum(first_shares(7, 4)) == 7
    # the split above is the scheduler's own (pytest-xdist 3.x): a newer one that splits otherwise fails here
    assert "len(self.pending) // nodes_remaining" in inspect.getsource(WorkStealingScheduling)


def test_heavy_items_lead_the_shares_longest_first_and_the_rest_keep_their_order() -> None:
    items = [f"t{index}" for index in range(10)]
    seconds = {2: 100.0, 5: 260.0, 7: 45.0, 9: 120.0}  # t5 260, t9 120, t2 100, t7 45
    ordered = heaviest_first(items, seconds, workers=2)
    assert sorted(ordered) == sorted(items)  # nothing lost, nothing twice
    first, second = ordered[:5], ordered[5:]  # the worksteal scheduler's first shares
    assert first[:1] == ["t5"] and second[:3] == ["t9", "t2", "t7"]  # 260 | 120 + 100 + 45 = 265
    rest = [item for item in ordered if item not in {"t2", "t5", "t7", "t9"}]
    assert rest == ["t0", "t1", "t3", "t4", "t6", "t8"]
    assert heaviest_first(items, seconds, workers=0) == items  # outside xdist (and with one worker) nothing moves
    assert heaviest_first(items, {}, workers=2) == items
    crowded = heaviest_first(["a", "b", "c"], {0: 5.0, 1: 4.0, 2: 3.0}, workers=2)  # more heavy than a share holds
    assert sorted(crowded) == ["a", "b", "c"] and crowded[0] == "a"


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores")
def test_two_workers_are_pinned_apart_and_start_with_their_heavy_tests(tmp_path: Path) -> None:
    """A real ``pytest -n 2 --dist worksteal`` run: each worker on its own core with one thread, and each starts with
    the heavy test dealt to it."""
    (tmp_path / "conftest.py").write_text(  # what tests/conftest.py does about workers, without its models
        "from pinning import order_heavy_first, pin_xdist_worker\n"
        "pin_xdist_worker()\n"
        "def pytest_collection_modifyitems(config, items):\n"
        "    order_heavy_first(items)\n"
    )
    (tmp_path / "test_probe.py").write_text(
        "import json, os, pytest\n"
        "def record(name):\n"  # one line per test, in the order each worker runs them, in the worker's own file
        "    worker = os.environ['PYTEST_XDIST_WORKER']\n"
        "    with open(os.path.join(os.environ['PROBE_OUT'], worker), 'a') as f:\n"
        "        f.write(json.dumps([name, sorted(os.sched_getaffinity(0)), os.environ['OMP_NUM_THREADS']]) + '\\n')\n"
        + "".join(f"def test_light_{n}():\n    record('light_{n}')\n" for n in range(6))
        + "@pytest.mark.heavy(seconds=50)\ndef test_heavy_a():\n    record('heavy_a')\n"
        + "@pytest.mark.heavy(seconds=40)\ndef test_heavy_b():\n    record('heavy_b')\n"
    )
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PROBE_OUT": str(out), "PYTHONPATH": str(REPO / "tests")}
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_CURRENT_TEST"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "worksteal", "-p", "no:cacheprovider",
         "-o", "markers=heavy(seconds): test", str(tmp_path / "test_probe.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
        preexec_fn=lambda: os.sched_setaffinity(0, range(os.cpu_count() or 1)),  # noqa: PLW1509 (this worker's pinning off)
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = {path.name: [json.loads(line) for line in path.read_text().splitlines()] for path in out.iterdir()}
    assert sorted(runs) == ["gw0", "gw1"] and sum(map(len, runs.values())) == 8
    assert sorted(lines[0][0] for lines in runs.values()) == ["heavy_a", "heavy_b"]  # each worker starts with one
    cores = {worker: {tuple(affinity) for _, affinity, _ in lines} for worker, lines in runs.items()}
    assert all(len(found) == 1 for found in cores.values())  # pinned for the whole run
    gw0, gw1 = (set(next(iter(cores[worker]))) for worker in ("gw0", "gw1"))
    assert not gw0 & gw1  # on disjoint cores, one OpenMP thread per core
    assert {threads for lines in runs.values() for _, _, threads in lines} == {str(len(gw0))}


def test_the_suites_conftest_orders_its_collection(monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/conftest.py's collection hook is the one above: heavy items first in the shares under two workers."""
    import conftest

    class Item:
        def __init__(self, name: str, seconds: float | None) -> None:
            self.name, self.marker = name, pytest.mark.heavy(seconds=seconds).mark if seconds else None

        def get_closest_marker(self, name: str) -> object:
            return self.marker if name == "heavy" else None

    items = [Item("a", None), Item("b", None), Item("c", 30), Item("d", None), Item("e", 90), Item("f", None)]
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    conftest.pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    assert [item.name for item in items] == ["e", "a", "b", "c", "d", "f"]
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT")
    conftest.pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    assert [item.name for item in items] == ["e", "a", "b", "c", "d", "f"]  # outside xdist: left as it is
