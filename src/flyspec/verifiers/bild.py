"""BiLD's rollback policy (Kim et al., "Speculative Decoding with Big Little Decoder", arXiv 2302.07863). Lossy.

BiLD's large model checks the small model's tokens in one forward and rolls back from the first token whose
distance to its own prediction is above ``α_RB``, the distance being the cross-entropy between the small
model's hard choice and the large model's distribution: ``d_i = -log target_probs[i, d_i]`` (its rollback
policy). A draft token is kept while ``d_i <= rollback_threshold``; at the first one above it the target's own
token is committed. The target's probabilities are the softmax of its raw logits (temperature 1), as in the
paper, whose decoding is greedy.

A draft token the target itself chose is always kept here: BiLD would roll back at a low-probability match
too, but the large model then writes the very same token and the small model drafts on from the same prefix,
so the output is the same. The loose accepts are the mismatches with ``d_i <= rollback_threshold``.

Base rule: exact match when greedy. At T>0 (flyspec's extension; the paper decodes greedily) the rule relaxes
exact match on the target's coupled sample (plain sampling's token for the seed, ``sampling/coupled.py``): a
mismatching draft token within the threshold is kept, at the others the sample is committed. BiLD's *fallback*
policy (the small model hands over when its own top probability falls below ``α_FB``) decides how long a draft
is, not which tokens to keep: it is not part of this verifier.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flyspec.config import BildConfig, SamplingConfig
from flyspec.sampling.acceptance import where_needed
from flyspec.verifiers.base import GREEDY, LooseRule


def rollback_distance(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """``[k]``: ``-log target_probs[i, d_i]`` at temperature 1, BiLD's rollback distance (nats)."""
    log_probs = torch.log_softmax(target_logits[: draft_tokens.shape[0]].float(), dim=-1)  # [k, vocab]
    return -log_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)


@dataclass(frozen=True)
class BildVerifier(LooseRule):
    config: BildConfig = field(default_factory=BildConfig)
    name: str = "bild"

    def candidates(
        self,
        base_accept: torch.Tensor,
        draft_tokens: torch.Tensor,
        target_logits: torch.Tensor,
        sampling: SamplingConfig = GREEDY,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``([k] bool, [k])``: the mismatches within the rollback threshold, and the distance there (NaN where
        the base rule accepted)."""
        tokens = draft_tokens

        def distance(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return rollback_distance(tokens[positions], rows)

        measured = where_needed(~base_accept, target_logits, distance, float("nan"))
        return ~base_accept & (measured <= self.config.rollback_threshold), measured
