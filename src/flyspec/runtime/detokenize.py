"""Token ids ↔ plain text, and the text of a growing id sequence decoded a window at a time.

Used by stopping and streaming (the output text after every step, without re-decoding the whole
output) and by cross-tokenizer drafting (the target's committed text, re-tokenized for the draft model).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

from transformers import PreTrainedTokenizerBase

from flyspec.runtime.loaded_model import decode_text

REPLACEMENT_CHARACTER = "\ufffd"  # what an incomplete UTF-8 sequence decodes to
OVERLAP_TOKENS = 4  # ids decoded again with new ones: enough for a character's bytes or a merge

Span = tuple[int, int]  # [start, end) characters of one token in the text


class TextCodec:
    """A tokenizer used for plain text: decoding skips special tokens, encoding adds none and keeps
    a special token's spelling as text (``split_special_tokens``)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, clean_up_spaces: bool | None = False) -> None:
        self.tokenizer = tokenizer
        # None: the tokenizer's own default, as ``tokenizer.decode`` without the argument
        self._decode_options = {} if clean_up_spaces is None else {"clean_up_tokenization_spaces": clean_up_spaces}
        added = getattr(tokenizer, "added_tokens_decoder", {})
        specials = set(tokenizer.all_special_ids) | {i for i, token in added.items() if token.special}
        self.special_ids = frozenset(specials)  # BOS, EOS, chat-turn markers, ...: never text
        self.marker = tokenizer.bos_token or tokenizer.eos_token or next(iter(tokenizer.all_special_tokens), None)
        self.marker_id = tokenizer.convert_tokens_to_ids(self.marker) if self.marker else None

    @cached_property
    def leading_ids(self) -> list[int]:
        """The ids the tokenizer puts before any text when asked for special tokens (a BOS), else []."""
        with_special = list(self.tokenizer("a", add_special_tokens=True)["input_ids"])
        plain = list(self.tokenizer("a", add_special_tokens=False)["input_ids"])
        starts = [i for i in range(len(with_special)) if with_special[i : i + len(plain)] == plain]
        return with_special[: starts[0]] if starts else []

    def decode(self, ids: Sequence[int]) -> str:
        return decode_text(self.tokenizer, ids, **self._decode_options)

    def encode(self, text: str, mid_string: bool = False) -> list[int]:
        return self.encode_with_spans(text, mid_string=mid_string, spans=False)[0]

    def encode_with_spans(
        self, text: str, offset: int = 0, mid_string: bool = False, spans: bool = True
    ) -> tuple[list[int], list[Span]]:
        """Ids of ``text`` and their character spans (shifted by ``offset``; [] unless ``spans``).

        ``mid_string``: as the middle of a string: encoded after a special token, which starts a
        new section of the input, so a rule for a string's start (Metaspace
        ``prepend_scheme="first"`` prepending ``▁``) does not apply; encoded plainly instead when
        the text spells a special token (here it would be parsed as one).
        """
        if mid_string and self.marker:
            encoding = self.tokenizer(self.marker + text, add_special_tokens=False, return_offsets_mapping=spans)
            ids, shift = list(encoding["input_ids"]), offset - len(self.marker)
            if ids[:1] == [self.marker_id] and not self.special_ids.intersection(ids[1:]):
                return ids[1:], [(a + shift, b + shift) for a, b in encoding.get("offset_mapping", [])[1:]]
        encoding = self.tokenizer(
            text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=spans
        )
        return list(encoding["input_ids"]), [(a + offset, b + offset) for a, b in encoding.get("offset_mapping", [])]


class CommittedText:
    """The text of an append-only id sequence, decoding only a window at its end per update.

    The last ``overlap_tokens`` ids are decoded again with the new ones because more ids can change
    the text of earlier ones: a character's bytes split over ids, and a run of byte-fallback pieces
    (``<0xNN>``) invalid as UTF-8 decodes to U+FFFD throughout, so the window never starts inside
    such a run. The window is trusted only if its old text ends the old text and decoding from
    ``overlap_tokens`` further back ends with its new text; else everything is decoded again.
    """

    def __init__(self, codec: TextCodec, overlap_tokens: int) -> None:
        self.codec = codec
        self.overlap_tokens = overlap_tokens
        self.reset([])

    def reset(self, ids: list[int]) -> None:
        self.ids = list(ids)
        self.text = self.codec.decode(ids)
        self.num_full_decodes = 0

    def update(self, ids: list[int]) -> int:
        """Bring ``text`` up to ``ids``; return how many leading characters are certainly unchanged."""
        start = self._window_start(len(self.ids) - self.overlap_tokens)
        old_window_text = self.codec.decode(self.ids[start:])
        window_text = self.codec.decode(ids[start:])
        wider_text = self.codec.decode(ids[max(0, start - self.overlap_tokens) :])
        head_length = len(self.text) - len(old_window_text)
        trusted = self.text.endswith(old_window_text) and wider_text.endswith(window_text)
        if ids[: len(self.ids)] != self.ids or not trusted:  # not only appended to, or not trusted
            self.num_full_decodes += 1
            head_length, window_text = 0, self.codec.decode(ids)
        self.text = self.text[:head_length] + window_text
        self.ids = list(ids)
        return head_length

    def _window_start(self, start: int) -> int:
        """``start``, moved back out of any run of byte-fallback pieces it falls inside."""
        start = max(0, start)
        while 0 < start < len(self.ids) and self._is_byte_piece(start - 1) and self._is_byte_piece(start):
            start -= 1
        return start

    def _is_byte_piece(self, index: int) -> bool:
        token = self.codec.tokenizer.convert_ids_to_tokens(self.ids[index])
        return isinstance(token, str) and len(token) == 6 and token.startswith("<0x") and token.endswith(">")
