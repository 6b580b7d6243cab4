"""Speculative cascades' deferral rules (Narasimhan et al., "Faster Cascades via Speculative Decoding",
arXiv 2405.19261; the authors' notebook: google-research ``speculative_cascades``). Selective classification: at
each draft position a rule decides whether to *defer* to the target; where it does not, the draft model's token
stands. With q and p the draft model's and the target's distributions at temperature 1 and ``lenience`` α:

``chow`` (Chow's rule)
    defer when ``max q < 1 − α``: the draft model is not confident enough;
``diff``
    defer when ``max q < max p − α``: the target is more confident than the draft by more than α;
``opt`` (the optimal rule's plug-in estimate)
    defer when ``max q < max p − α · TV(p, q)``, with ``TV(p, q) = ½ Σ |p − q|``.

Verification is speculative sampling against ``π = q`` where the rule does not defer and ``π = p`` where it does
(the paper's ``π = (1 − r)·q + r·p``): a draft token at a position that is not deferred is always kept, one at a
deferred position is judged by the lossless rule (greedy: it must be the target's argmax, else the argmax is
committed; T > 0: it must be the target's coupled sample, plain sampling's token for the seed, else that sample
is committed: ``sampling/coupled.py``). In flyspec's terms the
strict rule is :func:`~flyspec.verifiers.base.strict_base_rule`, and the loose accepts are its rejections at the
positions the rule does not defer. The rule's evidence at a loose accept is ``max q``, the draft's confidence.

Needs the draft model's distribution (``Draft.draft_distribution``): a draft model of the target's tokenizer,
or layer-skip (the target's own skip view exits through its norm and head).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flyspec.config import CascadeConfig, SamplingConfig
from flyspec.sampling.acceptance import where_needed
from flyspec.sampling.coupled import Draws
from flyspec.types import Draft
from flyspec.verifiers.base import GREEDY, LooseRule
from flyspec.verifiers.distributions import (
    draft_distribution,
    no_plugin_candidates,
    target_distribution,
    total_variation,
)


def defers(target_probs: torch.Tensor, draft_probs: torch.Tensor, rule: str, lenience: float) -> torch.Tensor:
    """``[n]`` bool: the rule defers to the target (``[n, vocab]`` distributions at temperature 1)."""
    draft_top = draft_probs.amax(-1)
    if rule == "chow":
        return draft_top < 1.0 - lenience
    target_top = target_probs.amax(-1)
    if rule == "diff":
        return draft_top < target_top - lenience
    return draft_top < target_top - lenience * total_variation(target_probs, draft_probs)  # opt


@dataclass(frozen=True)
class CascadeVerifier(LooseRule):
    config: CascadeConfig = field(default_factory=CascadeConfig)
    name: str = "cascade"

    def judge(
        self,
        base_accept: torch.Tensor,
        draft: Draft,
        target_logits: torch.Tensor,
        sampling: SamplingConfig,
        draws: Draws | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``([k] bool, [k])``: the rejections at positions the rule does not defer, and ``max q`` there."""
        distribution = draft_distribution(draft, self.name, target_logits.shape[-1])  # [k, vocab]
        rule, lenience = self.config.rule, self.config.lenience

        def kept(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return ~defers(target_distribution(rows), distribution[positions], rule, lenience)

        def confidence(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return distribution[positions].amax(-1)

        rejected = ~base_accept
        return (
            where_needed(rejected, target_logits, kept, False),
            where_needed(rejected, target_logits, confidence, float("nan")),
        )

    def candidates(
        self,
        base_accept: torch.Tensor,
        draft_tokens: torch.Tensor,
        target_logits: torch.Tensor,
        sampling: SamplingConfig = GREEDY,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise no_plugin_candidates(self.name)
