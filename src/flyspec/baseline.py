"""Plain autoregressive decoding: one target forward per token.

The reference that lossless verifiers must reproduce token for token, and the denominator of
every speedup. It shares the target wrapper, tokenizer handling, stopping and statistics with
the speculative loop, so only the drafting and verification differ.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from flyspec.config import DecodeConfig
from flyspec.decoding import Decoder
from flyspec.sampling import choose_tokens
from flyspec.stats import DecodeStats
from flyspec.stopping import Stopper
from flyspec.streaming import Step


class PlainDecoder(Decoder):
    """Autoregressive decoding with the same interface as :class:`SpeculativeDecoder`."""

    def _steps(
        self,
        prompt_ids: list[int],
        config: DecodeConfig,
        generator: torch.Generator | None,
        stopper: Stopper,
        stats: DecodeStats,
    ) -> Iterator[Step]:
        token_ids = self._prefill(prompt_ids, stats)
        no_draft = torch.empty(0, dtype=torch.long)
        while not stopper.finished:
            started = time.perf_counter()
            logits = self.target.score(token_ids[-1], no_draft)  # [1, vocab]
            stats.target_time_s += time.perf_counter() - started
            committed = stopper.commit([int(choose_tokens(logits[0], config.sampling, generator))])
            token_ids += committed
            stats.observe(0, None, len(committed))
            self.target.rollback(len(token_ids))
            yield committed, ()
