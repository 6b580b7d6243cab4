"""Draft-model drafting, plain (``draft-model``) and multi-level (``multilevel``).

``draft-model``: a smaller model with the target's tokenizer proposes tokens one forward at a
time from its own KV cache (rolled back after each verification). Greedy (T=0) it drafts its
argmax; at T>0 it samples from its own filtered distribution and returns those probabilities,
so rejection sampling stays lossless.

``multilevel`` (FLy §"multi-level acceleration"): the drafter is itself sped up. Each round an
n-gram lookup proposes up to ``num_ngram_tokens`` tokens, the draft model checks them in *one*
forward (exact match greedy, rejection sampling against one-hot n-gram proposals at T>0) and
adds its own next token; rounds repeat until ``k`` draft tokens exist. The resulting draft is
distributed exactly as the plain draft model's (greedy: identical tokens), in fewer forwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flyspec.config import NgramConfig, SamplingConfig
from flyspec.drafters.ngram import ngram_lookup
from flyspec.models import LoadedModel
from flyspec.sampling import logits_to_probs, uniform
from flyspec.target import CachedModel
from flyspec.types import Draft
from flyspec.verifiers.base import num_leading_true
from flyspec.verifiers.rejection import rejection_accept_mask, rejection_next_token


def check_proposal(
    proposal: list[int],
    logits: torch.Tensor,  # [len(proposal) + 1, vocab]: the draft model's logits for each slot
    sampling: SamplingConfig,
    generator: torch.Generator | None,
) -> tuple[list[int], torch.Tensor | None]:
    """The draft model's verdict on an n-gram proposal: kept prefix + its own next token, and their probs."""
    proposed = torch.tensor(proposal, dtype=torch.long)
    if sampling.greedy:
        choice = logits.argmax(-1)
        kept = num_leading_true(proposed == choice[: len(proposal)])
        return proposal[:kept] + [int(choice[kept])], None
    model_probs = logits_to_probs(logits, sampling)  # [len + 1, vocab]
    one_hot = torch.nn.functional.one_hot(proposed, model_probs.shape[-1]).float()
    accept = rejection_accept_mask(proposed, one_hot, model_probs, uniform((len(proposal),), generator))
    kept = num_leading_true(accept)
    next_token = rejection_next_token(kept, model_probs, one_hot, generator)
    return proposal[:kept] + [next_token], model_probs[: kept + 1]


@dataclass
class DraftModelDrafter:
    """A separate draft model with its own cache; ``num_ngram_tokens > 0`` makes it multi-level."""

    draft: LoadedModel
    num_ngram_tokens: int = 0
    ngram: NgramConfig = field(default_factory=NgramConfig)
    name: str = "draft-model"
    num_forwards: int = 0  # draft-model forwards in this generation

    def __post_init__(self) -> None:
        self.runner = CachedModel(self.draft)

    def reset(self, prompt_ids: list[int]) -> None:
        self.runner.reset()
        self.num_forwards = 0

    def propose(
        self,
        token_ids: list[int],
        num_draft_tokens: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Draft:
        sequence = list(token_ids)
        drafted: list[int] = []
        probs: list[torch.Tensor] = []
        while len(drafted) < num_draft_tokens:
            room = min(self.num_ngram_tokens, num_draft_tokens - len(drafted) - 1)
            proposal = ngram_lookup(sequence, room, self.ngram.max_ngram, self.ngram.min_ngram)
            pending = sequence[self.runner.cached_length :]  # >= 1 token: the cache lags by one
            logits = self.runner.forward(pending + proposal, logits_to_keep=len(proposal) + 1)
            self.num_forwards += 1
            new_tokens, new_probs = check_proposal(proposal, logits, sampling, generator)
            # proposal tokens beyond the kept prefix are not part of the sequence: drop their cache
            self.runner.crop_to(len(sequence) + len(new_tokens) - 1)
            sequence += new_tokens
            drafted += new_tokens
            if new_probs is not None:
                probs.append(new_probs)
        draft_probs = torch.cat(probs) if probs else None
        return Draft(torch.tensor(drafted, dtype=torch.long), draft_probs)

    def rollback(self, num_committed: int) -> None:
        """Keep the cache of the committed tokens (accepted draft tokens are still valid)."""
        self.runner.crop_to(min(self.runner.cached_length, num_committed - 1))


def multilevel_drafter(
    draft: LoadedModel, num_ngram_tokens: int = 6, ngram: NgramConfig | None = None
) -> DraftModelDrafter:
    """FLy's multi-level drafter: n-gram → draft model (defaults from the FLy reference config)."""
    return DraftModelDrafter(draft, num_ngram_tokens=num_ngram_tokens, ngram=ngram or NgramConfig(), name="multilevel")
