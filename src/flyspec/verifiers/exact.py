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

from flyspec.acceptance import exact_accept_mask
from flyspec.config import SamplingConfig
from flyspec.sampling import choose_tokens
from flyspec.types import Draft, Verdict, VerifyContext
from flyspec.verifiers.base import build_verdict


@dataclass(frozen=True)
class ExactVerifier:
    name: str = "exact"

    @property
    def lossless(self) -> bool:
        return True

    @property
    def min_draft_tokens(self) -> int:
        return 1

    def verify(
        self,
        draft: Draft,
        target_logits: torch.Tensor,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        context: VerifyContext | None = None,
    ) -> Verdict:
        target_tokens = choose_tokens(target_logits, sampling, generator)  # [k + 1]
        accept = exact_accept_mask(draft.tokens, target_tokens)
        return build_verdict(draft.tokens, accept, torch.zeros_like(accept), target_tokens)
