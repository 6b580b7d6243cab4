"""One generation: its state (:class:`Generation`), and the front end every decoder shares.

:class:`Decoder` turns a prompt (text, chat or ids) into token ids, makes the generation's
:class:`Stopper` and statistics, and wraps the subclass's loop (``_steps``) in a
:class:`GenerationStream`. The loops live in ``speculative.py`` (speculative) and ``plain.py``
(plain); neither encodes, detokenizes or streams.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from flyspec.config import ConfigError, DecodeConfig
from flyspec.decoding.draft_length import DraftLength
from flyspec.decoding.result import GenerationResult
from flyspec.decoding.stats import DecodeStats
from flyspec.decoding.stopping import Stopper
from flyspec.decoding.streaming import GenerationStream, Step
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.runtime.target import Target
from flyspec.sampling.coupled import CoupledNoise, Draws, NoiseRows
from flyspec.sampling.sampler import same_device
from flyspec.types import Draft, Verdict

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


def encode_prediction(target: LoadedModel, prediction: str | list[int]) -> list[int]:
    """A prediction's token ids: text tokenized with the target's tokenizer (no special tokens added), or ids as
    given, each checked against the target's vocabulary (an id past it would fail the target's forward)."""
    if isinstance(prediction, str):
        return list(target.tokenizer.encode(prediction, add_special_tokens=False))
    vocab_size = getattr(target.model.config, "vocab_size", None) or len(target.tokenizer)
    for token in prediction:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise ConfigError(
                f"the prediction's token ids must be integers in 0 .. {vocab_size - 1} (got {token!r}); "
                "or give the prediction as text"
            )
    return list(prediction)


def make_stopper(target: LoadedModel, config: DecodeConfig, prompt_length: int) -> Stopper:
    room = context_room(target, prompt_length)
    if room < 1:
        raise ConfigError(f"the prompt ({prompt_length} tokens) fills the model's context window; shorten it")
    eos_token_ids = frozenset() if config.ignore_eos else target.eos_token_ids
    return Stopper(target.tokenizer, eos_token_ids, min(config.max_new_tokens, room), config.stop_strings)


@dataclass
class Generation:
    """Everything one generation changes while it runs; made per call, so nothing outlives it."""

    prompt_ids: list[int]
    config: DecodeConfig
    generator: torch.Generator | None  # seeds sampling (T>0); greedy decoding draws nothing
    noise: CoupledNoise | None  # T>0: the coupled noise, keyed by one draw of the generator (sampling/coupled.py)
    stopper: Stopper
    draft_length: DraftLength | None = None  # speculative decoding only
    prediction_ids: list[int] | None = None  # the request's prediction (OpenAI's Predicted Outputs), if any
    stats: DecodeStats = field(default_factory=DecodeStats)
    token_ids: list[int] = field(init=False)  # prompt + committed tokens, appended in place

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.stopper.finished

    def draws(self) -> Draws | None:
        """The next step's random numbers (T > 0), from the next position on; None when greedy."""
        return None if self.noise is None else Draws(self.noise, len(self.token_ids), self.generator)

    def draft_budget(self) -> tuple[int, int]:
        """(draft length asked for, tokens that may be drafted): never past the length limit,
        since the last slot is the recovered/bonus token."""
        assert self.draft_length is not None, "plain decoding drafts nothing"
        requested = self.draft_length.next()
        return requested, min(requested, self.stopper.remaining - 1)

    def to_verify(self, draft: Draft, draft_seconds: float, requested: int) -> tuple[Draft, int]:
        """The part of ``draft`` the draft-length policy verifies, and the length to record as asked for
        (a cost-aware policy's choice; a fixed or heuristic policy's request)."""
        assert self.draft_length is not None, "plain decoding drafts nothing"
        keep = self.draft_length.choose(draft, draft_seconds)
        return draft.head(keep), self.draft_length.recorded(requested, keep)

    def commit(
        self,
        tokens: list[int],
        verdict: Verdict | None = None,
        draft: Draft | None = None,
        requested: int | None = None,
    ) -> list[int]:
        """Commit ``tokens`` up to the first stop condition and record the step (``draft``: what was verified);
        return what was committed."""
        committed = self.stopper.commit(tokens)
        self.token_ids += committed
        num_drafted, sources = (draft.num_tokens, draft.sources) if draft is not None else (0, None)
        self.stats.observe(num_drafted, verdict, len(committed), requested=requested, sources=sources)
        if self.draft_length is not None and verdict is not None:
            self.draft_length.observe(num_drafted, verdict.num_accepted)
        return committed


