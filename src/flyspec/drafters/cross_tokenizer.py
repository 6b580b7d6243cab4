"""Cross-tokenizer drafting: a draft model with another vocabulary drafts *text* for the target.

The approach of transformers' Universal Assisted Generation (Timor et al., 2024): the draft model
writes a continuation, the text is re-tokenized with the target's tokenizer and verified as usual.
:class:`CrossTokenizerDrafter` is a translation layer: it speaks the Drafter protocol in the
*target* vocabulary around an ``inner`` drafter that works in the *draft* vocabulary (a
``DraftModelDrafter``, with or without a proposer below it). Per step:

1. Sync. The committed target ids (append-only within a generation) are decoded to text, a window
   at the end at a time (:class:`CommittedText`); the draft-side ids of that text are updated by
   re-encoding only after the first changed character, less an overlap (:class:`IncrementalEncoding`).
   Texts are compared, never assumed append-only: more ids can change earlier characters (a
   character split over ids shows as U+FFFD until it completes). The inner drafter is told how
   much of its last sequence (draft included) survives, ``rollback(common prefix + 1)``, so its
   cache stays a prefix of the new ids.
2. Draft. The inner drafter proposes ``m`` draft tokens, cut at its first special token (EOS, a
   turn marker). ``m`` is ``num_draft_tokens`` scaled by the draft-to-target token ratio seen so
   far (the prompt's text tokenized both ways, then every translation), capped at twice the
   request: a finer draft tokenizer needs more tokens for the same text. The tokens are decoded
   after a few preceding draft-side ids (so a Metaspace ``▁`` or a split character decodes as in
   the full text); a trailing U+FFFD (the draft stopped inside a character) is dropped.
3. Translate. ``encode(text of the last context_tokens committed target ids + draft text)``; when
   it starts with exactly those committed ids, the ids after them are the draft. Otherwise (the
   draft text merges into the last committed token) the draft text is encoded alone, or else as
   the middle of a string (no ``▁`` prepended), whichever first decodes after the context to the
   context's text + the draft text; if neither does, the draft is dropped (``misaligned``).
   Truncated to ``num_draft_tokens``; nothing left gives ``Draft.empty()`` (a plain one-token
   step). A trailing target token that may be a partial word is *kept*: if wrong, its rejection
   commits the same token the target would have given as the bonus without it, so it costs one
   scored position and can only add an accepted token.

Losslessness. The draft carries no ``draft_probs``: it counts as one-hot in the target vocabulary.
The draft model's real probability of a target token is a sum over every draft-token sequence
that spells it, which is intractable. One-hot is still exact: conditioned on the proposed token
``x``, rejection sampling accepts with probability ``target_probs[x]`` and otherwise resamples from
``target_probs`` with ``x`` removed, so the committed token is distributed as ``target_probs``
however ``x`` was produced (the draft model sampling at T > 0 included). Acceptance is lower than
with matching vocabularies, never biased. Exact match and the lossy verifiers only read the tokens.

Special tokens. Texts are decoded with ``skip_special_tokens``: the target's BOS and chat-template
markers mean nothing in the draft vocabulary, so the draft model sees the plain text of the
conversation. A special token's spelling in the text stays text on both sides
(``split_special_tokens``). Ids the draft tokenizer puts before any text (its BOS, if its model
expects one) are found once by encoding a probe with and without special tokens and prefixed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from flyspec.config import ConfigError, SamplingConfig
from flyspec.drafters.base import Drafter
from flyspec.runtime.detokenize import REPLACEMENT_CHARACTER, CommittedText, TextCodec
from flyspec.sampling.coupled import TRANSLATED, Draws
from flyspec.types import MODEL, Draft

MAX_ANCHOR_TRIES = 4  # cut points tried before a draft-side update re-encodes the whole text


def tokenizers_match(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    """True when both tokenizers map the same token strings to the same ids (no translation needed)."""
    return a is b or a.get_vocab() == b.get_vocab()


def common_prefix_length(a: Sequence[Any], b: Sequence[Any], start: int = 0) -> int:
    """Length of the common prefix of ``a`` and ``b``, given that it is at least ``start``."""
    limit = min(len(a), len(b))
    index = min(start, limit)
    while index < limit and a[index] == b[index]:
        index += 1
    return index


def cut_at_special(ids: list[int], special_ids: frozenset[int]) -> list[int]:
    """``ids`` up to (without) the first special id: the draft text ends there."""
    for index, token in enumerate(ids):
        if token in special_ids:
            return ids[:index]
    return ids


class IncrementalEncoding:
    """One tokenizer's ids for a text that changes at its end, re-encoding only a window.

    ``spans[i]`` is the character span of ``ids[i]`` (a character's byte tokens share its span).
    The ids ending before the first changed character, less ``overlap_tokens`` (a BPE merge can
    reach back over the change), are kept. Re-encoding starts at the *anchor*, the last kept id
    (at a character boundary), as the middle of a string, and must reproduce it and its span;
    else the cut moves back an id, and after ``MAX_ANCHOR_TRIES`` the whole text is encoded.
    """

    def __init__(self, codec: TextCodec, overlap_tokens: int) -> None:
        self.codec = codec
        self.overlap_tokens = overlap_tokens
        self.reset("")

    def reset(self, text: str) -> None:
        self.num_full_encodes = 0  # updates that had to encode the whole text
        self._encode_all(text)

    def _encode_all(self, text: str) -> None:
        self.text = text
        self.ids, self.spans = self.codec.encode_with_spans(text)
        self.num_reencoded = len(self.ids)  # ids encoded by the last reset/update

    def update(self, text: str, unchanged_chars: int = 0) -> int:
        """Re-encode for ``text`` (its first ``unchanged_chars`` known equal); return the ids kept unchanged."""
        changed_at = common_prefix_length(self.text, text, unchanged_chars)
        keep = len(self.ids)
        while keep > 0 and self.spans[keep - 1][1] > changed_at:
            keep -= 1
        keep -= self.overlap_tokens
        old_ids = self.ids
        for _ in range(MAX_ANCHOR_TRIES):
            # the anchor ids[keep - 1] must start at a character boundary
            while keep > 1 and self.spans[keep - 2][1] > self.spans[keep - 1][0]:
                keep -= 1
            if keep < 2:  # nothing worth keeping before the anchor
                break
            if self._reencode_from(keep - 1, text):
                return common_prefix_length(old_ids, self.ids, keep - 1)
            keep -= 1
        self._encode_all(text)
        self.num_full_encodes += 1
        return common_prefix_length(old_ids, self.ids)

    def _reencode_from(self, anchor: int, text: str) -> bool:
        """Encode ``text`` from the anchor id's start; adopt it when the anchor id comes out unchanged."""
        start = self.spans[anchor][0]
        ids, spans = self.codec.encode_with_spans(text[start:], offset=start, mid_string=True)
        if ids[:1] != [self.ids[anchor]] or spans[0] != self.spans[anchor]:
            return False
        self.ids = self.ids[:anchor] + ids
        self.spans = self.spans[:anchor] + spans
        self.text = text
        self.num_reencoded = len(ids)
        return True


@dataclass
class CrossTokenizerDrafter:
    """Drafts in the target vocabulary through an ``inner`` drafter in another vocabulary (module docstring)."""

    inner: Drafter
    draft_tokenizer: PreTrainedTokenizerBase
    target_tokenizer: PreTrainedTokenizerBase
    name: str = "draft-model"
    overlap_tokens: int = 4  # ids re-decoded / re-encoded before the first change
    context_tokens: int = 4  # committed target ids re-encoded with the draft text
    device: torch.device | str = "cpu"  # where the re-tokenized drafts are built: the listener's device

    def __post_init__(self) -> None:
        if self.overlap_tokens < 1 or self.context_tokens < 1:
            raise ConfigError("overlap_tokens and context_tokens must be >= 1")
        if not getattr(self.draft_tokenizer, "is_fast", False):
            raise ConfigError(
                "cross-tokenizer drafting needs a fast (tokenizers-backed) draft tokenizer for character "
                "offsets; load the draft model's tokenizer with use_fast=True"
            )
        self.draft_codec, self.target_codec = TextCodec(self.draft_tokenizer), TextCodec(self.target_tokenizer)
        self.target_text = CommittedText(self.target_codec, self.overlap_tokens)
        self.draft_side = IncrementalEncoding(self.draft_codec, self.overlap_tokens)
        self._inner_sequence: list[int] | None = None  # its last sequence + draft; None: none since reset
        self._reset_counters()

    def _reset_counters(self) -> None:
        self.num_steps = 0
        self.num_empty_drafts = 0  # steps whose re-tokenized draft was empty
        self.num_context_fallbacks = 0  # the committed context re-encoded differently with the draft text
        self.num_misaligned_drafts = 0  # ... and encoded without it the draft did not continue it: dropped
        self.num_draft_tokens = 0  # draft-vocabulary tokens drafted (before the special-token cut)
        self.num_target_tokens = 0  # target-vocabulary tokens proposed
        self.num_reencoded_tokens = 0  # draft-side ids re-encoded while syncing
        self.max_reencoded_window = 0
        self._granularity = [1, 1]  # draft tokens, target tokens for the same text (seeded by the prompt)

    @property
    def draft_ids(self) -> list[int]:
        """The draft-side ids of the committed text, as last synced: draft prefix (BOS) + text ids."""
        return self.draft_codec.leading_ids + self.draft_side.ids

    def reset(self, prompt_ids: list[int]) -> None:
        self._reset_counters()
        self.target_text.reset(prompt_ids)
        self.draft_side.reset(self.target_text.text)
        num_text_ids = sum(token not in self.target_codec.special_ids for token in prompt_ids)
        self._granularity = [len(self.draft_side.ids) + 1, num_text_ids + 1]
        self._inner_sequence = None
        self.inner.reset(self.draft_ids)

    def propose(
        self,
        token_ids: list[int],  # every committed target token: prompt + generated
        num_draft_tokens: int,
        sampling: SamplingConfig,
        draws: Draws | None,
    ) -> Draft:
        self.num_steps += 1
        sequence = self._sync(token_ids)
        if not sequence:  # no text and no BOS: nothing to condition the draft model on
            self.num_empty_drafts += 1
            return Draft.empty(self.device)
        # the inner draft's probabilities are over the draft vocabulary: dropped (module docstring)
        # the draft model's positions are not the target's: at T > 0 it samples with noise of its own key
        inner_draws = None if draws is None else Draws(draws.noise.derived(TRANSLATED), len(sequence), draws.generator)
        drafted = self.inner.propose(sequence, self._num_inner_tokens(num_draft_tokens), sampling, inner_draws)
        self._inner_sequence = sequence + drafted.tokens.tolist()
        self.num_draft_tokens += drafted.num_tokens
        text_ids = cut_at_special(drafted.tokens.tolist(), self.draft_codec.special_ids)
        target_tokens = self._translate(token_ids, sequence, text_ids)
        if text_ids and target_tokens:
            self._granularity[0] += len(text_ids)
            self._granularity[1] += len(target_tokens)
        target_tokens = target_tokens[:num_draft_tokens]
        self.num_target_tokens += len(target_tokens)
        if not target_tokens:
            self.num_empty_drafts += 1
            return Draft.empty(self.device)
        tokens = torch.tensor(target_tokens, dtype=torch.long, device=self.device)
        return Draft(tokens, sources=(MODEL,) * len(target_tokens))

    def rollback(self, num_committed: int) -> None:
        """Nothing to do now: the next ``propose`` re-syncs from the committed ids it is given."""

    def path_state(self) -> tuple[int, int]:
        """What this drafter carries from one step to the next besides what it re-syncs from the committed
        ids: the draft-to-target token counts behind ``m`` (step 2 above). Replay restores it per path."""
        draft_count, target_count = self._granularity
        return draft_count, target_count

    def restore_path_state(self, state: tuple[int, int]) -> None:
        self._granularity = list(state)

    def finish(self, token_ids: list[int]) -> None:
        """Hand the inner drafter the committed text in its own vocabulary (it may learn from it)."""
        self._update_draft_side(token_ids)
        self.inner.finish(self.draft_ids)

    def report(self) -> dict[str, Any]:
        return {
            "steps": self.num_steps,
            "empty_drafts": self.num_empty_drafts,
            "context_fallbacks": self.num_context_fallbacks,
            "misaligned_drafts": self.num_misaligned_drafts,
            "draft_tokens": self.num_draft_tokens,
            "target_tokens": self.num_target_tokens,
            "reencoded_draft_tokens": self.num_reencoded_tokens,
            "max_reencoded_window": self.max_reencoded_window,
            "full_reencodes": self.draft_side.num_full_encodes,
            "full_decodes": self.target_text.num_full_decodes,
            "inner": {"name": self.inner.name, **self.inner.report()},
        }

    def _sync(self, token_ids: list[int]) -> list[int]:
        """Update the draft-side ids to the committed text; roll the inner drafter back to what survives."""
        kept = self._update_draft_side(token_ids)
        self.num_reencoded_tokens += self.draft_side.num_reencoded
        self.max_reencoded_window = max(self.max_reencoded_window, self.draft_side.num_reencoded)
        sequence = self.draft_ids
        if sequence and self._inner_sequence is not None:  # no rollback before the first proposal
            common = common_prefix_length(self._inner_sequence, sequence, len(self.draft_codec.leading_ids) + kept)
            # Drafter protocol: the first n - 1 ids of its last sequence stand, the n-th may differ;
            # capped so the inner drafter keeps at least one id to feed (its cache lags by one)
            self.inner.rollback(min(common + 1, len(sequence)))
            self._inner_sequence = sequence
        return sequence

    def _update_draft_side(self, token_ids: list[int]) -> int:
        """Decode the new committed ids, re-encode the changed end; return the draft-side ids kept."""
        unchanged_chars = self.target_text.update(token_ids)
        return self.draft_side.update(self.target_text.text, unchanged_chars)

    def _num_inner_tokens(self, num_draft_tokens: int) -> int:
        """Draft tokens to ask for: enough text for ``num_draft_tokens`` target tokens, at most twice as many."""
        draft_count, target_count = self._granularity
        return min(2 * num_draft_tokens, max(1, math.ceil(num_draft_tokens * draft_count / target_count)))

    def _translate(self, token_ids: list[int], sequence: list[int], drafted: list[int]) -> list[int]:
        """The drafted text in the target vocabulary, continuing the committed ``token_ids``."""
        if not drafted:
            return []
        context = sequence[-self.context_tokens :]
        context_text, full_text = self.draft_codec.decode(context), self.draft_codec.decode(context + drafted)
        if full_text.startswith(context_text):
            draft_text = full_text[len(context_text) :]
        else:
            draft_text = self.draft_codec.decode(drafted)
        draft_text = draft_text.rstrip(REPLACEMENT_CHARACTER)  # the draft stopped inside a character
        return self._encode_for_target(token_ids, draft_text) if draft_text else []

    def _encode_for_target(self, token_ids: list[int], draft_text: str) -> list[int]:
        """Target ids for ``draft_text`` after the committed ids: re-encoded with the last few as context."""
        context = token_ids[-self.context_tokens :]
        specials = [index for index, token in enumerate(context) if token in self.target_codec.special_ids]
        if specials:  # text restarts after a special token (a turn marker): no context across it
            context = context[specials[-1] + 1 :]
        if not context:
            return self.target_codec.encode(draft_text)
        context_text = self.target_codec.decode(context)
        encoded = self.target_codec.encode(context_text + draft_text)
        if encoded[: len(context)] == context:
            return encoded[len(context) :]
        self.num_context_fallbacks += 1
        for mid_string in (False, True):
            candidate = self.target_codec.encode(draft_text, mid_string=mid_string)
            # encoded without the context, the ids may not continue it (a "▁" prepended mid-word)
            if self.target_codec.decode(context + candidate) == context_text + draft_text:
                return candidate
        self.num_misaligned_drafts += 1
        return []
