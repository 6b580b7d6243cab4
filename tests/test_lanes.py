"""scripts/lanes.py: `make test`'s last stage, lanes of commands side by side on disjoint cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pinning import lanes  # scripts/lanes.py, loaded once

SCRIPT = Path(lanes.__file__)

SHOW = (
    f"{sys.executable} -c \"import os; print('lane', sorted(os.sched_getaffinity(0)), "
    "os.environ.get('OMP_NUM_THREADS'), os.environ.get('VLLM_CPU_OMP_THREADS_BIND'))\""
)


def test_cores_are_split_in_equal_disjoint_shares() -> None:
    assert lanes.shares([0, 1], 2) == [[0], [1]]
    assert lanes.shares([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3]]
    assert lanes.shares([4], 2) is None and lanes.shares([0, 1], 1) is None


def run(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *arguments], capture_output=True, text=True, timeout=60)


def test_lanes_run_their_commands_in_order_each_on_its_own_cores() -> None:
    done = run("--lane", SHOW, "echo first-done", "--lane", SHOW)
    assert done.returncode == 0, done.stderr
    blocks = {block[0]: block for block in done.stdout.split("── lane ")[1:]}  # one block per lane, by its number
    assert set(blocks) == {"1", "2"} and all(": passed ──" in block for block in blocks.values())
    assert blocks["1"].index("lane [") < blocks["1"].index("\nfirst-done")  # in order, the second after the first
    shown = [line for line in done.stdout.splitlines() if line.startswith("lane [")]
    assert len(shown) == 2
    if len(os.sched_getaffinity(0)) >= 2:  # side by side: disjoint cores, one OpenMP thread per core
        cores = [json.loads(line.split(" ", 1)[1].rsplit(" ", 2)[0]) for line in shown]
        assert not set(cores[0]) & set(cores[1])
        for line, core in zip(shown, cores, strict=True):
            assert line.endswith(f" {len(core)} {','.join(map(str, core))}")
        assert "side by side" in done.stdout


def test_a_failed_command_ends_its_lane_and_the_run_fails_naming_it() -> None:
    done = run("--lane", "echo a; exit 3", "echo never", "--lane", "echo other-lane")
    assert done.returncode == 1
    assert "never" not in done.stdout.replace("echo never", "") and "other-lane" in done.stdout
    assert "lane 1 failed: `echo a; exit 3` exited 3" in done.stderr
