"""Plain autoregressive decoding: one target forward per token.

The reference that lossless verifiers must reproduce token for token, and the denominator of
every speedup. It shares the target wrapper, tokenizer handling, stopping and statistics with
the speculative loop, so only the drafting and verification differ.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from flyspec.decoding.generation import Decoder, Generation
from flyspec.decoding.streaming import Step
from flyspec.sampling.coupled import choose_tokens


class PlainDecoder(Decoder):
    """Autoregressive decoding with the same interface as :class:`SpeculativeDecoder`."""

    def _steps(self, generation: Generation) -> Iterator[Step]:
        self._prefill(generation)
        token_ids, sampling = generation.token_ids, generation.config.sampling
        no_draft = torch.empty(0, dtype=torch.long, device=self.device)
        while not generation.finished:
            with generation.stats.timing("target", self.device):
                logits = self.scorer.score(token_ids[-1], no_draft)  # [1, vocab]
            committed = generation.commit([int(choose_tokens(logits, sampling, generation.draws())[0])])
            self.scorer.rollback(token_ids)
            yield committed, ()
