"""The guards' word vocabulary: twenty tokens with a class each (EOS, digits, names, code, prose), a tokenizer over
them and its :class:`~flyspec.verifiers.tokens.Vocabulary`. Shared by the guards' tests (``test_guard.py``) and the
vLLM plugin's (``test_vllm_plugin.py``, ``vllm033/``), which run in the vLLM venv too (no scipy there)."""

from __future__ import annotations

from flyspec.verifiers.tokens import Vocabulary

WORDS = [
    "<eos>", " the", " cat", " dog", " 42", " 24", " Alice", " Bob", "```", "\n",
    " x", " y", " =", " sat", " on", " mat", " said", ".", " Ask", " is",
]  # fmt: skip
ID = {word.strip() or word: index for index, word in enumerate(WORDS)}
EOS, THE, CAT, DOG, N42, N24, ALICE, BOB, FENCE, NEWLINE = range(10)
X, Y, EQUALS, SAT, ON, MAT, SAID, DOT, ASK, IS = range(10, 20)
VOCAB = len(WORDS)


class WordTokenizer:
    """A tokenizer over :data:`WORDS` with just what :class:`Vocabulary` uses."""

    def __len__(self) -> int:
        return VOCAB

    def decode(self, ids: list[int]) -> str:
        return "".join(WORDS[i] for i in ids)

    def batch_decode(self, batch: list[list[int]]) -> list[str]:
        return [self.decode(ids) for ids in batch]


VOCABULARY = Vocabulary(WordTokenizer(), frozenset({EOS}), VOCAB)  # type: ignore[arg-type]
