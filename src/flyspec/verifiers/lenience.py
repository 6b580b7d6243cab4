"""Leviathan et al.'s lenience (lossy speculative sampling; arXiv 2211.17192, appendix A.5 "Lenience").

"We could include a lenience parameter l ∈ [0, 1] and multiply q(x) by l before comparing with p(x)": a draft
token x drawn from q is kept with probability ``min(1, p(x) / (l·q(x)))`` instead of ``min(1, p(x) / q(x))``, so
that no token is emitted with probability above ``p(x) / l``. Greedy, the appendix keeps x when
``p(x) >= l·max p`` (its text prints ``<=``, which would keep the unlikely tokens and refuse the argmax: a typo).
``l = 1`` is plain speculative decoding; smaller keeps more.

p and q: greedy, the target's softmax at temperature 1 (at T = 0 every distribution is one-hot and the rule would
be exact match); at T > 0 the distributions decoding samples from (``target_probs``), and the drafter's
``draft_probs`` (one-hot for n-gram drafts, so a copied token is kept with probability ``min(1, p(x) / l)``). The
appendix leaves the token after a rejection open; as the speculative-cascades authors' notebook does, it is drawn
from the usual residual ``max(0, p − q)``.

In flyspec's terms the strict rule is rejection sampling (:func:`~flyspec.verifiers.base.rejection_rule`: for
deterministic drafts, exact match on the target's coupled sample, which rejects x with the same probability) and a
loose accept is a token it rejects that lenience keeps. At T > 0 that is one more draw: given that rejection
sampling rejected x (its uniform u ≥ p/q), u is uniform on [p/q, 1), so lenience keeps x with probability
``(min(1, p/(l·q)) − p/q) / (1 − p/q)``, drawn from a stream of its own keyed by the position
(``sampling/coupled.py``). Needs only the target's logits (and the
draft's probabilities, which every drafter gives): works with n-gram drafts and in the vLLM plugin (greedy).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flyspec.config import LenienceConfig, SamplingConfig
from flyspec.sampling.acceptance import draft_probs_or_one_hot, where_needed
from flyspec.sampling.coupled import LENIENCE, Draws
from flyspec.sampling.sampler import logits_to_probs
from flyspec.types import Draft
from flyspec.verifiers.base import GREEDY, LooseRule, NextToken, rejection_rule


def top_ratio(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """``[k]``: ``p(x) / max p`` at temperature 1 (``exp(z_x − z_max)``)."""
    logits = target_logits[: draft_tokens.shape[0]].float()
    return torch.exp(logits.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1) - logits.amax(-1))


@dataclass(frozen=True)
class LenienceVerifier(LooseRule):
    config: LenienceConfig = field(default_factory=LenienceConfig)
    name: str = "lenience"

    def strict(
        self, draft: Draft, target_logits: torch.Tensor, sampling: SamplingConfig, draws: Draws | None
    ) -> tuple[torch.Tensor, NextToken]:
        return rejection_rule(draft, target_logits, sampling, draws)

    def candidates(
        self,
        base_accept: torch.Tensor,
        draft_tokens: torch.Tensor,
        target_logits: torch.Tensor,
        sampling: SamplingConfig = GREEDY,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy: ``([k] bool, [k])``, the mismatches with ``p(x) >= l·max p``, and ``p(x) / max p`` there."""
        tokens = draft_tokens

        def ratio(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return top_ratio(tokens[positions], rows)

        measured = where_needed(~base_accept, target_logits, ratio, float("nan"))
        return ~base_accept & (measured >= self.config.lenience), measured

    def judge(
        self,
        base_accept: torch.Tensor,
        draft: Draft,
        target_logits: torch.Tensor,
        sampling: SamplingConfig,
        draws: Draws | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """At T > 0: the rejections lenience keeps (one draw each, see the module docstring), and ``p(x) / q(x)``."""
        if sampling.greedy:
            return self.candidates(base_accept, draft.tokens, target_logits, sampling)
        k = draft.num_tokens
        target_probs = logits_to_probs(target_logits[:k], sampling)  # [k, vocab]
        draft_probs = draft_probs_or_one_hot(draft, target_probs.shape[-1])  # [k, vocab]
        index = draft.tokens.unsqueeze(-1)
        ratio = target_probs.gather(-1, index).squeeze(-1) / draft_probs.gather(-1, index).squeeze(-1).clamp_min(1e-20)
        strict = ratio.clamp(max=1.0)
        lenient = (ratio / self.config.lenience).clamp(max=1.0)
        chance = (lenient - strict) / (1.0 - strict).clamp_min(1e-20)  # given the rejection
        assert draws is not None, "sampling draws"
        chances = draws.uniforms(k, LENIENCE)  # [k]
        rejected = ~base_accept
        return rejected & (chances < chance), torch.where(rejected, ratio, torch.full_like(ratio, float("nan")))
