"""The Target used for verification: prefill, score a draft in one forward, roll back its KV cache.

Cache invariant (checked after every step): the cache holds exactly the committed tokens but
the last one, ``cached_length == num_committed - 1``. Each step scores
``[last committed token] + draft`` in one forward, giving ``[k + 1, vocab]`` logits, and then
crops the cache back to the newly committed length (transformers 5 ``DynamicCache.crop`` takes
a negative count).

The prefill is the one exception: it runs the whole prompt, its last token included, and keeps that
token's logits (``cached_length == num_committed`` until the first step). The first step then takes
them instead of running the last token again: a step without a draft needs no forward at all (the
decoders' first step: the first token comes from the prefill, as in vLLM), and a draft would be
scored by a forward of the draft alone. Otherwise the first token would cost a second pass over every
weight (a whole decode step) and the prefill an unused row of the output head (BENCHMARKS.md, "Time to
first token").

A new generation that continues the previous one's conversation (its prompt starts with that
generation's whole prompt) keeps the cached positions the two share (prefix reuse): a chat's next
turn, whose prompt repeats the conversation so far, prefills only what is new. A new conversation
starts afresh, even when it shares a head such as a chat template's system prompt, so its output
does not depend, by rounding, on what the decoder ran before. The cache belongs to one decoder, so
only that decoder's own earlier generation is reused (the server builds a decoder per request:
nothing passes between requests). The reused keys and values were computed by the earlier
generation's steps rather than by one prefill, so outputs equal a fresh start's up to
floating-point rounding, as any two batch shapes do.

And only when at least half of the prompt is cached. A prefill that continues a cache attends
with a mask, and its tokens cost 4-48 % more than the same tokens prefilled afresh: on a 700-token
SmolLM2 prompt in bf16, reusing 24 tokens saved 1 % of the prefill, 100 saved 10 %, 350 saved 42 %
(BENCHMARKS.md, "prefix reuse").
"""

from __future__ import annotations

import torch

from flyspec.config import ConfigError
from flyspec.runtime.cached_model import CachedModel
from flyspec.runtime.loaded_model import LoadedModel


class Target:
    """The target model: prefill, score drafts, roll back. Holds the per-request cache."""

    def __init__(self, target: LoadedModel) -> None:
        self.cached_model = CachedModel(target)
        self.committed: list[int] = []  # the committed tokens; the cache holds all but the last
        self.prompt_length = 0  # of the generation that committed them
        # after a prefill, until the first step: the logits [1, vocab] after the last prompt token (cached too)
        self.prefill_logits: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.cached_model.device

    @property
    def num_committed(self) -> int:
        return len(self.committed)

    def start(self, prompt_ids: list[int]) -> int:
        """Prefill the prompt, keeping the cached positions it shares with the previous generation's
        committed tokens and the logits after its last token (the first step's, see the module doc);
        return how many positions were kept (0: prefilled afresh)."""
        if not prompt_ids:
            raise ConfigError("the prompt encodes to no tokens; give some text")
        reused = self._shared_prefix(prompt_ids)
        if reused:
            self.cached_model.crop_to(reused)
        else:
            self.cached_model.reset()
        self.prefill_logits = None
        logits = self.cached_model.forward(prompt_ids[reused:], logits_to_keep=1)  # [1, vocab]
        self.committed, self.prompt_length, self.prefill_logits = list(prompt_ids), len(prompt_ids), logits
        self.check_invariant()
        return reused

    def _shared_prefix(self, prompt_ids: list[int]) -> int:
        """How many leading cached positions hold the same tokens as ``prompt_ids`` (0: start afresh)."""
        cached = self.cached_model.cached_length
        # a generation closed mid-step leaves unchecked positions; a sliding-window layer can't rewind far
        if not cached or cached != len(self.committed) - 1 or not self.cached_model.rewindable:
            return 0
        limit = min(cached, len(prompt_ids) - 1)
        shared = next((i for i in range(limit) if self.committed[i] != prompt_ids[i]), limit)
        continues = shared >= min(self.prompt_length, limit)  # the previous prompt, all of it
        return shared if continues and 2 * shared >= len(prompt_ids) else 0  # see the module doc

    def score(self, last_token: int, draft_tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[k + 1, vocab]`` for ``[last_token] + draft_tokens`` in one forward.

        ``draft_tokens`` (``[k]``) must be on the target's device; the input is assembled there,
        without a round trip through the host. The first step after a prefill takes the prefill's
        logits for ``last_token`` (already cached) and runs only the draft.
        """
        first, self.prefill_logits = self.prefill_logits, None
        if first is not None:
            if last_token != self.committed[-1]:
                raise RuntimeError("the first step after a prefill must score the prompt's last token")
            if not draft_tokens.numel():
                return first  # [1, vocab]
            return torch.cat([first, self.cached_model.forward(draft_tokens)])  # [k + 1, vocab]
        last = torch.full((1,), last_token, dtype=torch.long, device=self.device)
        return self.cached_model.forward(torch.cat([last, draft_tokens]))  # [k + 1, vocab]

    def rollback(self, committed: list[int]) -> None:
        """Keep the cache of the ``committed`` tokens only (all but the last). The list is kept, not
        copied: it is the generation's, which only grows, and tells the next start what is cached."""
        self.prefill_logits = None
        self.cached_model.crop_to(len(committed) - 1)
        self.committed = committed
        self.check_invariant()

    def check_invariant(self) -> None:
        cached = self.cached_model.cached_length
        expected = self.num_committed - (self.prefill_logits is None)  # the prefill caches the last token too
        if cached != expected:
            state = "a prefill: committed" if self.prefill_logits is not None else "committed - 1"
            raise RuntimeError(
                f"KV cache invariant broken: {cached} cached positions for {self.num_committed} committed tokens "
                f"(expected {state})"
            )
