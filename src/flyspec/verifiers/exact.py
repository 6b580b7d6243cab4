"""Exact match: keep a draft token only if it equals the target's own choice. Lossless.

Greedy (T=0) the target's choice is its argmax, which is standard greedy speculative decoding.
At T>0 the target's choice at every position is a sample from its distribution and the first
mismatch commits that sample: every committed token is a target sample, so the output
distribution equals plain sampling (lower acceptance than rejection sampling, but lossless for
any drafter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flyspec.config import SamplingConfig
from flyspec.sampling.acceptance import exact_accept_mask
from flyspec.sampling.sampler import choose_tokens
from flyspec.types import Draft
from flyspec.verifiers.base import NextToken, StrictRule


@dataclass(frozen=True)
class ExactVerifier(StrictRule):
    name: str = "exact"

    def strict(
        self, draft: Draft, target_logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, NextToken]:
        target_tokens = choose_tokens(target_logits, sampling, generator)  # [k + 1]
        return exact_accept_mask(draft.tokens, target_tokens), target_tokens
