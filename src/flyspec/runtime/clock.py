"""Clock reads around device work: wait for the device first, or a GPU's time is only its kernel launches.

CUDA (and XPU, MPS) run kernels asynchronously: ``time.perf_counter()`` right after a forward measures
how long it took to *queue* it, and the wait lands in whatever is timed next (a draft's cost absorbs the
target's forward). Every timer in flyspec that brackets device work reads :func:`device_clock`, which
synchronises ``device`` first; on the CPU it is ``time.perf_counter()`` and nothing else.
``tests/test_clock.py`` times work on a stand-in device that completes late.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

DeviceLike = torch.device | str | None


def synchronize(device: DeviceLike) -> None:
    """Wait until ``device`` has finished the work queued on it (nothing to wait for on the CPU or ``None``)."""
    if device is None:
        return
    kind = torch.device(device).type
    wait: Callable[..., None] | None = SYNCHRONIZERS.get(kind)
    if wait is not None:
        wait(torch.device(device))


def _cuda(device: torch.device) -> None:
    torch.cuda.synchronize(device)


def _xpu(device: torch.device) -> None:
    torch.xpu.synchronize(device)


def _mps(device: torch.device) -> None:
    torch.mps.synchronize()


SYNCHRONIZERS: dict[str, Callable[[torch.device], None]] = {"cuda": _cuda, "xpu": _xpu, "mps": _mps}


def device_clock(device: DeviceLike) -> float:
    """``time.perf_counter()`` once ``device``'s queued work is done: read it before and after device work."""
    synchronize(device)
    return time.perf_counter()
