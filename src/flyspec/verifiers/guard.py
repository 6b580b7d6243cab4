"""Protected-token guard for the lossy verifiers (an extension beyond the FLy paper).

Loose acceptance can swap a digit or a name and keep a fluent but wrong output ("42" for "24",
``left`` for ``right``). The guard vetoes a loose accept at draft position ``i`` when the draft
token ``d_i`` **or** the target's top token at ``i`` (its argmax, the token it would have chosen
greedily) belongs to a protected class; the position is then judged by the strict base rule,
exactly as if the lossy rule had not kept it. The guard only removes loose accepts, so it never
changes a lossless verdict and never adds an accept.

Token classes, decided on each token's decoded text:

``digits``
    The text contains a decimal digit (``str.isdigit``): numbers, dates, indices, ``x1``.
``identifiers``
    The text contains an identifier character, a letter, digit or underscore (``str.isalnum`` or
    ``_``; a superset of ``digits``). This is the code guard: names, keywords and literals are
    judged strictly; only whitespace, indentation, punctuation and operators can still be
    loosely accepted. The trade-off is deliberate: a swapped name (``a``/``b``) is the error that
    silently breaks code, and a looser test (say, only tokens with ``_`` or camelCase) misses
    exactly those one-letter names. On prose it protects almost every word, so use it for code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from flyspec.config import ConfigError


def _has_digit(text: str) -> bool:
    return any(char.isdigit() for char in text)


def _has_identifier_char(text: str) -> bool:
    return any(char.isalnum() or char == "_" for char in text)


TOKEN_CLASSES: dict[str, Callable[[str], bool]] = {"digits": _has_digit, "identifiers": _has_identifier_char}


def is_protected(text: str, classes: Sequence[str]) -> bool:
    """True when the token text belongs to any of the named classes."""
    for name in classes:
        if name not in TOKEN_CLASSES:
            raise ConfigError(f"unknown protected token class {name!r}; choose from: {', '.join(TOKEN_CLASSES)}")
    return any(TOKEN_CLASSES[name](text) for name in classes)


def protected_mask(
    tokenizer: PreTrainedTokenizerBase, classes: Sequence[str], vocab_size: int | None = None
) -> torch.Tensor:
    """``[vocab_size]`` bool: token ids whose decoded text belongs to a protected class.

    ``vocab_size`` is the width of the target's logits (it may be padded beyond the tokenizer);
    padding ids are never protected.
    """
    size = max(len(tokenizer), vocab_size or 0)
    mask = torch.zeros(size, dtype=torch.bool)
    if not classes:
        return mask
    texts = tokenizer.batch_decode([[token_id] for token_id in range(len(tokenizer))])
    flags = [is_protected(text, classes) for text in texts]
    mask[: len(flags)] = torch.tensor(flags, dtype=torch.bool)
    return mask


def guard_loose_mask(
    loose: torch.Tensor,  # [k] bool, positions the lossy rule keeps although the base rule rejects them
    draft_tokens: torch.Tensor,  # [k]
    target_logits: torch.Tensor,  # [k (+1), vocab]
    protected: torch.Tensor | None,  # [vocab] bool, or None for no guard
) -> torch.Tensor:
    """``[k]`` bool: the loose accepts that survive the guard (``loose`` itself when there is none)."""
    if protected is None:
        return loose
    k = draft_tokens.shape[0]
    target_tokens = target_logits[:k].argmax(-1)  # [k]
    vetoed = protected[draft_tokens] | protected[target_tokens]
    return loose & ~vetoed
