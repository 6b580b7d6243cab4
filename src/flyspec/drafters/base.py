"""The Drafter protocol: propose draft tokens for the positions after the committed ones."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from flyspec.config import SamplingConfig
from flyspec.sampling.coupled import Draws
from flyspec.types import Draft


@runtime_checkable
class Drafter(Protocol):
    """Proposes up to ``num_draft_tokens`` tokens; keeps any per-request state (caches) itself.

    Call order per generation: ``reset(prompt)``, then per step ``propose`` → (target verifies)
    → ``rollback(num_committed)``. A drafter may return fewer tokens than asked (even none).
    ``finish(token_ids)`` ends a generation (also one stopped early) with the prompt and every
    committed token: drafters that learn across generations record them there, and only there,
    since only the target's committed tokens are worth remembering. ``report()`` gives the
    drafter's own counters for the generation so far (draft forwards, cache hits, chosen
    layers, ...); they land in ``DecodeStats.drafter``.
    """

    name: str

    def reset(self, prompt_ids: list[int]) -> None: ...

    def propose(
        self,
        token_ids: list[int],  # every committed token: prompt + generated
        num_draft_tokens: int,
        sampling: SamplingConfig,
        draws: Draws | None,
    ) -> Draft: ...

    def rollback(self, num_committed: int) -> None: ...

    def finish(self, token_ids: list[int]) -> None: ...

    def report(self) -> dict[str, Any]: ...
