"""The speculative decoding loop: one iteration per target forward, in named phases.

prompt ids ─► Drafter.propose ─► Target.score ─► Verifier.verify ─► commit ─► rollback caches ─► stop?

The front end (prompt encoding, stopping, streaming) and the per-generation state are in
``generation.py``; the terms (accepted, recovered, bonus, τ) in ``verifiers/base.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from flyspec.breaker import CircuitBreaker
from flyspec.config import ConfigError, DecodeConfig, SpeculationConfig
from flyspec.draft_length import DraftLength, new_draft_length, resolve_policy
from flyspec.drafters.base import Drafter
from flyspec.generation import Decoder, Generation
from flyspec.models import LoadedModel
from flyspec.names import COPY_DRAFTERS
from flyspec.step_cost import StepCost
from flyspec.streaming import Step
from flyspec.types import Draft, VerifyContext
from flyspec.verifiers.base import Verifier


def check_draft_length(verifier: Verifier, speculation: SpeculationConfig) -> None:
    """Refuse a draft length the verifier cannot use (needs no model: ``build_decoder`` checks it before loading)."""
    shortest = verifier.min_draft_tokens
    if speculation.num_draft_tokens < shortest:
        raise ConfigError(
            f"num_draft_tokens ({speculation.num_draft_tokens}) is too short for verifier {verifier.name!r}: "
            f"it needs at least {shortest} (FLy: window_size + 1, or no mismatch could ever be judged); "
            "raise --num-draft-tokens or lower --window-size"
        )


class SpeculativeDecoder(Decoder):
    """Drafter + target + verifier. One generation at a time per instance (caches are per instance).

    ``speculation`` gives the draft length (``num_draft_tokens``, ``draft_length``) and describes what runs;
    ``step_cost`` is the target's forward cost t(n), which the ``cost`` draft-length policy needs.
    """

    def __init__(
        self,
        target: LoadedModel,
        drafter: Drafter,
        verifier: Verifier,
        config: DecodeConfig | None = None,
        speculation: SpeculationConfig | None = None,
        step_cost: StepCost | None = None,
    ) -> None:
        super().__init__(target, config)
        self.drafter = drafter
        self.verifier = verifier
        self.speculation = speculation or SpeculationConfig()
        self.step_cost = step_cost
        self.profile: Any = None  # the calibration profile that set the lossy settings (profile.py), if any
        self.validate(self.config)

    @property
    def draft_length_policy(self) -> str:
        """The draft-length policy that runs: ``auto`` is ``cost`` under a lossless verifier when the
        decoder has the target's step cost (``build_decoder`` measures it), else ``fixed``."""
        config = self.speculation.draft_length
        policy = resolve_policy(config, self.verifier.lossless, self.drafter.name)
        return "fixed" if policy == "cost" and self.step_cost is None and config.policy == "auto" else policy

    def validate(self, config: DecodeConfig) -> None:
        check_draft_length(self.verifier, self.speculation)
        if self.speculation.draft_length.policy == "cost" and self.step_cost is None:
            raise ConfigError(
                "the cost-aware draft length needs the target's forward cost: build the decoder with "
                "flyspec.build_decoder, or pass step_cost=flyspec.step_cost.step_cost(target, k + 1)"
            )

    def new_draft_length(self) -> DraftLength:
        speculation = self.speculation
        return new_draft_length(
            dataclasses.replace(speculation.draft_length, policy=self.draft_length_policy),
            speculation.num_draft_tokens,
            self.verifier.min_draft_tokens,
            self.step_cost,
            cheap_drafts=self.drafter.name in COPY_DRAFTERS,
        )

    def _steps(self, generation: Generation) -> Iterator[Step]:
        sampling, generator, stats = generation.config.sampling, generation.generator, generation.stats
        device = self.device  # every tensor of a step lives on the target's device
        self.drafter.reset(generation.prompt_ids)
        self._prefill(generation)
        token_ids = generation.token_ids  # grows in place as tokens are committed
        breaker = CircuitBreaker.of(self.speculation.breaker, stats)  # a profile's: strict once loosening runs wild
        context = VerifyContext(token_ids, len(generation.prompt_ids), self.target.vocabulary, breaker=breaker)
        try:
            while not generation.finished:
                # draft: up to k tokens after the committed ones
                requested, budget = generation.draft_budget()
                draft, drafting_started = Draft.empty(device), stats.draft_time_s
                if budget > 0:
                    with stats.timing("draft", device):
                        # a no-op unless a draft model sits on another device than the target
                        draft = self.drafter.propose(token_ids, budget, sampling, generator).to(device)
                # the draft-length policy may verify fewer (cost-aware: the most tokens per second)
                draft, requested = generation.to_verify(draft, stats.draft_time_s - drafting_started, requested)
                # score: [last committed token] + draft in one target forward
                with stats.timing("target", device):
                    target_logits = self.scorer.score(token_ids[-1], draft.tokens)  # [k + 1, vocab]
                # verify: accepted prefix + one recovered or bonus token
                verdict = self.verifier.verify(draft, target_logits, sampling, generator, context)
                # commit up to the first stop condition, then roll both caches back to what was committed
                committed = generation.commit(verdict.tokens, verdict, draft.num_tokens, requested)
                self.scorer.rollback(token_ids)
                self.drafter.rollback(len(token_ids))
                yield committed, verdict.loose_positions
        finally:  # also when the stream is closed early: the committed tokens are still worth remembering
            self.drafter.finish(token_ids)
            stats.drafter = self.drafter.report()  # once, not per step (it can take the n-gram cache's lock)
