"""The numba-compiled n-gram kernel of the plugin (``flyspec_vllm/lookup.py``) against flyspec's ``ngram_lookup``.

Runs in the vLLM venv (numba comes with vLLM); no engine starts. The plain-Python run of the same kernel,
with a property test: ``tests/test_vllm_lookup.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba", reason="needs the vLLM venv (numba comes with vLLM): run `make test-vllm`")

from flyspec_vllm.lookup import kernel, lookup_rows  # noqa: E402

from flyspec.drafters.ngram import ngram_lookup  # noqa: E402


def test_the_kernel_is_compiled_here() -> None:
    assert kernel() is not kernel(compiled=False)


@pytest.mark.parametrize("seed", range(20))
def test_the_compiled_kernel_proposes_ngram_lookups_tokens(seed: int) -> None:
    generator = np.random.default_rng(seed)
    batch = int(generator.integers(1, 9))
    alphabet = int(generator.integers(2, 12))
    lengths = generator.integers(0, 200, size=batch)
    table = generator.integers(0, alphabet, size=(batch, 256)).astype(np.int32)
    rooms = generator.integers(1, 16, size=batch)
    min_ngram = int(generator.integers(1, 4))
    max_ngram = min_ngram + int(generator.integers(0, 4))
    found = lookup_rows(table, lengths, range(batch), rooms, max_ngram, min_ngram)
    expected = [
        ngram_lookup(table[row, : lengths[row]].tolist(), int(rooms[row]), max_ngram, min_ngram) for row in range(batch)
    ]
    assert found == expected
