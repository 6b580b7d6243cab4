"""One backend per benchmark method: generate for a (possibly multi-turn) prompt, return what it measured.

Every backend gets the same prompt token ids (encoded once by flyspec, chat template applied),
so methods differ only in how they decode. A multi-turn prompt is run as a chat: each turn
sees the method's own earlier answers (Spec-Bench's MT-bench protocol). A ``prediction+...`` method
is also given the prompt's prediction (OpenAI's predicted output); no other method is: the peers'
engines have no such field (vLLM's rows draft from the context, as ``ngram+exact`` does).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from flyspec.api import build_decoder
from flyspec.bench.data import BenchPrompt
from flyspec.config import DecodeConfig, SamplingConfig, SpeculationConfig
from flyspec.decoding.generation import Decoder
from flyspec.decoding.plain import PlainDecoder
from flyspec.drafters.cross_tokenizer import tokenizers_match
from flyspec.harness.methods import Method
from flyspec.resources import Resources
from flyspec.runtime.clock import device_clock
from flyspec.runtime.loaded_model import LoadedModel, PromptCodec
from flyspec.sampling.sampler import make_generator


@dataclass
class TurnOutput:
    """One generation's tokens, text and counters (``None`` where a peer does not expose them)."""

    token_ids: list[int]
    text: str
    wall_time_s: float
    time_to_first_token_s: float | None = None  # from the request to its first token (None: not known)
    num_target_forwards: int | None = None
    num_proposed: int | None = None
    num_accepted: int | None = None
    num_loose_accepts: int | None = None
    accepted_per_position: list[int] = field(default_factory=list)
    proposed_per_position: list[int] = field(default_factory=list)
    prefill_time_s: float | None = None
    num_reused_prompt_tokens: int | None = None  # prompt tokens the engine's cache held already (None: not known)
    target_time_s: float | None = None
    draft_time_s: float | None = None
    requested_draft_lengths: dict[int, int] = field(default_factory=dict)  # draft length asked → steps
    drafter_stats: dict = field(default_factory=dict)  # Drafter.report() at the end of the turn
    # OpenAI's usage counts of a request given a prediction (None: the method was given none)
    num_accepted_prediction_tokens: int | None = None
    num_rejected_prediction_tokens: int | None = None


# transformers' other warpers, off: a sampled hf-* request draws from flyspec's distribution (temperature, top-k, top-p)
NEUTRAL = {"min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "repetition_penalty": 1.0}

Generate = Callable[[list[int], int, int], TurnOutput]  # (prompt ids, max new tokens, seed) → output


class Backend(Protocol):
    """``prediction``: given to a ``prediction+...`` method only (``run_prompt``), so a peer never gets one."""

    method: Method

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, seed: int, prediction: str | None = None
    ) -> TurnOutput: ...


@dataclass(frozen=True)
class BackendSettings:
    """What every backend shares: sampling, the speculation settings (each method sets its drafter and
    verifier) and the loaded models, calibrations and caches (``resources``)."""

    sampling: SamplingConfig
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    use_chat: bool | None = None
    hf_lookup_tokens: int = 10
    resources: Resources = field(default_factory=Resources)


class FlyspecBackend:
    """``plain`` (flyspec's plain decoding) or a speculative ``[drafter+]verifier[+modifier]``."""

    def __init__(self, method: Method, target: LoadedModel, draft: LoadedModel | None, settings: BackendSettings):
        self.method = method
        self.sampling = settings.sampling
        self.decoder: Decoder
        if method.verifier is None:
            self.decoder = PlainDecoder(target, DecodeConfig(sampling=settings.sampling))
        else:
            spec = method.speculation(settings.speculation)
            if draft is not None and spec.draft_model is None:
                spec = dataclasses.replace(spec, draft_model=draft.name)
            # n-gram caches of its own: shared with the other methods they would hold this very prompt's
            # answer (they run it first), and the method would be measured on repeated requests
            resources = settings.resources.isolated()
            resources.model(target)
            if draft is not None:
                resources.model(draft)
            self.decoder = build_decoder(target, spec, DecodeConfig(sampling=settings.sampling), resources=resources)

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, seed: int, prediction: str | None = None
    ) -> TurnOutput:
        config = dataclasses.replace(self.decoder.config, max_new_tokens=max_new_tokens, sampling=self.sampling)
        generator = make_generator(seed, self.decoder.device)
        predicted = {} if prediction is None else {"prediction": prediction}  # the engine's keyword, OpenAI's name
        result = self.decoder.generate(prompt_ids, config=config, generator=generator, **predicted)
        stats = result.stats
        speculative = self.method.verifier is not None
        return TurnOutput(
            token_ids=result.token_ids,
            text=result.text,
            wall_time_s=stats.wall_time_s,
            time_to_first_token_s=stats.time_to_first_token_s,
            num_target_forwards=stats.num_target_forwards,
            num_proposed=stats.num_proposed,
            num_accepted=stats.num_accepted,
            num_loose_accepts=stats.num_loose_accepts,
            accepted_per_position=list(stats.accepted_per_position) if speculative else [],
            proposed_per_position=list(stats.proposed_per_position) if speculative else [],
            prefill_time_s=stats.prefill_time_s,
            num_reused_prompt_tokens=stats.num_reused_prompt_tokens,
            target_time_s=stats.target_time_s,
            draft_time_s=stats.draft_time_s,
            requested_draft_lengths=dict(stats.requested_draft_lengths) if speculative else {},
            drafter_stats=dict(stats.drafter),
            num_accepted_prediction_tokens=stats.num_accepted_prediction_tokens if predicted else None,
            num_rejected_prediction_tokens=stats.num_rejected_prediction_tokens if predicted else None,
        )


