"""Prompt lookup (n-gram) drafting over the prompt and the generated text.

The last ``n`` committed tokens (``n`` from ``max_ngram`` down to ``min_ngram``) are searched
for earlier in the context; the tokens that followed the *most recent* earlier occurrence are the
draft (recent context predicts repetition better; transformers' prompt lookup, the FLy
reference and vLLM's n-gram proposer take the earliest: ``benchmarks/2026-12-08-ngram-rule/``).
When that continuation reaches the end of the context it is extended periodically, as an LZ77
copy that overlaps its own output would: after ``... a b c a b`` the draft is ``c a b c a ...``.
No model, no state.

``NgramConfig.match`` and ``extend`` select the variants the draft ablation compares
(BENCHMARKS.md): ``earliest`` (transformers' and the FLy reference's choice), ``frequent``
(when several earlier occurrences match, follow the continuation most of them share, token by
token, ties to the most recent — the evidence a suffix tree would give), and no periodic extension.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from flyspec.config import NgramConfig, SamplingConfig
from flyspec.sampling.coupled import Draws
from flyspec.types import OUTPUT_COPY, PROMPT_COPY, Draft


def longest_match(
    token_ids: list[int],
    max_tokens: int,
    max_ngram: int,
    min_ngram: int,
    match: str = "recent",
    extend: bool = True,
) -> tuple[list[int], int]:
    """Where the draft is copied from, and the length of the context suffix that matched (0: none).

    The indices are those of the continuation (≤ ``max_tokens``) of an earlier match of the
    longest matching suffix; empty when nothing matches. ``match``: which earlier occurrence
    (``recent``, ``earliest``, ``frequent``); ``extend``: copy on periodically past the end of
    the context."""
    if max_tokens <= 0:
        return [], 0
    context = np.asarray(token_ids, dtype=np.int64)
    length = context.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        # windows starting at 0 .. length-n-1: each is followed by at least one token
        windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)  # [length - n, n]
        starts = np.flatnonzero((windows == context[-n:]).all(axis=1))
        if starts.size:
            if match == "frequent":
                return _majority_path(context, starts + n, max_tokens, extend), n
            begin = int(starts[0] if match == "earliest" else starts[-1]) + n
            return _copy(begin, length, max_tokens, extend), n
    return [], 0


def _copy(begin: int, length: int, max_tokens: int, extend: bool) -> list[int]:
    """Indices ``begin, begin + 1, ...``; past the end, periodically (LZ77) or not at all."""
    if not extend:
        return list(range(begin, min(length, begin + max_tokens)))
    period = length - begin  # the continuation runs into the suffix: copy it on, LZ77-style
    return [begin + step % period for step in range(max_tokens)]


def _majority_path(context: np.ndarray, begins: np.ndarray, max_tokens: int, extend: bool) -> list[int]:
    """Copy from the match whose continuation most matches share: token by token, keep the matches
    that agree with the most frequent next token (ties: the most recent match's token) while more
    than one is left; then copy from the most recent of them as ``_copy`` does."""
    length = context.shape[0]
    step = 0
    while step < max_tokens:
        alive = begins[begins + step < length]
        if alive.size <= 1:
            break
        tokens = context[alive + step]
        values, counts = np.unique(tokens, return_counts=True)
        chosen = tokens[np.isin(tokens, values[counts == counts.max()])][-1]
        begins = alive[tokens == chosen]
        step += 1
    alive = begins[begins + step < length]
    return _copy(int((alive if alive.size else begins)[-1]), length, max_tokens, extend)


def ngram_lookup(
    token_ids: list[int], max_tokens: int, max_ngram: int, min_ngram: int, match: str = "recent", extend: bool = True
) -> list[int]:
    """Continuation (≤ ``max_tokens`` tokens) of an earlier match of the longest matching suffix."""
    indices = longest_match(token_ids, max_tokens, max_ngram, min_ngram, match, extend)[0]
    return [token_ids[index] for index in indices]


def copy_sources(indices: list[int], prompt_length: int) -> tuple[str, ...]:
    """Each copied token's provenance: from the prompt or from the generated output."""
    return tuple(PROMPT_COPY if index < prompt_length else OUTPUT_COPY for index in indices)


@dataclass
class NgramDrafter:
    """Prompt lookup; the draft is built on ``device``, the device of the model that checks it."""

    config: NgramConfig = field(default_factory=NgramConfig)
    name: str = "ngram"
    prompt_length: int = 0  # per generation: tells prompt copies from output copies
    device: torch.device | str = "cpu"

    def reset(self, prompt_ids: list[int]) -> None:
        """The lookup reads the committed tokens passed to ``propose``; only the prompt's length is kept."""
        self.prompt_length = len(prompt_ids)

    def propose(
        self,
        token_ids: list[int],
        num_draft_tokens: int,
        sampling: SamplingConfig,
        draws: Draws | None,
    ) -> Draft:
        config = self.config
        indices, matched = longest_match(
            token_ids, num_draft_tokens, config.max_ngram, config.min_ngram, config.match, config.extend
        )
        tokens = [token_ids[index] for index in indices]
        draft_tokens = torch.tensor(tokens, dtype=torch.long, device=self.device)  # [k], one host-to-device copy
        return Draft(draft_tokens, sources=copy_sources(indices, self.prompt_length), match_length=matched)

    def rollback(self, num_committed: int) -> None:
        """Stateless: nothing to roll back."""

    def finish(self, token_ids: list[int]) -> None:
        """Stateless: nothing to remember."""

    def report(self) -> dict[str, Any]:
        return {}
