"""The speculative decoding loop: one iteration per target forward, in named phases.

prompt ids ─► Drafter.propose ─► Target.score ─► Verifier.verify ─► commit ─► rollback caches ─► stop?

The front end (prompt encoding, stopping, streaming) and the per-generation state are in
``generation.py``; building a decoder from a config (the profile's decision, models, drafter stack, step
cost) in ``api.py``; the terms (accepted, recovered, bonus, τ) in ``verifiers/base.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from flyspec.config import DecodeConfig, SamplingConfig, SpeculationConfig
from flyspec.config.names import COPY_DRAFTERS
from flyspec.decoding.breaker import CircuitBreaker
from flyspec.decoding.draft_length import DraftLength, decoder_policy, new_draft_length, resolve_policy
from flyspec.decoding.generation import Decoder, Generation
from flyspec.decoding.streaming import Step
from flyspec.drafters.base import Drafter
from flyspec.drafters.prediction import MAX_PREDICTION_DRAFT_TOKENS, PredictionDrafter
from flyspec.drafters.registry import StackResources, make_drafter
from flyspec.profiles import Profile
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.runtime.step_cost import StepCost
from flyspec.types import Draft, VerifyContext
from flyspec.verifiers.base import Verifier
from flyspec.verifiers.exact import ExactVerifier
from flyspec.verifiers.guard import prepare as prepare_guards
from flyspec.verifiers.registry import check_draft_length
from flyspec.verifiers.tokens import vocabulary_of


class SpeculativeDecoder(Decoder):
    """Drafter + target + verifier. One generation at a time per instance (caches are per instance).

    ``speculation`` gives the draft length (``num_draft_tokens``, ``draft_length``) and describes what runs;
    ``step_cost`` is the target's forward cost t(n), which the ``cost`` draft-length policy needs;
    ``profile`` the calibration profile that set the lossy settings (``profiles/profile.py``), if any.
    """

    def __init__(
        self,
        target: LoadedModel,
        drafter: Drafter,
        verifier: Verifier,
        config: DecodeConfig | None = None,
        speculation: SpeculationConfig | None = None,
        step_cost: StepCost | None = None,
        profile: Profile | None = None,
    ) -> None:
        super().__init__(target, config)
        speculation = speculation or SpeculationConfig()
        self.drafter, self.verifier, self.speculation = drafter, verifier, speculation
        self.step_cost, self.profile = step_cost, profile
        # the policy that runs, ``auto`` decided (``draft_length.decoder_policy``)
        self.draft_length_policy = decoder_policy(
            speculation.draft_length, verifier.lossless, drafter.name, step_cost, self.config.sampling.greedy
        )
        check_draft_length(verifier, speculation)  # FLy needs window_size + 1 draft tokens
        self.exact = ExactVerifier()  # where the lossy settings' sampling range does not cover a generation

    @classmethod
    def build(
        cls,
        target: LoadedModel,
        verifier: Verifier,
        config: DecodeConfig,
        speculation: SpeculationConfig,
        resources: StackResources,
        step_cost: StepCost | None = None,
        profile: Profile | None = None,
    ) -> SpeculativeDecoder:
        """A decoder with ``speculation``'s drafter stack (models, n-gram caches and calibrations from ``resources``)
        and, for a lossy ``verifier``, the trust guards' token-class tables built before any timed step."""
        drafter = make_drafter(speculation, target, resources)
        if not verifier.lossless:
            prepare_guards(vocabulary_of(target), speculation.guard)
        return cls(target, drafter, verifier, config, speculation, step_cost, profile)

    def new_draft_length(self, greedy: bool = True, prediction: bool = False) -> DraftLength:
        speculation, verifier = self.speculation, self.verifier
        policy = self.draft_length_policy
        # a call that samples: ``auto`` with a model drafter must not make a seeded sample depend on timings
        if policy == "cost" and not greedy:
            policy = resolve_policy(speculation.draft_length, verifier.lossless, self.drafter.name, greedy=False)
        config = dataclasses.replace(speculation.draft_length, policy=policy)
        # a copy costs nothing per token: propose all, cut later (a prediction's drafts are copies too; beside a model
        # drafter, whose tokens each cost a forward, the policy asks for what the measured acceptance warrants)
        copies = self.drafter.name in COPY_DRAFTERS
        maximum = speculation.num_draft_tokens
        if prediction and policy == "cost":  # a prediction's copies may run longer where its acceptance pays
            maximum = max(maximum, MAX_PREDICTION_DRAFT_TOKENS)
        return new_draft_length(config, maximum, verifier.min_draft_tokens, self.step_cost, copies, timed=greedy)

    def verifier_for(self, sampling: SamplingConfig, predicted: bool = False) -> Verifier:
        """The verifier of a generation decoded with ``sampling`` (``predicted``: with a prediction): this decoder's, or
        ``exact`` where its lossy settings were measured at other sampling, or without predictions
        (``SpeculationConfig.sampling_range``: a calibration profile's)."""
        if self.verifier.lossless or self.speculation.sampling_range.covers(sampling, predicted):
            return self.verifier
        return self.exact

    def drafter_for(self, generation: Generation) -> Drafter:
        """This decoder's drafter, or for a generation with a prediction, a drafter of it wrapping this one
        (for that generation only: ``drafters/prediction.py``)."""
        if generation.prediction_ids is None:
            return self.drafter
        inner_max = self.speculation.num_draft_tokens  # a longer prediction maximum is never the drafter's
        return PredictionDrafter(self.drafter, generation.prediction_ids, self.device, inner_max)

    def _steps(self, generation: Generation) -> Iterator[Step]:
        sampling, stats = generation.config.sampling, generation.stats
        measured, predicted = self.speculation.sampling_range, generation.prediction_ids is not None
        verifier = self.verifier_for(sampling, predicted)
        if verifier is not self.verifier:  # said once, in the stats (the CLI's line, the server's usage field)
            if measured.covers(sampling):  # only the prediction is outside what the profile measured
                stats.exact_with_prediction = True
            else:
                stats.exact_outside_sampling_range = measured.describe()
        device = self.device  # every tensor of a step lives on the target's device
        drafter = self.drafter_for(generation)
        drafter.reset(generation.prompt_ids)
        self._prefill(generation)
        token_ids = generation.token_ids  # grows in place as tokens are committed
        breaker = CircuitBreaker.of(self.speculation.breaker, stats)  # a profile's: strict once loosening runs wild
        state = verifier.new_state()  # the rule's, for this generation only (adasd's running means)
        vocabulary = vocabulary_of(self.target)
        context = VerifyContext(token_ids, len(generation.prompt_ids), vocabulary, breaker=breaker, rule_state=state)
        # The first token comes from the prefill's logits alone, as in vLLM: no draft is scored before it (the
        # prefill already holds the target's answer there), so it is committed as soon as the prefill ends and the
        # first draft follows it with one more token of context. Lossless rules commit what they would anyway.
        first: bool = True
        try:
            while not generation.finished:
                # draft: up to k tokens after the committed ones
                requested: int | None = None  # the draft-length policy's request (none for the first step)
                draft, drafting_started = Draft.empty(device), stats.draft_time_s
                draws = generation.draws()  # T > 0: the coupled noise from the next position on, for both
                if not first:
                    requested, budget = generation.draft_budget()
                    if budget > 0:
                        with stats.timing("draft", device):
                            # a no-op unless a draft model sits on another device than the target
                            draft = drafter.propose(token_ids, budget, sampling, draws).to(device)
                    # the draft-length policy may verify fewer (cost-aware: the most tokens per second)
                    draft, requested = generation.to_verify(draft, stats.draft_time_s - drafting_started, requested)
                first = False
                # score: [last committed token] + draft in one target forward
                with stats.timing("target", device):
                    target_logits = self.scorer.score(token_ids[-1], draft.tokens)  # [k + 1, vocab]
                # verify: accepted prefix + one recovered or bonus token
                verdict = verifier.verify(draft, target_logits, sampling, draws, context)
                # commit up to the first stop condition, then roll both caches back to what was committed
                committed = generation.commit(verdict.tokens, verdict, draft, requested)
                self.scorer.rollback(token_ids)
                drafter.rollback(len(token_ids))
                yield committed, verdict.loose_positions
        finally:  # also when the stream is closed early: the committed tokens are still worth remembering
            drafter.finish(token_ids)
            stats.drafter = drafter.report()  # once, not per step (it can take the n-gram cache's lock)
