"""When a generation stops: max new tokens, an EOS token, or a stop string.

Shared by speculative and plain decoding, so both truncate in exactly the same place even
though speculative decoding commits several tokens at once. The output text is kept up to date
incrementally (:class:`~flyspec.runtime.detokenize.CommittedText`): each step decodes a window at the
end, not the whole output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from flyspec.runtime.detokenize import OVERLAP_TOKENS, CommittedText, TextCodec
from flyspec.runtime.loaded_model import decode_text


@dataclass
class Stopper:
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    max_new_tokens: int
    stop_strings: tuple[str, ...] = ()
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # None while running; then "length" | "eos" | "stop"

    def __post_init__(self) -> None:
        # decoded as tokenizer.decode(generated, skip_special_tokens=True) would, a window at a time
        self._decoded = CommittedText(TextCodec(self.tokenizer, clean_up_spaces=None), OVERLAP_TOKENS)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)

    def commit(self, tokens: list[int]) -> list[int]:
        """Append ``tokens`` up to the first stop condition; return what was actually committed."""
        if self.finished:
            return []
        tokens = tokens[: self.remaining]
        for index, token in enumerate(tokens):
            if token in self.eos_token_ids:
                tokens = tokens[: index + 1]
                self.finish_reason = "eos"
                break
        start = len(self.generated)
        self.generated.extend(tokens)
        if self.stop_strings:
            end = self._stop_string_end(start)
            if end is not None:
                del self.generated[end:]
                self.finish_reason = "stop"
        if not self.finished and self.remaining <= 0:
            self.finish_reason = "length"
        return self.generated[start:]

    def text(self) -> str:
        """The generated text, cut before the first stop string."""
        return cut_at_stop_string(self._full_text(), self.stop_strings)

    def _full_text(self) -> str:
        """The text of every generated token (stop strings included)."""
        if self._decoded.ids != self.generated:
            self._decoded.update(self.generated)
        return self._decoded.text

    def _stop_string_end(self, start: int) -> int | None:
        """Fewest generated tokens whose text contains a stop string, if the new tokens complete one."""
        text = self._full_text()
        if cut_at_stop_string(text, self.stop_strings) == text:
            return None
        for end in range(start + 1, len(self.generated) + 1):
            text = decode_text(self.tokenizer, self.generated[:end])
            if cut_at_stop_string(text, self.stop_strings) != text:
                return end
        return len(self.generated)


def cut_at_stop_string(text: str, stop_strings: tuple[str, ...]) -> str:
    positions = [text.find(stop) for stop in stop_strings if stop in text]
    return text[: min(positions)] if positions else text
