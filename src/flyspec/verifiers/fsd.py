"""Fuzzy speculative decoding, FSD (Holsman, Huang, Dhingra, arXiv 2502.20704; code: its authors' ``fsd_utils.py``).

FSD keeps a draft token while the *distributions* of the two models agree there, whichever token was drafted: at
each draft position the divergence between the target's next-token distribution p and the draft model's q (both
the softmax of raw logits, temperature 1, as the official code computes them) must be at most ``threshold``; at
the first position above it the target's own token is committed. Divergences (``FsdConfig.divergence``): ``js``
(Jensen-Shannon in nats, the README's example), ``kl`` (the official code's ``kl_div``, KL(draft || target)),
``tv`` (total variation).

In flyspec's terms the strict rule is exact match against the target's own choice (its argmax; its coupled sample
at T > 0, :func:`~flyspec.verifiers.base.strict_base_rule`), and the loose accepts are the mismatches within the
threshold. A matching token is kept even where the divergence is above it: FSD would end the step there, commit
the target's choice (the same token) and draft on from the same prefix, so the output is the same and only the
step boundary moves. Two differences from the
official code: greedy, the committed token is the target's argmax (the code samples it even with sampling off),
and its JS is the textbook one (the code's ``js_div`` averages KL(m || p) and KL(m || q), an unbounded variant),
so its thresholds are not interchangeable with ours.

Needs the draft model's distribution (``Draft.draft_distribution``): a draft model of the target's tokenizer,
or layer-skip (the target's own skip view exits through its norm and head).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flyspec.config import FsdConfig, SamplingConfig
from flyspec.sampling.acceptance import where_needed
from flyspec.sampling.coupled import Draws
from flyspec.types import Draft
from flyspec.verifiers.base import GREEDY, LooseRule
from flyspec.verifiers.distributions import divergence, draft_distribution, no_plugin_candidates, target_distribution


@dataclass(frozen=True)
class FsdVerifier(LooseRule):
    config: FsdConfig = field(default_factory=FsdConfig)
    name: str = "fsd"

    def judge(
        self,
        base_accept: torch.Tensor,
        draft: Draft,
        target_logits: torch.Tensor,
        sampling: SamplingConfig,
        draws: Draws | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``([k] bool, [k])``: the mismatches whose divergence is within the threshold, and the divergence there."""
        distribution = draft_distribution(draft, self.name, target_logits.shape[-1])  # [k, vocab]
        kind = self.config.divergence

        def measure(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return divergence(target_distribution(rows), distribution[positions], kind)

        measured = where_needed(~base_accept, target_logits, measure, float("nan"))
        return ~base_accept & (measured <= self.config.threshold), measured

    def candidates(
        self,
        base_accept: torch.Tensor,
        draft_tokens: torch.Tensor,
        target_logits: torch.Tensor,
        sampling: SamplingConfig = GREEDY,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise no_plugin_candidates(self.name)
