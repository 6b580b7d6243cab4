"""Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023). Lossless at any T.

Draft token ``d_i`` drawn from ``draft_probs[i]`` is accepted with probability
``min(1, target_probs[i, d_i] / draft_probs[i, d_i])``. At the first rejection the recovered
token is sampled from the residual ``normalize(max(0, target_probs[i] - draft_probs[i]))``; when
all are accepted, the bonus token is sampled from ``target_probs[k]``. N-gram drafts are
deterministic and count as one-hot draft probabilities. Greedy (T=0) this reduces to exact match,
which is what runs (no random numbers are drawn).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flyspec.acceptance import draft_probs_or_one_hot, exact_accept_mask, rejection_accept_mask, rejection_next_token
from flyspec.config import SamplingConfig
from flyspec.sampling import logits_to_probs, uniform
from flyspec.types import Draft, Verdict, VerifyContext
from flyspec.verifiers.base import NextToken, build_verdict


def strict_base_rule(
    draft: Draft,
    target_logits: torch.Tensor,  # [k + 1, vocab]
    sampling: SamplingConfig,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, NextToken]:
    """The lossless rule the lossy verifiers relax: exact match on the argmax when greedy,
    rejection sampling at T>0. Returns the ``[k]`` acceptance mask and the recovered (residual)
    or bonus token: the ``[k + 1]`` argmaxes when greedy, ``position -> token`` at T>0."""
    if sampling.greedy:
        target_tokens = target_logits.argmax(-1)  # [k + 1]
        return exact_accept_mask(draft.tokens, target_tokens), target_tokens
    target_probs = logits_to_probs(target_logits, sampling)  # [k + 1, vocab]
    draft_probs = draft_probs_or_one_hot(draft, target_probs.shape[-1])  # [k, vocab]
    uniforms = uniform((draft.num_tokens,), generator, target_logits.device)  # [k]
    accept = rejection_accept_mask(draft.tokens, draft_probs, target_probs, uniforms)
    return accept, lambda n: rejection_next_token(n, target_probs, draft_probs, generator)


@dataclass(frozen=True)
class RejectionVerifier:
    name: str = "rejection"

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
        accept, next_token = strict_base_rule(draft, target_logits, sampling, generator)
        return build_verdict(draft.tokens, accept, torch.zeros_like(accept), next_token)
