"""Prompt lookup (n-gram) drafting over the prompt and the generated text.

The last ``n`` committed tokens (``n`` from ``max_ngram`` down to ``min_ngram``) are searched
for earlier in the context; the tokens that followed the *most recent* earlier occurrence are the
draft (recent context predicts repetition better; transformers' prompt lookup and the FLy
reference take the earliest). When that continuation reaches the end of the context it is
extended periodically, as an LZ77 copy that overlaps its own output would: after
``... a b c a b`` the draft is ``c a b c a ...``. No model, no state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from flyspec.config import NgramConfig, SamplingConfig
from flyspec.types import OUTPUT_COPY, PROMPT_COPY, Draft


def ngram_match(token_ids: list[int], max_tokens: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Where the draft is copied from: context indices of the continuation (≤ ``max_tokens``) of an
    earlier match of the longest matching suffix; empty when nothing matches."""
    if max_tokens <= 0:
        return []
    context = np.asarray(token_ids, dtype=np.int64)
    length = context.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        # windows starting at 0 .. length-n-1: each is followed by at least one token
        windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)  # [length - n, n]
        starts = np.flatnonzero((windows == context[-n:]).all(axis=1))
        if starts.size:
            begin = int(starts[-1]) + n
            period = length - begin  # the continuation runs into the suffix: copy it on, LZ77-style
            return [begin + step % period for step in range(max_tokens)]
    return []


def ngram_lookup(token_ids: list[int], max_tokens: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Continuation (≤ ``max_tokens`` tokens) of an earlier match of the longest matching suffix."""
    return [token_ids[index] for index in ngram_match(token_ids, max_tokens, max_ngram, min_ngram)]


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
        generator: torch.Generator | None,
    ) -> Draft:
        indices = ngram_match(token_ids, num_draft_tokens, self.config.max_ngram, self.config.min_ngram)
        tokens = [token_ids[index] for index in indices]
        draft_tokens = torch.tensor(tokens, dtype=torch.long, device=self.device)  # [k], one host-to-device copy
        return Draft(draft_tokens, sources=copy_sources(indices, self.prompt_length))

    def rollback(self, num_committed: int) -> None:
        """Stateless: nothing to roll back."""

    def finish(self, token_ids: list[int]) -> None:
        """Stateless: nothing to remember."""

    def report(self) -> dict[str, Any]:
        return {}
