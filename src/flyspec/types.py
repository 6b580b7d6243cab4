"""What passes between the stages: Drafter → Draft → Verifier → Verdict → GenerationResult."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from flyspec.stats import DecodeStats


@dataclass(frozen=True)
class Draft:
    """Draft tokens proposed for the positions after the last committed token.

    ``draft_probs`` is the distribution each token was drawn from (``[k, vocab]``), or ``None``
    for deterministic proposals (n-gram lookup, greedy model drafts), which count as one-hot.
    """

    tokens: torch.Tensor  # [k] int64, k may be 0
    draft_probs: torch.Tensor | None = None  # [k, vocab] float32

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1:
            raise ValueError(f"draft tokens must be 1-D, got shape {tuple(self.tokens.shape)}")
        if self.draft_probs is not None and self.draft_probs.shape[0] != self.tokens.shape[0]:
            raise ValueError("draft_probs must have one row per draft token")

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def empty() -> Draft:
        return Draft(torch.empty(0, dtype=torch.long))


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one draft (terms defined in ``verifiers/base.py``).

    ``tokens`` = the accepted draft tokens followed by exactly one recovered or bonus token.
    """

    tokens: list[int]
    num_accepted: int
    loose_positions: tuple[int, ...] = ()
    bonus: bool = False

    def __post_init__(self) -> None:
        if len(self.tokens) != self.num_accepted + 1:
            raise ValueError("a verdict commits the accepted draft tokens plus one recovered/bonus token")


@dataclass
class GenerationResult:
    """Output of one generation."""

    text: str
    token_ids: list[int]  # new tokens only (truncated at EOS / stop string / max_new_tokens)
    prompt_token_ids: list[int]
    stats: DecodeStats
    finish_reason: str = "length"  # "length" | "eos" | "stop"
    loose_token_indices: list[int] = field(default_factory=list)  # indices into token_ids

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)
