"""Token facts the trust guards need: per model (EOS, token classes) and per prompt (its names, code).

Token classes, decided on each token's decoded text:

``digits``
    The text contains a decimal digit (``str.isdigit``): numbers, dates, indices, ``x1``.
``identifiers``
    The text contains an identifier character, a letter, digit or underscore. Protecting this
    class everywhere protects almost every word of prose; use it for code-only workloads.
``names``
    Identifiers *where they matter*: every ``identifiers`` token while the output is inside code
    (an open ``````` fence, or a prompt that is itself code), and, anywhere, the tokens of the
    names and identifiers that occur in the prompt (``snake_case``, ``camelCase``, ``x1``,
    capitalised words that do not start a sentence, anything in backticks or code fences).
    Ordinary prose words stay loosely acceptable.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from flyspec.config import ConfigError
from flyspec.runtime.loaded_model import LoadedModel


def _has_digit(text: str) -> bool:
    return any(char.isdigit() for char in text)


def _has_identifier_char(text: str) -> bool:
    return any(char.isalnum() or char == "_" for char in text)


TOKEN_CLASSES: dict[str, Callable[[str], bool]] = {"digits": _has_digit, "identifiers": _has_identifier_char}

_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_FENCED = re.compile(r"```.*?(?:```|\Z)", re.DOTALL)
_BACKTICKED = re.compile(r"`[^`\n]+`")
_SENTENCE_END = ".!?:;\n>|\"'(["  # a capitalised word after these (or at the start) may just start a sentence
_CODE_LINE = re.compile(
    r"^\s*(?:def |class |import |from \S+ import|return\b|for .+:|while .+:|if .+:|#include|function |const |let |"
    r"var |public |SELECT |UPDATE |INSERT )|[;{}]\s*$",
    re.MULTILINE,
)


def is_protected(text: str, classes: Sequence[str]) -> bool:
    """True when the token text belongs to any of the vocabulary-wide classes (``digits``, ``identifiers``)."""
    for name in classes:
        if name not in TOKEN_CLASSES:
            raise ConfigError(f"unknown protected token class {name!r}; choose from: {', '.join(TOKEN_CLASSES)}")
    return any(TOKEN_CLASSES[name](text) for name in classes)


def token_texts(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Each token id's decoded text, in id order (one pass over the vocabulary)."""
    return tokenizer.batch_decode([[token_id] for token_id in range(len(tokenizer))])


def protected_mask(
    tokenizer: PreTrainedTokenizerBase,
    classes: Sequence[str],
    vocab_size: int | None = None,
    texts: Sequence[str] | None = None,
) -> torch.Tensor:
    """``[vocab_size]`` bool: token ids whose decoded text belongs to a class (padding ids never do).

    ``texts``: :func:`token_texts` of ``tokenizer``, when the caller already has them."""
    size = max(len(tokenizer), vocab_size or 0)
    mask = torch.zeros(size, dtype=torch.bool)
    if not classes:
        return mask
    texts = token_texts(tokenizer) if texts is None else texts
    mask[: len(texts)] = torch.tensor([is_protected(text, classes) for text in texts], dtype=torch.bool)
    return mask


def is_name_like(word: str, text: str, start: int) -> bool:
    """A word that reads as a name or identifier, not as an ordinary prose word."""
    if "_" in word or (any(c.isdigit() for c in word) and any(c.isalpha() for c in word)):
        return True
    if len(word) < 2:
        return False
    if any(c.isupper() for c in word[1:]):  # camelCase, ALLCAPS, SmolLM
        return True
    if not word[0].isupper():
        return False
    before = text[:start].rstrip(" \t")
    return bool(before) and before[-1] not in _SENTENCE_END


def name_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the names and identifiers in ``text`` (see the module docstring)."""
    spans = [match.span() for match in _WORD.finditer(text) if is_name_like(match.group(), text, match.start())]
    for block in (*_FENCED.finditer(text), *_BACKTICKED.finditer(text)):
        offset = block.start()
        spans.extend((offset + m.start(), offset + m.end()) for m in _WORD.finditer(block.group()))
    return spans


def looks_like_code(text: str) -> bool:
    """A prompt that is itself code (at least two code-looking lines), or ends inside an open fence."""
    return text.count("```") % 2 == 1 or len(_CODE_LINE.findall(text)) >= 2


@dataclass
class Vocabulary:
    """One target model's token facts, built once per loaded model (:func:`vocabulary_of`)."""

    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    vocab_size: int  # width of the target's logits (may exceed the tokenizer's vocabulary)
    _masks: dict[tuple[str, ...], torch.Tensor] = field(default_factory=dict, repr=False)
    _tables: dict[tuple[str, ...], Any] = field(default_factory=dict, repr=False)  # the masks as numpy arrays
    _texts: list[str] | None = field(default=None, repr=False)

    def mask(self, classes: Sequence[str]) -> torch.Tensor:
        """``[vocab]`` bool for vocabulary-wide classes, computed once per class set (the vocabulary
        is decoded once for all of them)."""
        key = tuple(sorted(classes))
        if key not in self._masks:
            if self._texts is None:
                self._texts = token_texts(self.tokenizer)
            self._masks[key] = protected_mask(self.tokenizer, key, self.vocab_size, self._texts)
        return self._masks[key]

    def contains(self, classes: Sequence[str], token: int) -> bool:
        """Whether ``token`` is in the classes' :meth:`mask`: read on the host (a numpy view of the mask, made
        once), so a guard's per-token lookup is never a tensor read (a host sync on a GPU: runtime/syncs.py)."""
        key = tuple(sorted(classes))
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = self.mask(classes).numpy()
        return bool(table[token])

    def pieces(self, token_ids: Sequence[int]) -> list[str]:
        return self.tokenizer.batch_decode([[token_id] for token_id in token_ids])

    def prompt_names(self, prompt_ids: Sequence[int]) -> frozenset[int]:
        """Ids of the prompt tokens that overlap a name or identifier of the prompt's text."""
        pieces = self.pieces(prompt_ids)
        text = "".join(pieces)  # offsets of the pieces are offsets into this text
        spans = sorted(name_spans(text))
        names: set[int] = set()
        start = 0
        for token_id, piece in zip(prompt_ids, pieces, strict=True):
            end = start + len(piece)
            if piece.strip() and any(a < end and start < b for a, b in spans):
                names.add(int(token_id))
            start = end
        return frozenset(names)

    def prompt_is_code(self, prompt_ids: Sequence[int]) -> bool:
        return looks_like_code("".join(self.pieces(prompt_ids)))

    def opens_code(self, output_ids: Sequence[int]) -> bool:
        """Whether the output so far toggles the code state (an odd number of ``````` fences)."""
        return self.tokenizer.decode(list(output_ids)).count("```") % 2 == 1


# Each loaded model's Vocabulary, kept as long as the model is (weak keys; LoadedModel hashes by identity).
# Only what the tokenizer says about its tokens: no prompt or output is kept here.
_VOCABULARIES: weakref.WeakKeyDictionary[LoadedModel, Vocabulary] = weakref.WeakKeyDictionary()


def vocabulary_of(model: LoadedModel) -> Vocabulary:
    """``model``'s token facts for the trust guards (EOS ids, token classes), built once per loaded model:
    decoding the whole vocabulary takes about a second, and every decoder of the model shares the result."""
    vocabulary = _VOCABULARIES.get(model)
    if vocabulary is None:
        vocab_size = int(getattr(model.model.config, "vocab_size", 0) or 0)
        vocabulary = _VOCABULARIES[model] = Vocabulary(model.tokenizer, model.eos_token_ids, vocab_size)
    return vocabulary
