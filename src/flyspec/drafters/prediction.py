"""A request's prediction as a drafter, beside the configured one (OpenAI's Predicted Outputs).

The client says what it expects most of the output to be (``prediction``: the file before an edit, a
template to fill in). This drafter, made for one generation, drafts the prediction's tokens where they
line up with the output, and lets the configured drafter (``inner``) propose where they do not. Whatever
it drafts the verifier checks as any draft: under a lossless verifier the output is the target's own,
token for token at T = 0 and for the same seed at T > 0 (the drafts are deterministic, so they carry no
``draft_probs``: coupled sampling verifies them exactly, as it does n-gram copies).

Alignment. ``cursor`` is the index in the prediction of the token the output is expected to take next.
Before each draft, the tokens committed since the last one are compared with the prediction from the
cursor on; while they agree the cursor moves on with them (the prediction is *aligned*). Where they
differ (the output inserts, deletes or changes text) the cursor stays at the point of divergence and the
prediction is re-anchored: the longest suffix of the output (:data:`MAX_ANCHOR_TOKENS` tokens down to one)
found again in the prediction moves the cursor to just after that occurrence, the nearest at or after the
cursor, else the nearest before it (the output went back to a passage it had left). One token is weak
evidence (a space, a bracket), so a one-token anchor counts only within :data:`NEAR_TOKENS` after the cursor.
An insertion thus costs the steps that generate the inserted text plus the one that commits the first
token after it, a deletion the one step that commits the first token after the gap; the rest of the
prediction stays usable.

Beside the configured drafter. The prediction drafts where it is aligned, unless the context itself (prompt and
output) holds a longer match of its own last tokens than the run of output tokens that agreed with the prediction
just before the cursor (up to :data:`MAX_ANCHOR_TOKENS`): the output is then repeating its context, not following
the prediction (a fresh one-token anchor against a phrase the output keeps repeating), and the configured drafter
proposes, as it does wherever the prediction has nothing aligned.

Draft length. An aligned draft is the prediction from the cursor on, as long as the decoder asks for: a copy
costs nothing to propose, so the cost-aware policy (``decoding/draft_length.py``) is asked for its maximum
and cuts the draft to the length the measured acceptance of this request pays for, per evidence bucket
(source ``prediction``, and the number of output tokens that agreed with the prediction just before the
cursor as the match length). Not aligned, the inner drafter proposes, at most ``inner_max_tokens`` tokens
(the configured ``num_draft_tokens``: a prediction's longer maximum is never a model drafter's).

Counting. Every draft token from the prediction carries the source :data:`~flyspec.types.PREDICTION`;
``DecodeStats`` counts those the verifier kept (accepted prediction tokens) and those it scored and did
not keep (rejected), as OpenAI's ``usage.completion_tokens_details`` reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from flyspec.config import SamplingConfig
from flyspec.drafters.base import Drafter
from flyspec.drafters.ngram import longest_match
from flyspec.sampling.coupled import Draws
from flyspec.types import PREDICTION, Draft

MAX_ANCHOR_TOKENS = 8  # the longest output suffix looked for in the prediction when re-anchoring
NEAR_TOKENS = 32  # a one-token anchor counts only this close after the cursor
# the most tokens one prediction draft may hold under the cost-aware length policy (its measured acceptance
# cuts it); with another policy the draft is at most the configured num_draft_tokens
MAX_PREDICTION_DRAFT_TOKENS = 32


def find_anchor(prediction: np.ndarray, output: list[int], cursor: int) -> tuple[int, int] | None:
    """Where the output continues in ``prediction``: (new cursor, anchor length), or None where nothing matches.

    The anchor is the longest suffix of ``output`` (up to :data:`MAX_ANCHOR_TOKENS`) that occurs in the
    prediction followed by at least one token; of its occurrences, the nearest whose last token is at or after
    ``cursor``, else the nearest before it. A one-token anchor counts only within :data:`NEAR_TOKENS` after
    ``cursor``.
    """
    length = prediction.shape[0]
    for size in range(min(MAX_ANCHOR_TOKENS, len(output), length - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(prediction[:-1], size)  # [length - size, size]
        ends = np.flatnonzero((windows == np.asarray(output[-size:])).all(axis=1)) + size
        lasts = ends - 1  # the index of each occurrence's last token
        if size == 1:
            ends = ends[(lasts >= cursor) & (lasts <= cursor + NEAR_TOKENS)]
        if ends.size:
            after = ends[ends > cursor]  # its last token at or after the cursor
            return int(after[0] if after.size else ends[-1]), size
    return None


TokenIds = Sequence[int] | np.ndarray  # an output's committed token ids: a list, or a row of vLLM's token table


@dataclass(frozen=True)
class Alignment:
    """Where an output stands in its prediction (the module's *Alignment*)."""

    cursor: int = 0  # the prediction's index of the token the output is expected to take next
    aligned: bool = True  # the output follows the prediction at the cursor
    run: int = 0  # output tokens just before the cursor that agree with the prediction
    synced: int = 0  # output tokens compared with the prediction so far

    @classmethod
    def start(cls, prediction_length: int) -> Alignment:
        return cls(aligned=prediction_length > 0)


def follow(prediction: np.ndarray, output: TokenIds, alignment: Alignment) -> tuple[Alignment, bool]:
    """The alignment after the tokens ``output`` committed since ``alignment.synced``: moved along the prediction
    while they agree with it, else re-anchored in it (:func:`find_anchor`); and whether it was re-anchored.

    Pure (flyspec's drafter and the vLLM plugin's proposer both call it): ``prediction`` is the prediction's ids
    ``[prediction length]``, ``output`` every output token committed so far (the prompt excluded).
    """
    new = output[alignment.synced :]
    alignment = replace(alignment, synced=len(output))
    if len(new) == 0:
        return alignment, False
    if alignment.aligned:
        expected = prediction[alignment.cursor : alignment.cursor + len(new)]
        agree = next((i for i, (a, b) in enumerate(zip(new, expected, strict=False)) if a != b), len(expected))
        alignment = replace(alignment, cursor=alignment.cursor + agree, run=alignment.run + agree)
        if agree == len(new) and alignment.cursor < len(prediction):
            return alignment, False
        alignment = replace(alignment, aligned=False)  # the output left the prediction here (or used it up)
    anchor = find_anchor(prediction, [int(token) for token in output[-MAX_ANCHOR_TOKENS:]], alignment.cursor)
    if anchor is None:
        return alignment, False
    return replace(alignment, cursor=anchor[0], run=anchor[1], aligned=True), True


def aligned_tokens(prediction: np.ndarray, alignment: Alignment, num_draft_tokens: int) -> np.ndarray:
    """The prediction's next ``num_draft_tokens`` tokens from the cursor where it is aligned, else none."""
    if not alignment.aligned or num_draft_tokens <= 0:
        return prediction[:0]
    return prediction[alignment.cursor : alignment.cursor + num_draft_tokens]  # [<= num_draft_tokens]


@dataclass
class PredictionCounters:
    """What the prediction drafter did in one generation (its ``report()``)."""

    prediction_tokens: int = 0  # the prediction's length
    prediction_drafts: int = 0  # steps drafted from the prediction
    prediction_draft_tokens: int = 0  # tokens proposed from it (before the draft-length policy cut them)
    inner_drafts: int = 0  # steps the configured drafter proposed (nothing aligned, or the context copied further)
    realignments: int = 0  # times the prediction was re-anchored after the output left it


@dataclass
class PredictionDrafter:
    """Drafts ``prediction`` (token ids) where it lines up with the output, else lets ``inner`` propose.

    Made per generation (``SpeculativeDecoder._steps``); ``reset``, ``rollback`` and ``finish`` reach ``inner``
    too, and ``report`` is ``inner``'s with this drafter's counters under ``prediction``.
    """

    inner: Drafter
    prediction: list[int]
    device: torch.device | str = "cpu"  # where drafts are built: the target's
    inner_max_tokens: int | None = None  # the most tokens ``inner`` is asked for (None: as many as asked)
    name: str = "prediction"
    counters: PredictionCounters = field(init=False)

    def __post_init__(self) -> None:
        self._prediction = np.asarray(self.prediction, dtype=np.int64)  # [prediction length]
        self._start(0)

    def _start(self, prompt_length: int) -> None:
        self.counters = PredictionCounters(prediction_tokens=len(self.prediction))
        self.prompt_length = prompt_length
        self.alignment = Alignment.start(len(self.prediction))

    @property
    def aligned(self) -> bool:
        return self.alignment.aligned

    @property
    def cursor(self) -> int:
        return self.alignment.cursor

    def reset(self, prompt_ids: list[int]) -> None:
        self._start(len(prompt_ids))
        self.inner.reset(prompt_ids)

    def propose(
        self,
        token_ids: list[int],
        num_draft_tokens: int,
        sampling: SamplingConfig,
        draws: Draws | None,
    ) -> Draft:
        self.alignment, realigned = follow(self._prediction, token_ids[self.prompt_length :], self.alignment)
        self.counters.realignments += realigned
        tokens = aligned_tokens(self._prediction, self.alignment, num_draft_tokens)
        if len(tokens) and not self._context_copies_further(token_ids):
            self.counters.prediction_drafts += 1
            self.counters.prediction_draft_tokens += len(tokens)
            draft_tokens = torch.tensor(tokens, dtype=torch.long, device=self.device)  # [k]
            return Draft(draft_tokens, sources=(PREDICTION,) * len(tokens), match_length=self.alignment.run)
        self.counters.inner_drafts += 1
        limit = num_draft_tokens if self.inner_max_tokens is None else min(num_draft_tokens, self.inner_max_tokens)
        return self.inner.propose(token_ids, limit, sampling, draws)

    def _context_copies_further(self, token_ids: list[int]) -> bool:
        """Whether the context (prompt + output) holds a longer match of its own suffix than the prediction's
        aligned run: the output is then copying its context rather than the prediction (a fresh one-token anchor
        against a repeated phrase), and the configured drafter proposes. A run of :data:`MAX_ANCHOR_TOKENS` is
        trusted without looking."""
        if self.alignment.run >= MAX_ANCHOR_TOKENS:
            return False
        longer = self.alignment.run + 1
        return longest_match(token_ids, 1, longer, longer)[1] > 0

    def rollback(self, num_committed: int) -> None:
        """The alignment follows the committed tokens at the next ``propose``; only ``inner`` rolls back."""
        self.inner.rollback(num_committed)

    def finish(self, token_ids: list[int]) -> None:
        self.inner.finish(token_ids)

    def report(self) -> dict[str, Any]:
        return {**self.inner.report(), "prediction": vars(self.counters).copy()}