class HFGenerateBackend:
    """transformers ``generate()``: plain, prompt lookup, or assisted by a draft model."""

    def __init__(self, method: Method, target: LoadedModel, draft: LoadedModel | None, settings: BackendSettings):
        self.method = method
        self.target = target
        self.sampling = settings.sampling
        eos = sorted(target.eos_token_ids)
        self.options: dict = {"eos_token_id": eos, "pad_token_id": eos[0] if eos else 0}
        if method.name == "hf-lookup":
            self.options["prompt_lookup_num_tokens"] = settings.hf_lookup_tokens
        elif method.name == "hf-assisted":
            assert draft is not None
            self.assistant: dict = {"assistant_model": draft.model}
            if not tokenizers_match(draft.tokenizer, target.tokenizer):  # Universal Assisted Generation
                self.assistant.update(tokenizer=target.tokenizer, assistant_tokenizer=draft.tokenizer)
            self.options["num_assistant_tokens"] = settings.speculation.num_draft_tokens

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, seed: int, prediction: str | None = None
    ) -> TurnOutput:
        greedy = self.sampling.greedy
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=not greedy,
            **({} if greedy else self._sampling_options()),
            **self.options,
        )
        device = next(self.target.model.parameters()).device
        inputs = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        extra = self.assistant if self.method.name == "hf-assisted" else {}
        torch.manual_seed(seed)
        first_token = _FirstToken()
        started = device_clock(device)
        with torch.inference_mode():
            # transformers types PreTrainedModel without GenerationMixin; every causal LM it loads has generate
            output = self.target.model.generate(  # type: ignore[operator]
                inputs, attention_mask=torch.ones_like(inputs), generation_config=config, streamer=first_token, **extra
            )
        wall = device_clock(device) - started
        new_tokens = _cut_at_eos(output[0, len(prompt_ids) :].tolist(), self.target.eos_token_ids)
        ttft = None if first_token.at is None else first_token.at - started
        return TurnOutput(new_tokens, self.target.decode(new_tokens), wall, time_to_first_token_s=ttft)

    def _sampling_options(self) -> dict:
        # every warper given its neutral value where flyspec has none: one left None takes the model's
        # generation_config or transformers' default (top_k 50), and the peer would sample another distribution
        sampling = self.sampling
        return {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k, **NEUTRAL}


class _FirstToken(BaseStreamer):
    """When ``generate`` handed over its first new token (its first ``put`` is the prompt): the time to first token."""

    def __init__(self) -> None:
        self.puts = 0
        self.at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()  # on the host after the token's copy there: the device is done with it

    def end(self) -> None:
        pass


def _cut_at_eos(token_ids: list[int], eos_token_ids: frozenset[int]) -> list[int]:
    for index, token in enumerate(token_ids):
        if token in eos_token_ids:
            return token_ids[: index + 1]
    return token_ids


@dataclass
class PromptOutput:
    """A whole benchmark prompt (all turns) for one method: summed counters, joined tokens."""

    turns: list[TurnOutput]
    num_prompt_tokens: int
    prompt_ids: list[list[int]] = field(default_factory=list)  # each turn's prompt (the conversation so far)

    @property
    def token_ids(self) -> list[int]:
        return [token for turn in self.turns for token in turn.token_ids]

    @property
    def texts(self) -> list[str]:
        return [turn.text for turn in self.turns]

    @property
    def generations(self) -> list[tuple[list[int], list[int]]]:
        """(prompt ids, output ids) of each turn: what the target scores (``bench/nll.py``)."""
        return [(prompt, turn.token_ids) for prompt, turn in zip(self.prompt_ids, self.turns, strict=True)]


def run_prompt(
    backend: Backend, target: LoadedModel, prompt: BenchPrompt, max_new_tokens: int, seed: int, use_chat: bool | None
) -> PromptOutput:
    """Run every turn of ``prompt``; later turns see this method's own earlier answers. The prompt's prediction
    (single-turn prompts only: ``bench/data.py``) goes to a ``prediction+...`` method alone."""
    answers: list[str] = []
    turns: list[TurnOutput] = []
    prompts: list[list[int]] = []
    given = {"prediction": prompt.prediction} if backend.method.prediction and prompt.prediction else {}
    for index in range(len(prompt.turns)):
        prompt_ids = conversation_ids(target, prompt.turns[: index + 1], answers, use_chat)
        prompts.append(prompt_ids)
        output = backend.generate(prompt_ids, max_new_tokens, seed + index, **given)
        turns.append(output)
        answers.append(output.text)
    return PromptOutput(turns, sum(map(len, prompts)), prompts)


def conversation_ids(
    target: PromptCodec, turns: tuple[str, ...], answers: list[str], use_chat: bool | None
) -> list[int]:
    """Prompt ids for the last of ``turns`` after the earlier turns and their ``answers``."""
    chat = target.has_chat_template if use_chat is None else use_chat
    if chat:
        messages = []
        for turn, answer in zip(turns, [*answers, None], strict=False):
            messages.append({"role": "user", "content": turn})
            if answer is not None:
                messages.append({"role": "assistant", "content": answer})
        return target.encode_prompt(messages, True)
    text = "".join(f"{turn}\n{answer}\n\n" for turn, answer in zip(turns, answers, strict=False)) + turns[-1]
    return target.encode_prompt(text, False)