class Decoder:
    """Shared front end: prompt encoding, stopping, statistics and streaming around ``_steps``."""

    def __init__(self, target: LoadedModel, config: DecodeConfig | None = None) -> None:
        self.target = target
        self.scorer = Target(target)  # the target model's KV cache for this decoder's generations
        self.config = config or DecodeConfig()
        # sampling noise rows shared with other decoders of the same seeds (calibration's replay); None: per generation
        self.noise_rows: NoiseRows | None = None

    @property
    def device(self) -> torch.device:
        """The target's device: drafts, probabilities and random numbers of every step live here."""
        return self.scorer.device

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
        prediction: str | list[int] | None = None,
    ) -> GenerationStream:
        """Iterate the returned stream for text pieces; its ``result`` is set at the end.

        ``generator`` seeds sampling (T>0); greedy decoding draws no random numbers. It must be on
        the target's device: ``make_generator(seed, decoder.device)``. One number is drawn from it when the
        generation starts, the key of every sampled token's noise (``sampling/coupled.py``): a generator made
        with a seed names one text, whatever the speculation, and one reused gives each generation a new text.

        ``prediction`` (OpenAI's Predicted Outputs): what the output is expected to be, as text (tokenized with the
        target's tokenizer, no special tokens) or token ids. A speculative decoder drafts from it beside its own
        drafter, for this generation only (``drafters/prediction.py``); it changes the speed, and under a lossless
        verifier never the text. Plain decoding drafts nothing and refuses one (``ConfigError``).
        """
        config = config or self.config
        if generator is not None and not same_device(generator.device, self.device):
            raise ConfigError(
                f"the random generator is on {generator.device} but the target on {self.device}; "
                "make it with flyspec.make_generator(seed, decoder.device)"
            )
        draft_length = self.new_draft_length(config.sampling.greedy, prediction is not None)
        if prediction is not None and draft_length is None:
            raise ConfigError(
                "plain decoding drafts nothing, so it cannot use a prediction: decode with a speculative decoder "
                "(flyspec.build_decoder, flyspec.generate), or leave the prediction out"
            )
        prediction_ids = None if prediction is None else encode_prediction(self.target, prediction)
        prompt_ids = encode(self.target, prompt, use_chat)
        stopper = make_stopper(self.target, config, len(prompt_ids))
        noise = None if config.sampling.greedy else CoupledNoise.draw(generator, self.device, self.noise_rows)
        generation = Generation(prompt_ids, config, generator, noise, stopper, draft_length, prediction_ids)
        return GenerationStream(self._steps(generation), generation.stopper, generation.stats, prompt_ids)

    def new_draft_length(self, greedy: bool = True, prediction: bool = False) -> DraftLength | None:
        """A generation's draft-length policy (None: this decoder drafts nothing); ``prediction``: the generation
        drafts from a prediction too."""
        return None

    def _prefill(self, generation: Generation) -> None:
        """Start the target on the prompt (the first step scores its last token)."""
        with generation.stats.timing("prefill", self.device):
            generation.stats.num_reused_prompt_tokens = self.scorer.start(generation.prompt_ids)

    def _steps(self, generation: Generation) -> Iterator[Step]:
        raise NotImplementedError
