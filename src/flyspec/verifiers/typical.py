"""Typical acceptance (Medusa, Cai et al. 2024, §2.3.1). Lossy.

Keep draft token ``d_i`` when ``target_probs[i, d_i] > min(epsilon, delta * exp(-H_i))``, where
``H_i`` is the entropy of ``target_probs[i]``. The target's argmax always passes (its
probability is at least ``exp(-H)``). ``target_probs`` are at the sampling temperature, or at
temperature 1 when decoding greedily: at T=0 every distribution is one-hot and the rule would
collapse to exact match. The strict base is exact match on the target's own choice (its argmax greedy, its
coupled sample at T > 0: plain sampling's token for the seed), which is also the token after the accepted prefix;
a loose accept is a kept token that is not that choice (at T > 0 the argmax, where the sample was another token,
is one).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from flyspec.config import SamplingConfig, TypicalConfig
from flyspec.sampling.acceptance import where_needed
from flyspec.sampling.sampler import logits_to_probs
from flyspec.verifiers.base import GREEDY, LooseRule


def typical_accept_mask(
    draft_tokens: torch.Tensor,  # [k]
    target_probs: torch.Tensor,  # [k (+1), vocab]
    epsilon: float,
    delta: float,
) -> torch.Tensor:
    """``[k]`` bool: ``target_probs[i, d_i] > min(epsilon, delta * exp(-entropy_i))``."""
    probs = target_probs[: draft_tokens.shape[0]]
    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
    threshold = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))
    return probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1) > threshold


@dataclass(frozen=True)
class TypicalVerifier(LooseRule):
    config: TypicalConfig = field(default_factory=TypicalConfig)
    name: str = "typical"

    def candidates(
        self,
        base_accept: torch.Tensor,  # [k] bool: the draft token is the target's choice
        draft_tokens: torch.Tensor,  # [k]
        target_logits: torch.Tensor,  # [k (+1), vocab]
        sampling: SamplingConfig = GREEDY,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``([k] bool, [k])``: the mismatches this rule would keep before the guards, and the draft token's
        probability there (at temperature 1 when greedy; NaN where the base rule accepted)."""
        criterion = replace(sampling, temperature=1.0) if sampling.greedy else sampling
        tokens, epsilon, delta = draft_tokens, self.config.epsilon, self.config.delta

        def probability(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return logits_to_probs(rows, criterion).gather(-1, tokens[positions].unsqueeze(-1)).squeeze(-1)

        def kept(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return typical_accept_mask(tokens[positions], logits_to_probs(rows, criterion), epsilon, delta)

        mismatch = ~base_accept
        return (
            where_needed(mismatch, target_logits, kept, False),
            where_needed(mismatch, target_logits, probability, float("nan")),
        )
