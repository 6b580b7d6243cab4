"""From a request body to a ready-to-run generation, or a 4xx saying what to change.

Everything a request can get wrong is found here, before it takes a place in the queue: the
body's JSON and types, unsupported fields, the model name, the speculative settings, the prompt
length against the context window, and ``max_tokens`` against the cap.

Prompts are tokenized on a private copy of the tokenizer in a one-thread executor, so the event
loop never blocks on a long prompt and the worker's tokenizer is never used from two threads.
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import ValidationError

from flyspec.api import build_decoder
from flyspec.config import ConfigError, SamplingConfig
from flyspec.decoding import SpeculativeDecoder, context_room
from flyspec.models import LoadedModel
from flyspec.server.errors import APIError, bad_request, from_config_error, from_validation_error, parse_json_object
from flyspec.server.schemas import (
    IGNORED_FIELDS,
    UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    SpeculativeOptions,
)
from flyspec.server.settings import ServerLimits, SpeculationDefaults

RequestT = TypeVar("RequestT", CompletionRequest, ChatCompletionRequest)
GenerationRequest = CompletionRequest | ChatCompletionRequest
MODEL_DRAFTERS = ("draft-model", "multilevel")


def parse_request(raw: bytes, schema: type[RequestT]) -> RequestT:
    """Validate a body against ``schema``; unsupported standard fields are a 400 naming the field."""
    data = parse_json_object(raw)
    for name, unused_values in UNSUPPORTED_FIELDS.items():
        if name in data:
            value = data.pop(name)
            if not _is_unused(value, unused_values):
                raise bad_request(_unsupported_message(name, value), param=name, code="unsupported_parameter")
    for name in IGNORED_FIELDS:
        data.pop(name, None)
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        raise from_validation_error(error) from error


def _is_unused(value: Any, unused_values: tuple[Any, ...]) -> bool:
    """``value`` equals one of the values that mean "not used" (``True`` is not ``1`` here)."""
    return any(isinstance(value, bool) == isinstance(unused, bool) and value == unused for unused in unused_values)


def _unsupported_message(name: str, value: Any) -> str:
    if name in ("n", "best_of"):
        return f"{name}={value!r} is not supported: flyspec returns one choice per request; send separate requests"
    return f"{name} is not supported by flyspec serve (got {value!r}); leave it out"


@dataclass
class Plan:
    """A validated request, resolved against the server's defaults and limits."""

    request: GenerationRequest
    speculation: SpeculationDefaults
    prompt_ids: list[int]
    max_tokens: int
    decoder: SpeculativeDecoder


class Planner:
    """Resolves requests against one served model (and its optional draft model)."""

    def __init__(
        self,
        target: LoadedModel,
        defaults: SpeculationDefaults,
        limits: ServerLimits,
        *,
        draft_model: LoadedModel | None = None,
        model_names: tuple[str, ...] = (),
    ) -> None:
        self.target = target
        self.defaults = defaults
        self.limits = limits
        self.draft_model = draft_model
        self.model_names = model_names or (target.name,)
        # Prompt encoding only: the worker decodes with the original tokenizer at the same time.
        tokenizer = copy.deepcopy(target.tokenizer)
        self._prompt_model = LoadedModel(model=target.model, tokenizer=tokenizer, name=target.name)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flyspec-tokenize")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def plan(self, request: GenerationRequest) -> Plan:
        self.check_model(request.model)
        if request.stream_options is not None and not request.stream:
            raise bad_request("stream_options is only allowed with stream: true", param="stream_options")
        speculation = self.speculation(request.speculative)
        loop = asyncio.get_running_loop()
        prompt_ids = await loop.run_in_executor(self._executor, self._encode, request)
        max_tokens = self._max_tokens(request, len(prompt_ids))
        decoder = await loop.run_in_executor(self._executor, self._build_decoder, request, speculation, max_tokens)
        return Plan(request, speculation, prompt_ids, max_tokens, decoder)

    def _build_decoder(
        self, request: GenerationRequest, speculation: SpeculationDefaults, max_tokens: int
    ) -> SpeculativeDecoder:
        """A decoder sharing the loaded weights; cheap, but off the event loop (a guard mask is built once)."""
        try:
            sampling = SamplingConfig(request.temperature, request.top_k, request.top_p)
            return build_decoder(
                self.target,
                draft_model=self.draft_model,
                max_new_tokens=max_tokens,
                stop=request.stop_strings,
                sampling=sampling,
                dtype=self.target.dtype,  # stack levels load (once) in the target's dtype
                **speculation.build_kwargs(),
            )
        except ConfigError as error:
            raise from_config_error(error, "speculative") from error

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(
                404,
                f"model {model!r} does not exist here; this server serves {self.model_names[0]!r} (see GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    def speculation(self, options: SpeculativeOptions | None) -> SpeculationDefaults:
        """The server defaults with the request's ``speculative`` overrides, validated."""
        if options is None:
            return self.defaults
        try:
            resolved = self.defaults.for_request(options.model_dump())
        except ConfigError as error:
            raise from_config_error(error, "speculative") from error
        if resolved.drafter in MODEL_DRAFTERS and self.draft_model is None:
            raise bad_request(
                f"drafter {resolved.drafter!r} needs a draft model, and this server was started without "
                "--draft-model; use drafter 'ngram'",
                param="speculative.drafter",
            )
        if resolved.drafter == "stack" and not resolved.stack:
            raise bad_request(
                "drafter 'stack' needs its levels, and this server was started without --stack; use another drafter",
                param="speculative.drafter",
            )
        return resolved

    def _encode(self, request: GenerationRequest) -> list[int]:
        try:
            if isinstance(request, ChatCompletionRequest):
                messages = [message.as_template_message() for message in request.messages]
                return self._prompt_model.encode_prompt(messages, use_chat=True)
            if isinstance(request.prompt, list):
                return self._checked_token_ids(request.prompt)
            return self._prompt_model.encode_prompt(request.prompt, use_chat=False)
        except ConfigError as error:
            param = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
            raise from_config_error(error, param) from error

    def _checked_token_ids(self, token_ids: list[int]) -> list[int]:
        vocab_size = len(self._prompt_model.tokenizer)
        if max(token_ids) >= vocab_size:
            raise bad_request(f"prompt token ids must be below the vocabulary size {vocab_size}", param="prompt")
        return list(token_ids)

    def _max_tokens(self, request: GenerationRequest, prompt_length: int) -> int:
        """The request's max_tokens, checked against the cap and the context window; or the default."""
        requested = request.requested_max_tokens
        param = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) else "max_tokens"
        if requested is not None and requested > self.limits.max_tokens_cap:
            raise bad_request(
                f"{param}={requested} is above this server's cap of {self.limits.max_tokens_cap}; ask for fewer",
                param=param,
                code="max_tokens_too_large",
            )
        room = context_room(self.target, prompt_length)
        context = getattr(self.target.model.config, "max_position_embeddings", None)
        if room < 1:
            raise bad_request(
                f"the prompt is {prompt_length} tokens, which fills the model's context window of {context} "
                "tokens; shorten it",
                param="messages" if isinstance(request, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded",
            )
        if requested is not None and requested > room:
            raise bad_request(
                f"the model's context window is {context} tokens, but the prompt ({prompt_length} tokens) plus "
                f"{param} ({requested}) exceeds it; lower {param} to at most {room} or shorten the prompt",
                param=param,
                code="context_length_exceeded",
            )
        return requested if requested is not None else min(self.limits.default_max_tokens, room)
