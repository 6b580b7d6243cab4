"""Draft-model drafting, plain (``draft-model``), multi-level (``multilevel``) and stacked (``stack``).

``draft-model``: a smaller model with the target's tokenizer proposes tokens one forward at a
time from its own KV cache (rolled back after each verification). Greedy (T=0) it drafts its
argmax; at T>0 it samples from its own filtered distribution with the target's coupled noise
(``sampling/coupled.py``: the same noise at the same position), so it proposes the target's own sample
wherever the two distributions are close, and returns those probabilities, so rejection sampling stays
lossless. With a ``confidence_threshold`` it stops drafting once its own top probability falls below it
(the token it was unsure of is still proposed).

Multi-level (FLy §"multi-level acceleration", generalised as in Hierarchical Speculative
Decoding): the draft model is itself sped up by a ``proposer`` below it — an n-gram lookup, or
another drafter. Each round the proposer offers up to ``num_proposal_tokens`` tokens, the draft
model checks them in *one* forward (exact match against its own choices: its argmax greedy, its coupled
sample at T>0) and adds its own next token; rounds repeat until ``k`` draft tokens exist. The draft is the
plain draft model's, token for token (greedy, and at T>0 for the same seed), in fewer forwards. A proposer
can itself have a proposer: that is a stack.

Devices: the draft model drafts on its own device (proposals are moved there) and the decoder moves
the draft to the target's. Loaded through a ``Resources`` every model sits on the target's device;
a draft model placed elsewhere by the caller works for greedy decoding, while sampling (T>0) needs
it on the target's device, where the coupled noise is drawn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flyspec.config import DEFAULT_NUM_PROPOSAL_TOKENS, ConfigError, NgramConfig, SamplingConfig
from flyspec.drafters.base import Drafter
from flyspec.drafters.ngram import NgramDrafter
from flyspec.runtime.cached_model import CachedModel
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.sampling.coupled import Draws, choose_tokens
from flyspec.sampling.sampler import logits_to_probs, same_device
from flyspec.types import MODEL, Draft


def check_proposal(
    proposal: Draft,
    logits: torch.Tensor,  # [len(proposal) + 1, vocab]: the draft model's logits for each slot
    sampling: SamplingConfig,
    draws: Draws | None,  # at T > 0, positioned at the proposal's first token
) -> tuple[list[int], torch.Tensor | None]:
    """The draft model's verdict on a proposal: kept prefix + its own next token, and (T > 0) their probs.

    The model's choice at each slot is its argmax (greedy) or its coupled sample (T > 0): the kept prefix is
    where the proposal equals those choices, so the result is token for token what the model drafts alone.
    """
    # the proposal and the model's choices in one device-to-host transfer (one host sync per draft forward)
    n = proposal.num_tokens
    host = torch.cat([proposal.tokens.long(), choose_tokens(logits, sampling, draws)]).tolist()
    tokens, choice = host[:n], host[n:]
    kept = next((i for i in range(n) if tokens[i] != choice[i]), n)
    model_probs = None if sampling.greedy else logits_to_probs(logits[: kept + 1], sampling)  # [kept + 1, vocab]
    return tokens[:kept] + [choice[kept]], model_probs


def first_unsure(logits: torch.Tensor, threshold: float) -> int | None:
    """The first row whose top probability (temperature 1) is below ``threshold``; None if none is."""
    if threshold <= 0:
        return None
    top = torch.softmax(logits.float(), dim=-1).amax(-1)  # [rows]
    unsure = torch.nonzero(top < threshold)
    return int(unsure[0, 0]) if unsure.numel() else None


@dataclass
class DraftModelDrafter:
    """A separate draft model with its own cache; a ``proposer`` below it makes it multi-level."""

    draft_model: LoadedModel
    proposer: Drafter | None = None
    num_proposal_tokens: int = DEFAULT_NUM_PROPOSAL_TOKENS
    confidence_threshold: float = 0.0
    name: str = "draft-model"
    keep_distribution: bool = False  # attach Draft.draft_distribution (rules that compare distributions)

    def __post_init__(self) -> None:
        self.cached_model = CachedModel(self.draft_model, full_history=True)  # rollbacks span several draft forwards
        self.device = self.cached_model.device  # its proposals, drafts and draft probabilities live here
        self._reset_counters()

    def _reset_counters(self) -> None:
        self.num_forwards = 0  # draft-model forwards in this generation
        self.num_proposal_tokens_offered = 0
        self.num_proposal_tokens_kept = 0
        self.num_confidence_stops = 0

    def reset(self, prompt_ids: list[int]) -> None:
        self.cached_model.reset()
        self._reset_counters()
        if self.proposer is not None:
            self.proposer.reset(prompt_ids)

    def propose(
        self,
        token_ids: list[int],
        num_draft_tokens: int,
        sampling: SamplingConfig,
        draws: Draws | None,
    ) -> Draft:
        if not sampling.greedy and draws is not None and not same_device(draws.noise.device, self.device):
            raise ConfigError(
                f"draft model {self.draft_model.name!r} is on {self.device} but the sampling noise on "
                f"{draws.noise.device}: at temperature > 0 a draft model must be on the target's device"
            )
        sequence = list(token_ids)
        drafted: list[int] = []
        probs: list[torch.Tensor] = []
        distributions: list[torch.Tensor] = []  # [kept, vocab] per forward, with keep_distribution
        while len(drafted) < num_draft_tokens:
            proposal = self._proposal(sequence, num_draft_tokens - len(drafted) - 1, sampling, draws)
            pending = sequence[self.cached_model.cached_length :]  # >= 1 token: the cache lags by one
            inputs = torch.cat([torch.tensor(pending, dtype=torch.long, device=self.device), proposal.tokens])
            logits = self.cached_model.forward(inputs, logits_to_keep=proposal.num_tokens + 1)
            self.num_forwards += 1
            here = None if draws is None else draws.at(len(sequence))  # the proposal's first position
            new_tokens, new_probs = check_proposal(proposal, logits, sampling, here)
            self.num_proposal_tokens_kept += len(new_tokens) - 1
            unsure_at = first_unsure(logits[: len(new_tokens)], self.confidence_threshold)
            keep = len(new_tokens) if unsure_at is None else unsure_at + 1
            new_tokens = new_tokens[:keep]
            # proposal tokens beyond the kept prefix are not part of the sequence: drop their cache
            self.cached_model.crop_to(len(sequence) + len(new_tokens) - 1)
            sequence += new_tokens
            drafted += new_tokens
            if new_probs is not None:
                probs.append(new_probs[:keep])
            if self.keep_distribution:
                distributions.append(torch.softmax(logits[:keep].float(), dim=-1))  # temperature 1
            if self.proposer is not None:
                self.proposer.rollback(len(sequence))
            if unsure_at is not None:
                self.num_confidence_stops += 1
                break
        draft_probs = torch.cat(probs) if probs else None
        distribution = torch.cat(distributions) if distributions else None
        tokens = torch.tensor(drafted, dtype=torch.long, device=self.device)
        return Draft(tokens, draft_probs, sources=(MODEL,) * len(drafted), draft_distribution=distribution)

    def _proposal(self, sequence: list[int], room: int, sampling: SamplingConfig, draws: Draws | None) -> Draft:
        """The level below's proposal (at most ``room`` tokens, leaving a slot for the model's own token)."""
        room = min(self.num_proposal_tokens, room)
        if self.proposer is None or room <= 0:
            return Draft.empty(self.device)
        proposal = self.proposer.propose(sequence, room, sampling, draws).to(self.device)
        self.num_proposal_tokens_offered += proposal.num_tokens
        return proposal

    def rollback(self, num_committed: int) -> None:
        """Keep the cache of the committed tokens (accepted draft tokens are still valid)."""
        self.cached_model.crop_to(min(self.cached_model.cached_length, num_committed - 1))
        if self.proposer is not None:
            self.proposer.rollback(num_committed)

    def finish(self, token_ids: list[int]) -> None:
        if self.proposer is not None:
            self.proposer.finish(token_ids)

    def report(self) -> dict[str, Any]:
        report: dict[str, Any] = {"draft_forwards": self.num_forwards}
        if self.confidence_threshold > 0:
            report["confidence_stops"] = self.num_confidence_stops
        if self.proposer is not None:
            report["proposal_tokens_offered"] = self.num_proposal_tokens_offered
            report["proposal_tokens_kept"] = self.num_proposal_tokens_kept
            report["proposer"] = {"name": self.proposer.name, **self.proposer.report()}
        return report


def multilevel_drafter(
    draft_model: LoadedModel,
    num_proposal_tokens: int = DEFAULT_NUM_PROPOSAL_TOKENS,
    ngram: NgramConfig | None = None,
    confidence_threshold: float = 0.0,
) -> DraftModelDrafter:
    """FLy's multi-level drafter: n-gram → draft model (defaults from the FLy reference config)."""
    return DraftModelDrafter(
        draft_model,
        proposer=NgramDrafter(ngram or NgramConfig(), device=draft_model.device),
        num_proposal_tokens=num_proposal_tokens,
        confidence_threshold=confidence_threshold,
        name="multilevel",
    )
