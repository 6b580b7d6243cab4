"""MARS margin-aware verification (arXiv 2601.15498). Lossy.

Where the target's top-2 logits are close ("low margin") the target hardly prefers its top choice,
so a draft token that is *either* of the two is kept. Closeness is ``z2 / z1 > logit_ratio``
(default 0.9) when both logits are positive, as in the paper. A ratio of logits means nothing when
either is <= 0, so there we fall back to the probability ratio ``p2 / p1 = exp(z2 - z1) >
logit_ratio`` (temperature-free, i.e. a logit gap below ``-ln(logit_ratio)`` ≈ 0.105 at the default).

Base rule: exact match on the target's own choice (its argmax when greedy, its coupled sample at T>0: plain
sampling's token for the seed, ``sampling/coupled.py``), which is also the token committed at a position the margin
rule does not keep. When greedy only the runner-up can be a mismatch; at T>0 the sample is another token than the
top-1 part of the time, and MARS keeps the top-1 there too (the reference keeps "top-1 or top-2" at a low-margin
position).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flyspec.config import MarginConfig, SamplingConfig
from flyspec.sampling.acceptance import where_needed
from flyspec.verifiers.base import GREEDY, LooseRule


def margin_closeness(target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[n, vocab]`` → ``(closeness, top1_token, top2_token)``, each ``[n]``; see the module docstring."""
    logits = target_logits.float()
    top1_token = logits.argmax(-1, keepdim=True)  # the same tie-break as the exact base rule
    top1_logit = logits.gather(-1, top1_token).squeeze(-1)
    # runner-up = best token other than the argmax (topk's order of tied logits may differ from argmax's)
    others = logits.scatter(-1, top1_token, float("-inf"))
    top2_logit, top2_token = others.max(-1)
    both_positive = (top1_logit > 0) & (top2_logit > 0)
    logit_ratio = top2_logit / torch.where(both_positive, top1_logit, torch.ones_like(top1_logit))
    closeness = torch.where(both_positive, logit_ratio, torch.exp(top2_logit - top1_logit))
    return closeness, top1_token.squeeze(-1), top2_token


def margin_loose_mask(
    draft_tokens: torch.Tensor,  # [k]
    target_logits: torch.Tensor,  # [k (+1), vocab]
    logit_ratio: float,
) -> torch.Tensor:
    """``[k]`` bool: the margin is small and the draft token is the target's top-1 or top-2."""
    closeness, top1_token, top2_token = margin_closeness(target_logits[: draft_tokens.shape[0]])
    return (closeness > logit_ratio) & ((draft_tokens == top1_token) | (draft_tokens == top2_token))


@dataclass(frozen=True)
class MarginVerifier(LooseRule):
    config: MarginConfig = field(default_factory=MarginConfig)
    name: str = "margin"

    def candidates(
        self,
        base_accept: torch.Tensor,
        draft_tokens: torch.Tensor,
        target_logits: torch.Tensor,
        sampling: SamplingConfig = GREEDY,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``([k] bool, [k])``: the mismatches this rule would keep before the guards, and the closeness there
        (NaN at the positions the base rule accepted: measured only where a loose accept could be)."""
        tokens, ratio = draft_tokens, self.config.logit_ratio
        closeness = where_needed(~base_accept, target_logits, lambda rows, _: margin_closeness(rows)[0], float("nan"))

        def kept(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return margin_loose_mask(tokens[positions], rows, ratio)

        return where_needed(~base_accept, target_logits, kept, False), closeness
