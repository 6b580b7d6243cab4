"""The speculative decoding loop.

prompt ids ─► Drafter.propose ─► Target.score ─► Verifier.verify ─► commit ─► rollback caches ─► stop?
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from flyspec.config import ConfigError, DecodeConfig, SpeculationConfig
from flyspec.draft_length import DraftLength
from flyspec.drafters.base import Drafter
from flyspec.models import LoadedModel
from flyspec.stats import DecodeStats
from flyspec.stopping import Stopper
from flyspec.streaming import GenerationStream, Step
from flyspec.target import Target
from flyspec.types import Draft, GenerationResult, Verdict, VerifyContext
from flyspec.verifiers.base import Verifier

Prompt = str | list[dict[str, str]] | list[int]


def encode(target: LoadedModel, prompt: Prompt, use_chat: bool | None) -> list[int]:
    """Token ids for a string, a chat (list of messages) or already-tokenized ids."""
    if isinstance(prompt, list) and prompt and all(isinstance(token, int) for token in prompt):
        return list(prompt)  # type: ignore[arg-type]
    if isinstance(prompt, list) and not prompt:
        raise ConfigError("the prompt is empty; give some text to continue")
    return target.encode_prompt(prompt, use_chat)  # type: ignore[arg-type]


def context_room(target: LoadedModel, num_tokens: int) -> int:
    """How many more positions the target's context window allows."""
    limit = getattr(target.model.config, "max_position_embeddings", None)
    return limit - num_tokens if limit else 1 << 30


def make_stopper(target: LoadedModel, config: DecodeConfig, prompt_length: int) -> Stopper:
    room = context_room(target, prompt_length)
    if room < 1:
        raise ConfigError(f"the prompt ({prompt_length} tokens) fills the model's context window; shorten it")
    eos_token_ids = frozenset() if config.ignore_eos else target.eos_token_ids
    return Stopper(target.tokenizer, eos_token_ids, min(config.max_new_tokens, room), config.stop_strings)


class Decoder:
    """Shared front end: prompt encoding, stopping, statistics and streaming around ``_steps``."""

    def __init__(self, target: LoadedModel, config: DecodeConfig | None = None) -> None:
        self.loaded = target
        self.target = Target(target)
        self.config = config or DecodeConfig()

    def generate(self, prompt: Prompt, **options) -> GenerationResult:
        """Generate and return the result. Options as for :meth:`stream`."""
        return self.stream(prompt, **options).collect()

    def stream(
        self,
        prompt: Prompt,
        *,
        config: DecodeConfig | None = None,
        generator: torch.Generator | None = None,
        use_chat: bool | None = None,
    ) -> GenerationStream:
        """Iterate the returned stream for text pieces; its ``result`` is set at the end.

        ``generator`` seeds sampling (T>0); greedy decoding draws no random numbers.
        """
        config = config or self.config
        self.validate(config)
        prompt_ids = encode(self.loaded, prompt, use_chat)
        stopper = make_stopper(self.loaded, config, len(prompt_ids))
        stats = DecodeStats()
        return GenerationStream(self._steps(prompt_ids, config, generator, stopper, stats), stopper, stats, prompt_ids)

    def validate(self, config: DecodeConfig) -> None:
        """Checks that need the decode config together with the decoder's components."""

    def _prefill(self, prompt_ids: list[int], stats: DecodeStats) -> list[int]:
        """Start the target (and any per-request state) on a prompt; return the committed tokens."""
        started = time.perf_counter()
        self.target.start(prompt_ids)
        stats.prefill_time_s = time.perf_counter() - started
        return list(prompt_ids)

    def _steps(
        self,
        prompt_ids: list[int],
        config: DecodeConfig,
        generator: torch.Generator | None,
        stopper: Stopper,
        stats: DecodeStats,
    ) -> Iterator[Step]:
        raise NotImplementedError


class SpeculativeDecoder(Decoder):
    """Drafter + target + verifier. One generation at a time per instance (caches are per instance).

    ``speculation`` gives the draft length (``num_draft_tokens``, ``draft_length``) and describes what runs.
    """

    def __init__(
        self,
        target: LoadedModel,
        drafter: Drafter,
        verifier: Verifier,
        config: DecodeConfig | None = None,
        speculation: SpeculationConfig | None = None,
    ) -> None:
        super().__init__(target, config)
        self.drafter = drafter
        self.verifier = verifier
        self.speculation = speculation or SpeculationConfig()
        self.validate(self.config)

    def validate(self, config: DecodeConfig) -> None:
        shortest = self.verifier.min_draft_tokens
        num_draft_tokens = self.speculation.num_draft_tokens
        if num_draft_tokens < shortest:
            raise ConfigError(
                f"num_draft_tokens ({num_draft_tokens}) is too short for verifier {self.verifier.name!r}: "
                f"it needs at least {shortest} (FLy: window_size + 1, or no mismatch could ever be judged); "
                "raise --num-draft-tokens or lower --window-size"
            )

    def _steps(
        self,
        prompt_ids: list[int],
        config: DecodeConfig,
        generator: torch.Generator | None,
        stopper: Stopper,
        stats: DecodeStats,
    ) -> Iterator[Step]:
        self.drafter.reset(prompt_ids)
        token_ids = self._prefill(prompt_ids, stats)
        context = VerifyContext(token_ids, len(prompt_ids), self.loaded.vocabulary)  # shares token_ids
        speculation = self.speculation
        draft_length = DraftLength(
            speculation.draft_length, speculation.num_draft_tokens, self.verifier.min_draft_tokens
        )
        try:
            while not stopper.finished:
                length = draft_length.next()
                committed, verdict, num_drafted = self._step(context, length, config, generator, stopper, stats)
                token_ids += committed
                stats.observe(num_drafted, verdict, len(committed), requested=length)
                draft_length.observe(num_drafted, verdict.num_accepted)
                self.target.rollback(len(token_ids))
                self.drafter.rollback(len(token_ids))
                yield committed, verdict.loose_positions
        finally:  # also when the stream is closed early: the committed tokens are still worth remembering
            self.drafter.finish(token_ids)
            stats.drafter = self.drafter.report()  # once, not per step (it can take the n-gram cache's lock)

    def _step(
        self,
        context: VerifyContext,
        length: int,
        config: DecodeConfig,
        generator: torch.Generator | None,
        stopper: Stopper,
        stats: DecodeStats,
    ) -> tuple[list[int], Verdict, int]:
        """Draft ≤ ``length`` tokens, score them in one target forward, verify: (committed, verdict, drafted)."""
        # never draft past the length limit: the last slot is the recovered/bonus token
        budget = min(length, stopper.remaining - 1)
        token_ids = context.token_ids
        started = time.perf_counter()
        draft = self.drafter.propose(token_ids, budget, config.sampling, generator) if budget > 0 else Draft.empty()
        drafted = time.perf_counter()
        target_logits = self.target.score(token_ids[-1], draft.tokens)  # [k + 1, vocab]
        stats.draft_time_s += drafted - started
        stats.target_time_s += time.perf_counter() - drafted
        verdict = self.verifier.verify(draft, target_logits, config.sampling, generator, context)
        return stopper.commit(verdict.tokens), verdict, draft.num_tokens
