"""Block verification (Sun, Mendlovic, Leviathan, Aharoni, Beirami, Ro, Suresh; arXiv 2403.10444). Lossless.

Rejection sampling judges draft tokens one at a time; block verification judges the draft as a block and accepts
at least as many tokens in expectation while its output is still distributed exactly as the target's. With
``M_b`` and ``M_s`` the target's and the drafter's distributions at each position (``target_probs`` and
``draft_probs``; one-hot for deterministic drafts) and ``x_1 .. x_k`` the draft:

- ``p_0 = 1``, ``p_i = min(1, p_{i-1} · M_b(x_i) / M_s(x_i))``: how far the block's joint ratio holds up;
- for ``i < k``: ``h_i = R_{i+1} / (R_{i+1} + 1 − p_i)`` with the residual mass
  ``R_{i+1} = Σ_x max(p_i · M_b(x) − M_s(x), 0)`` at position ``i + 1`` (1 where the denominator is 0);
  ``h_k = p_k``;
- one uniform ``u_i`` per position: the accepted length τ is the *largest* i with ``u_i <= h_i`` (0 if none);
- the token after it is drawn from ``normalize(max(p_τ · M_b − M_s, 0))`` at position τ + 1 (τ < k), or from
  ``M_b`` after the draft (τ = k, the bonus).

Written from vLLM 0.32's kernels (``v1/worker/gpu/spec_decode/rejection_sampler_utils.py``: the
``USE_BLOCK_VERIFICATION`` branches, ``rejection_sample_method="block"``), which cite the paper. Greedy (T = 0)
it is exact match, which is what runs (no random numbers are drawn). At T > 0 its uniforms and tokens come from the
generation's ``torch.Generator``, not the position-keyed noise (``sampling/coupled.py``): its text depends on the
draft length; :func:`block_accepted_length` is the
statistical test's subject (``tests/test_block_verification.py``: it reproduces the target's distribution).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flyspec.config import SamplingConfig
from flyspec.sampling.acceptance import draft_probs_or_one_hot
from flyspec.sampling.coupled import Draws
from flyspec.sampling.sampler import logits_to_probs, sample, uniform
from flyspec.types import Draft
from flyspec.verifiers.base import NextToken, StrictRule, strict_base_rule


def block_accepted_length(
    draft_tokens: torch.Tensor,  # [k]
    draft_probs: torch.Tensor,  # [k, vocab]
    target_probs: torch.Tensor,  # [k + 1, vocab]
    uniforms: torch.Tensor,  # [k]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``([k] bool, [k + 1])``: the acceptance mask (the first τ positions) and ``p_0 .. p_k``."""
    k = draft_tokens.shape[0]
    if k == 0:
        return torch.zeros(0, dtype=torch.bool, device=target_probs.device), torch.ones(1, device=target_probs.device)
    index = draft_tokens.unsqueeze(-1)
    ratio = target_probs[:k].gather(-1, index).squeeze(-1) / draft_probs.gather(-1, index).squeeze(-1).clamp_min(1e-20)
    joint = [torch.ones((), device=target_probs.device)]
    for i in range(k):  # p_i = min(1, p_{i-1} * ratio_i): a running product capped at 1 (k is small)
        joint.append(torch.clamp(joint[-1] * ratio[i], max=1.0))
    p = torch.stack(joint)  # [k + 1]
    # residual mass at positions 1 .. k - 1 (0-based rows), each scaled by the joint ratio before it
    residual = (p[1:k].unsqueeze(-1) * target_probs[1:k] - draft_probs[1:k]).clamp_min(0).sum(-1)  # [k - 1]
    denominator = residual + 1.0 - p[1:k]
    safe = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    h = torch.cat([torch.where(denominator > 0, residual / safe, torch.ones_like(residual)), p[k:]])  # [k]
    passing = uniforms <= h  # [k]
    # the largest passing length: positions 0 .. τ - 1 accepted
    lengths = torch.arange(1, k + 1, device=target_probs.device)
    tau = torch.where(passing, lengths, torch.zeros_like(lengths)).amax()
    return torch.arange(k, device=target_probs.device) < tau, p


def block_next_token(
    n: int,
    joint: torch.Tensor,  # [k + 1], p_0 .. p_k
    target_probs: torch.Tensor,  # [k + 1, vocab]
    draft_probs: torch.Tensor,  # [k, vocab]
    generator: torch.Generator | None,
) -> int:
    """The token after τ = ``n`` accepted ones: from the scaled residual at a rejection, from the target after all."""
    if n == draft_probs.shape[0]:
        return int(sample(target_probs[n], generator))
    residual = (joint[n] * target_probs[n] - draft_probs[n]).clamp_min(0)
    total = residual.sum()
    # a zero residual happens only where the target and the draft agree exactly (then any draw is the target's)
    return int(sample(torch.where(total > 0, residual / total.clamp_min(1e-30), target_probs[n]), generator))


@dataclass(frozen=True)
class BlockVerifier(StrictRule):
    name: str = "block"

    def strict(
        self, draft: Draft, target_logits: torch.Tensor, sampling: SamplingConfig, draws: Draws | None
    ) -> tuple[torch.Tensor, NextToken]:
        if sampling.greedy:
            return strict_base_rule(draft, target_logits, sampling, draws)  # exact match, no draws
        assert draws is not None, "sampling draws"
        # fresh draws from the generation's generator: tau depends on every position's uniform, so a position's
        # draw is looked at before that position is committed and must not be drawn again (sampling/coupled.py)
        generator = draws.generator
        target_probs = logits_to_probs(target_logits, sampling)  # [k + 1, vocab]
        draft_probs = draft_probs_or_one_hot(draft, target_probs.shape[-1])  # [k, vocab]
        uniforms = uniform((draft.num_tokens,), generator, target_logits.device)  # [k]
        accept, joint = block_accepted_length(draft.tokens, draft_probs, target_probs, uniforms)
        return accept, lambda n: block_next_token(n, joint, target_probs, draft_probs, generator)
