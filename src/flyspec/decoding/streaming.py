"""A generation as an iterator of text pieces, with the full result once it is exhausted."""

from __future__ import annotations

import time
from collections.abc import Iterator

from flyspec.decoding.result import GenerationResult
from flyspec.decoding.stats import DecodeStats
from flyspec.decoding.stopping import Stopper

# What a decoding loop yields per target forward: the committed tokens, and which of them
# (indices into that list) were loosely accepted.
Step = tuple[list[int], tuple[int, ...]]


class GenerationStream:
    """Iterate for text pieces as tokens are committed; ``result`` is set when iteration ends.

    Text that might still turn into a stop string, or an incomplete UTF-8 character, is held
    back until it is settled, so the concatenated pieces always equal ``result.text``.
    """

    def __init__(self, steps: Iterator[Step], stopper: Stopper, stats: DecodeStats, prompt_ids: list[int]):
        self._steps = steps
        self._stopper = stopper
        self._stats = stats
        self._prompt_ids = prompt_ids
        self._emitted = ""
        self._loose: list[int] = []
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        started = time.perf_counter()
        for committed, loose in self._steps:
            if committed and self._stats.time_to_first_token_s is None:
                self._stats.time_to_first_token_s = time.perf_counter() - started
            offset = len(self._stopper.generated) - len(committed)
            self._loose.extend(offset + index for index in loose if index < len(committed))
            piece = self._settled_delta()
            if piece:
                yield piece
        self._stats.wall_time_s = time.perf_counter() - started
        self._explain_loose_accepts()
        final = self._stopper.text()
        self.result = GenerationResult(
            text=final,
            token_ids=list(self._stopper.generated),
            prompt_token_ids=self._prompt_ids,
            stats=self._stats,
            finish_reason=self._stopper.finish_reason or "length",
            loose_token_indices=self._loose,
        )
        if len(final) > len(self._emitted):
            yield final[len(self._emitted) :]

    def collect(self) -> GenerationResult:
        """Run to the end and return the result."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    def _explain_loose_accepts(self) -> None:
        """Add the texts of each loose accept's tokens, and the output text before it, to its record."""
        tokenizer = self._stopper.tokenizer
        generated = self._stopper.generated
        for record in self._stats.loose_accepts:
            record["draft_text"] = tokenizer.decode([record["draft_token"]])
            record["target_text"] = tokenizer.decode([record["target_token"]])
            record["before"] = tokenizer.decode(generated[max(0, record["index"] - 8) : record["index"]])

    def _settled_delta(self) -> str:
        text = self._stopper.text()
        hold = len(text)
        if text.endswith("\ufffd"):  # a multi-byte character split across tokens
            hold = len(text.rstrip("\ufffd"))
        for stop in self._stopper.stop_strings:
            for size in range(min(len(stop) - 1, hold), 0, -1):
                if text[:hold].endswith(stop[:size]):
                    hold -= size
                    break
        if hold <= len(self._emitted) or not text.startswith(self._emitted):
            return ""
        delta = text[len(self._emitted) : hold]
        self._emitted = text[:hold]
        return delta
