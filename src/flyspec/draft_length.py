"""How many tokens to draft at each step: fixed, or adapted to recent acceptance.

The adaptive rule is transformers' ``num_assistant_tokens_schedule="heuristic"`` (used by its
assisted generation): after a step whose every draft token was kept the next draft is 2 tokens
longer, after any rejection 1 token shorter, always within ``[floor, num_draft_tokens]``. Long
drafts pay off only while the target keeps agreeing, and a short draft wastes less drafting
time when it does not. Steps where the drafter proposed nothing carry no evidence and leave the
length alone. Per-generation state; one instance per generation.
"""

from __future__ import annotations

from flyspec.config import DraftLengthConfig


class DraftLength:
    """The draft length for the next step, updated from each step's outcome."""

    def __init__(self, config: DraftLengthConfig, num_draft_tokens: int, floor: int = 1) -> None:
        self.adaptive = config.adaptive
        self.maximum = num_draft_tokens
        # never below the floor (the verifier's min_draft_tokens: FLy's window + 1), never above the maximum
        self.minimum = min(max(config.min_tokens, floor), num_draft_tokens)
        self.current = num_draft_tokens

    def next(self) -> int:
        return self.current

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        """Record a step that proposed ``num_proposed`` draft tokens and kept ``num_accepted`` of them."""
        if not self.adaptive or num_proposed == 0:
            return
        step = 2 if num_accepted == num_proposed else -1
        self.current = max(self.minimum, min(self.maximum, self.current + step))
