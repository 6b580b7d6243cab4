"""The plugin's batched n-gram lookup (``flyspec_vllm/lookup.py``) proposes what flyspec's ``ngram_lookup`` does.

Here the kernel runs as plain Python (no numba in this venv); ``tests/vllm_engine/test_lookup_compiled.py``
checks the numba-compiled kernel with the same cases in the vLLM venv.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations" / "vllm" / "src"))

from flyspec_vllm.lookup import lookup_rows  # noqa: E402

from flyspec.drafters.ngram import ngram_lookup  # noqa: E402

contexts = st.lists(st.integers(0, 3), min_size=0, max_size=40)  # a small alphabet: many matches


@settings(max_examples=300, deadline=None)
@given(
    st.lists(contexts, min_size=1, max_size=5),
    st.integers(1, 5),
    st.integers(0, 3),
    st.integers(1, 9),
)
def test_the_batched_kernel_proposes_ngram_lookups_tokens(batch, min_ngram, extra, room) -> None:
    max_ngram = min_ngram + extra
    table = np.zeros((len(batch) + 1, 48), dtype=np.int32)  # one row more than looked up: rows are picked
    for row, context in enumerate(batch):
        table[row + 1, : len(context)] = context
    rows = list(range(1, len(batch) + 1))
    lengths = [len(context) for context in batch]
    found = lookup_rows(table, lengths, rows, [room] * len(batch), max_ngram, min_ngram, compiled=False)
    assert found == [ngram_lookup(context, room, max_ngram, min_ngram) for context in batch]


def test_no_rows_no_work() -> None:
    assert lookup_rows(np.zeros((1, 4), dtype=np.int32), [], [], [], 4, 1) == []


def test_a_periodic_continuation_and_per_row_caps() -> None:
    table = np.zeros((2, 16), dtype=np.int32)
    table[0, :5] = [1, 2, 1, 2, 1]  # "1" last seen at 2: continue "2 1", periodically
    table[1, :4] = [7, 8, 9, 5]  # nothing repeats
    assert lookup_rows(table, [5, 4], [0, 1], [5, 3], 3, 1, compiled=False) == [[2, 1, 2, 1, 2], []]
