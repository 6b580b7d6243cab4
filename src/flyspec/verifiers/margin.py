"""MARS margin-aware verification (arXiv 2601.15498). Lossy.

At a position the base rule rejects, keep the draft token when it is the target's *second*
choice and the target's top-2 logits are close ("low margin"): the target hardly prefers its top
choice. Closeness is ``z2 / z1 > logit_ratio`` (default 0.9) when both logits are positive, as in
the paper. A ratio of logits means nothing when either is <= 0, so there we fall back to the
probability ratio ``p2 / p1 = exp(z2 - z1) > logit_ratio`` (temperature-free, i.e. a logit gap
below ``-ln(logit_ratio)`` ≈ 0.105 at the default).

Base rule: exact match when greedy, rejection sampling at T>0 (recovered tokens from the
residual, so a position the margin rule does not keep is handled losslessly).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flyspec.config import MarginConfig, SamplingConfig
from flyspec.types import Draft, Verdict
from flyspec.verifiers.base import build_verdict
from flyspec.verifiers.guard import guard_loose_mask
from flyspec.verifiers.rejection import strict_base_rule


def margin_loose_mask(
    draft_tokens: torch.Tensor,  # [k]
    target_logits: torch.Tensor,  # [k (+1), vocab]
    logit_ratio: float,
) -> torch.Tensor:
    """``[k]`` bool: draft token is the target's runner-up and the top-2 margin is small."""
    k = draft_tokens.shape[0]
    logits = target_logits[:k].float()
    top1_token = logits.argmax(-1, keepdim=True)  # the same tie-break as the exact base rule
    top1_logit = logits.gather(-1, top1_token).squeeze(-1)
    # runner-up = best token other than the argmax (topk's order of tied logits may differ from argmax's)
    others = logits.scatter(-1, top1_token, float("-inf"))
    top2_logit, top2_token = others.max(-1)
    both_positive = (top1_logit > 0) & (top2_logit > 0)
    logit_close = top2_logit / torch.where(both_positive, top1_logit, torch.ones_like(top1_logit)) > logit_ratio
    prob_close = torch.exp(top2_logit - top1_logit) > logit_ratio
    close = torch.where(both_positive, logit_close, prob_close)
    return close & (draft_tokens == top2_token)


@dataclass(frozen=True)
class MarginVerifier:
    config: MarginConfig = field(default_factory=MarginConfig)
    name: str = "margin"
    protected: torch.Tensor | None = field(default=None, compare=False, repr=False)  # [vocab] bool, guard.py

    @property
    def lossless(self) -> bool:
        return False

    def verify(
        self,
        draft: Draft,
        target_logits: torch.Tensor,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Verdict:
        base_accept, next_token = strict_base_rule(draft, target_logits, sampling, generator)
        loose = margin_loose_mask(draft.tokens, target_logits, self.config.logit_ratio) & ~base_accept
        loose = guard_loose_mask(loose, draft.tokens, target_logits, self.protected)
        return build_verdict(draft.tokens, base_accept | loose, loose, next_token)
