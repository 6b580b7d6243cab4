"""What one generation returns: its text, token ids, why it stopped, and its statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

from flyspec.decoding.stats import DecodeStats


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
