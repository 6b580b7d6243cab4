"""What passes between the stages: Drafter → Draft → Verifier → Verdict (the result: ``decoding/result.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# Where a draft token came from. The trust guards (verifiers/guard.py) treat copies and cache
# entries differently from model drafts, and every loose accept reports its source.
PROMPT_COPY = "prompt-copy"  # copied from the prompt (n-gram lookup)
OUTPUT_COPY = "output-copy"  # copied from the text generated so far (n-gram lookup)
CACHE = "cache"  # from the n-gram cache of earlier generations: memory, not this request's text
MODEL = "model"  # proposed (or checked) by a draft model
PREDICTION = "prediction"  # copied from the request's prediction (OpenAI's Predicted Outputs; drafters/prediction.py)
UNKNOWN_SOURCE = "unknown"
SOURCES = (PROMPT_COPY, OUTPUT_COPY, CACHE, MODEL, PREDICTION, UNKNOWN_SOURCE)


@dataclass(frozen=True)
class Draft:
    """Draft tokens proposed for the positions after the last committed token.

    ``draft_probs`` is the distribution each token was drawn from (``[k, vocab]``), or ``None``
    for deterministic proposals (n-gram lookup, greedy model drafts), which count as one-hot.
    ``draft_distribution`` is the draft model's own next-token distribution at each position (softmax of
    its raw logits, temperature 1; ``[k, vocab]``), greedy or not: what the rules that compare the draft's
    and the target's distributions read (``names.DISTRIBUTION_VERIFIERS``). Only a draft model that was
    asked for it carries one (``DraftModelDrafter.keep_distribution``).
    """

    tokens: torch.Tensor  # [k] int64, k may be 0
    draft_probs: torch.Tensor | None = None  # [k, vocab] float32
    sources: tuple[str, ...] | None = None  # [k] provenance of each token (SOURCES); None = unknown
    match_length: int = 0  # copy drafters: tokens of the context suffix the copy matched (0: not a copy)
    draft_distribution: torch.Tensor | None = None  # [k, vocab] float32, temperature 1

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1:
            raise ValueError(f"draft tokens must be 1-D, got shape {tuple(self.tokens.shape)}")
        if self.draft_probs is not None and self.draft_probs.shape[0] != self.tokens.shape[0]:
            raise ValueError("draft_probs must have one row per draft token")
        if self.sources is not None and len(self.sources) != self.tokens.shape[0]:
            raise ValueError("sources must name one provenance per draft token")
        if self.draft_distribution is not None and self.draft_distribution.shape[0] != self.tokens.shape[0]:
            raise ValueError("draft_distribution must have one row per draft token")

    def source(self, position: int) -> str:
        """Where draft token ``position`` came from (one of :data:`SOURCES`)."""
        return self.sources[position] if self.sources is not None else UNKNOWN_SOURCE

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def to(self, device: torch.device) -> Draft:
        """This draft on ``device`` (itself when already there): a draft model may sit on another device."""
        if self.tokens.device == device:
            return self
        probs = self.draft_probs.to(device) if self.draft_probs is not None else None
        distribution = self.draft_distribution.to(device) if self.draft_distribution is not None else None
        return Draft(self.tokens.to(device), probs, self.sources, self.match_length, distribution)

    def head(self, num_tokens: int) -> Draft:
        """The first ``num_tokens`` draft tokens (itself when that is all of them)."""
        if num_tokens >= self.num_tokens:
            return self
        probs = self.draft_probs[:num_tokens] if self.draft_probs is not None else None
        sources = self.sources[:num_tokens] if self.sources is not None else None
        distribution = self.draft_distribution[:num_tokens] if self.draft_distribution is not None else None
        return Draft(self.tokens[:num_tokens], probs, sources, self.match_length, distribution)

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> Draft:
        return Draft(torch.empty(0, dtype=torch.long, device=device))


@dataclass(frozen=True)
class LooseAccept:
    """One loose accept, explained: what the target wanted, what was kept instead, and why.

    ``evidence`` is the lossy rule's own measure at that position: FLy's top-k entropy (nats),
    MARS's closeness (``z2/z1``, or ``p2/p1`` where a logit is <= 0), typical acceptance's
    target probability of the draft token, BiLD's cross-entropy ``-log p_target(draft token)`` (nats).
    """

    position: int  # draft position j (the decoder turns it into an index into the output)
    draft_token: int  # the token kept
    target_token: int  # the target's choice at j (its argmax; at T > 0 its coupled sample: plain decoding's token)
    evidence: float
    source: str  # where the draft token came from (SOURCES)


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one draft (terms defined in ``verifiers/base.py``).

    ``tokens`` = the accepted draft tokens followed by exactly one recovered or bonus token.
    """

    tokens: list[int]
    num_accepted: int
    loose_positions: tuple[int, ...] = ()
    bonus: bool = False
    loose: tuple[LooseAccept, ...] = field(default=(), compare=False)  # one per loose position: why it was kept
    vetoes: tuple[str, ...] = field(default=(), compare=False)  # guards that refused the first rejected position

    def __post_init__(self) -> None:
        if len(self.tokens) != self.num_accepted + 1:
            raise ValueError("a verdict commits the accepted draft tokens plus one recovered/bonus token")


@dataclass
class VerifyContext:
    """What a verifier may know besides the draft and the target's logits: the generation so far.

    Built by the decoder once per generation; ``token_ids`` is the decoder's own list of
    committed tokens (prompt, then output), so it is current at every step. ``vocabulary`` holds
    the target's per-model token facts (EOS ids, token classes; ``verifiers/tokens.py``).
    ``memo`` keeps values derived from the prompt once per generation (e.g. its names).
    ``breaker``: the generation's circuit breaker (``decoding/breaker.py``), if its profile set one.
    ``rule_state``: the verifier's own state for this generation (``Verifier.new_state()``: adasd's running means),
    made with the context, so it dies with the generation; None for the rules that keep none.
    """

    token_ids: list[int]
    prompt_length: int
    vocabulary: Any = None  # verifiers.tokens.Vocabulary, or None (then only vocabulary-free guards apply)
    memo: dict[str, Any] = field(default_factory=dict)
    breaker: Any = None  # breaker.CircuitBreaker, or None: once it trips, every loose candidate is vetoed
    rule_state: Any = None  # the verifier's per-generation state (Verifier.new_state()), or None

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.prompt_length]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_length :]
