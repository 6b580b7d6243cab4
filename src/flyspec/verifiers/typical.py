"""Typical acceptance (Medusa, Cai et al. 2024, §2.3.1). Lossy.

Keep draft token ``d_i`` when ``target_probs[i, d_i] > min(epsilon, delta * exp(-H_i))``, where
``H_i`` is the entropy of ``target_probs[i]``. The target's argmax always passes (its
probability is at least ``exp(-H)``). ``target_probs`` are at the sampling temperature, or at
temperature 1 when decoding greedily: at T=0 every distribution is one-hot and the rule would
collapse to exact match. The token after the accepted prefix is the target's argmax (greedy)
or a sample from ``target_probs`` (T>0). A loose accept is a kept token that is not the
target's argmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from flyspec.config import SamplingConfig, TypicalConfig
from flyspec.sampling import choose_tokens, logits_to_probs
from flyspec.types import Draft, Verdict
from flyspec.verifiers.base import build_verdict
from flyspec.verifiers.guard import guard_loose_mask


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
class TypicalVerifier:
    config: TypicalConfig = field(default_factory=TypicalConfig)
    name: str = "typical"
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
        k = draft.num_tokens
        criterion_sampling = replace(sampling, temperature=1.0) if sampling.greedy else sampling
        target_probs = logits_to_probs(target_logits, criterion_sampling)  # [k + 1, vocab]
        greedy_match = draft.tokens == target_logits[:k].argmax(-1)
        accept = typical_accept_mask(draft.tokens, target_probs, self.config.epsilon, self.config.delta)
        loose = guard_loose_mask(accept & ~greedy_match, draft.tokens, target_logits, self.protected)
        target_tokens = choose_tokens(target_logits, sampling, generator)  # [k + 1]
        return build_verdict(draft.tokens, greedy_match | loose, loose, lambda n: target_tokens[n])
