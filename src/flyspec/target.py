"""The Target used for verification: prefill, score a draft in one forward, roll back its KV cache.

Cache invariant (checked after every step): the cache holds exactly the committed tokens but
the last one, ``cached_length == num_committed - 1``. Each step scores
``[last committed token] + draft`` in one forward, giving ``[k + 1, vocab]`` logits, and then
crops the cache back to the newly committed length (transformers 5 ``DynamicCache.crop`` takes
a negative count).
"""

from __future__ import annotations

import torch

from flyspec.cached_model import CachedModel
from flyspec.config import ConfigError
from flyspec.models import LoadedModel


class Target:
    """The target model: prefill, score drafts, roll back. Holds the per-request cache."""

    def __init__(self, target: LoadedModel) -> None:
        self.cached_model = CachedModel(target)
        self.num_committed = 0

    @property
    def device(self) -> torch.device:
        return self.cached_model.device

    def start(self, prompt_ids: list[int]) -> None:
        """Prefill everything but the last prompt token (which the first step scores)."""
        if not prompt_ids:
            raise ConfigError("the prompt encodes to no tokens; give some text")
        self.cached_model.reset()
        if len(prompt_ids) > 1:
            self.cached_model.forward(prompt_ids[:-1], logits_to_keep=1)
        self.num_committed = len(prompt_ids)
        self.check_invariant()

    def score(self, last_token: int, draft_tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[k + 1, vocab]`` for ``[last_token] + draft_tokens`` in one forward.

        ``draft_tokens`` (``[k]``) must be on the target's device; the input is assembled there,
        without a round trip through the host.
        """
        last = torch.full((1,), last_token, dtype=torch.long, device=self.device)
        return self.cached_model.forward(torch.cat([last, draft_tokens]))  # [k + 1, vocab]

    def rollback(self, num_committed: int) -> None:
        """Keep the cache of the committed tokens only (all but the last)."""
        self.cached_model.crop_to(num_committed - 1)
        self.num_committed = num_committed
        self.check_invariant()

    def check_invariant(self) -> None:
        cached = self.cached_model.cached_length
        if cached != self.num_committed - 1:
            raise RuntimeError(
                f"KV cache invariant broken: {cached} cached positions for {self.num_committed} committed tokens "
                "(expected committed - 1)"
            )
