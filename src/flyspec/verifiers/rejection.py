"""Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023). Lossless at any T.

Draft token ``d_i`` drawn from ``draft_probs[i]`` is accepted with probability
``min(1, target_probs[i, d_i] / draft_probs[i, d_i])``. At the first rejection the recovered
token is sampled from the residual ``normalize(max(0, target_probs[i] - draft_probs[i]))``; when
all are accepted, the bonus token is sampled from ``target_probs[k]``. Every draw is keyed by its position
(``sampling/coupled.py``), so the text is a function of the seed and the drafter, whatever the draft length.

Where it differs from ``exact``: only for a draft model's sampled drafts (``draft_probs``), where it accepts
``1 − TV(target, draft)`` of the tokens per position against the Gumbel coupling's fewer, at the price of not
committing plain sampling's text (measured: ``docs/concepts/sampling.md``). N-gram drafts are deterministic, one-hot
draft probabilities: rejection sampling accepts ``d`` with probability ``target_probs[d]`` and then draws from the
target without ``d``, which is what exact match against the coupled sample does, so that is what runs (and it
commits plain sampling's text). Greedy (T=0) it is exact match too (no random numbers are drawn).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flyspec.config import SamplingConfig
from flyspec.sampling.coupled import Draws
from flyspec.types import Draft
from flyspec.verifiers.base import NextToken, StrictRule, rejection_rule
from flyspec.verifiers.base import strict_base_rule as strict_base_rule  # re-exported: the rule lossy verifiers relax


@dataclass(frozen=True)
class RejectionVerifier(StrictRule):
    name: str = "rejection"

    def strict(
        self, draft: Draft, target_logits: torch.Tensor, sampling: SamplingConfig, draws: Draws | None
    ) -> tuple[torch.Tensor, NextToken]:
        return rejection_rule(draft, target_logits, sampling, draws, prefix_only=True)
