"""From a request body to a ready-to-run generation, or a 4xx saying what to change.

Everything a request can get wrong is found here, before it takes a place in the queue where
possible. :meth:`Planner.check` needs no model work (the model name, the speculative settings and
what this server lets a request change, ``max_tokens`` against the cap, a prompt too long to
bother tokenizing); :meth:`Planner.prepare` tokenizes and checks the prompt against
``max_prompt_tokens`` and the context window, then builds the decoder.

Prompts are tokenized on a private copy of the tokenizer in a one-thread executor, so the event
loop never blocks on a long prompt and the worker's tokenizer is never used from two threads.
Chat messages lose the tokenizer's special tokens (``<|im_start|>``, ``</s>``) typed in their
text unless the operator allows them: rendered by the chat template they would be real control
tokens, and a message could forge turns.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import ValidationError

from flyspec.api import build_decoder
from flyspec.config import MODEL_DRAFTERS, ConfigError, DecodeConfig, SamplingConfig, SpeculationConfig
from flyspec.decoding.generation import context_room
from flyspec.decoding.speculative import SpeculativeDecoder
from flyspec.profiles import looser, resolution
from flyspec.resources import Resources
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.server.caches import TenantCaches
from flyspec.server.errors import (
    APIError,
    bad_request,
    from_config_error,
    from_validation_error,
    parse_json_object,
    shorten,
)
from flyspec.server.prediction import check_beside_prediction, prediction_ids
from flyspec.server.prediction import too_long as too_long_prediction
from flyspec.server.schemas import (
    IGNORED_FIELDS,
    UNSUPPORTED_FIELDS,
    VLLM_EXTRAS,
    ChatCompletionRequest,
    CompletionRequest,
    SpeculativeOptions,
    is_unused,
)
from flyspec.server.settings import ServerLimits, ServerSecurity, changed_fields, for_request, is_lossless

logger = logging.getLogger(__name__)
RequestT = TypeVar("RequestT", CompletionRequest, ChatCompletionRequest)
GenerationRequest = CompletionRequest | ChatCompletionRequest


def parse_request(raw: bytes, schema: type[RequestT]) -> RequestT:
    """Validate a body against ``schema``; unsupported standard fields are a 400 naming the field.

    vLLM's extras with values that change nothing are dropped, logged and listed in the result's
    ``ignored_fields`` (the response reports them); with any other value they are a 400 too.
    """
    data = parse_json_object(raw)
    check_beside_prediction(data)  # what OpenAI's Predicted Outputs refuse beside a prediction, named as such
    ignored = []
    for table in (UNSUPPORTED_FIELDS, VLLM_EXTRAS):
        for name, unused_values in table.items():
            if name in data:
                value = data.pop(name)
                if not is_unused(value, unused_values):
                    raise bad_request(_unsupported_message(name, value), param=name, code="unsupported_parameter")
                if table is VLLM_EXTRAS:
                    ignored.append(name)
    for name in IGNORED_FIELDS:
        data.pop(name, None)
    try:
        request = schema.model_validate(data)
    except ValidationError as error:
        raise from_validation_error(error) from error
    if ignored:
        logger.warning("request fields %s ignored: their values change nothing here", ", ".join(ignored))
        request._ignored_fields = ignored
    return request


def _unsupported_message(name: str, value: Any) -> str:
    if name in ("n", "best_of"):
        return (
            f"{name}={shorten(value)} is not supported: flyspec returns one choice per request; send separate requests"
        )
    if name in VLLM_EXTRAS:
        noop = " or ".join(repr(unused) for unused in VLLM_EXTRAS[name] if unused is not None)
        suffix = f" or send {noop}, which changes nothing" if noop else ""
        return f"{name} is not supported by flyspec serve (got {shorten(value)}); leave it out{suffix}"
    return f"{name} is not supported by flyspec serve (got {shorten(value)}); leave it out"


@dataclass
class Plan:
    """A validated, tokenized request, resolved against the server's defaults and limits."""

    prompt_ids: list[int]
    max_tokens: int
    decoder: SpeculativeDecoder
    prediction_ids: list[int] | None = None  # the request's prediction (OpenAI's Predicted Outputs), tokenized


class Planner:
    """Resolves requests against one served model (and its optional draft model)."""

    def __init__(
        self,
        target: LoadedModel,
        defaults: SpeculationConfig,
        limits: ServerLimits,
        security: ServerSecurity,
        *,
        draft_model: LoadedModel | None = None,
        model_names: tuple[str, ...] = (),
    ) -> None:
        self.target = target
        if draft_model is not None and defaults.draft_model is None:
            defaults = dataclasses.replace(defaults, draft_model=draft_model.name)
        # a calibration profile (--profile, or the one flyspec ships) sets the lossy defaults once, here, and
        # stays the limit of every request's lossy settings (they are the caller's, so untrusted)
        resolved = resolution(defaults, target, draft_model if defaults.models else None)
        self.defaults = resolved.spec
        self.profile = resolved.profile
        self.limits = limits
        self.security = security
        self.draft_model = draft_model
        self.model_names = model_names or (target.name,)
        # the server owns the loaded models (stack levels load once, in the target's dtype, on its device) and
        # calibrations; each tenant gets its own n-gram caches
        models = (target,) if draft_model is None else (target, draft_model)
        resources = Resources(target.dtype, models=models, device=target.device)
        self.caches = TenantCaches(resources, shared=security.share_ngram_cache)
        # Prompt encoding only: the worker decodes with the original tokenizer at the same time.
        tokenizer = copy.deepcopy(target.tokenizer)
        self._prompt_model = LoadedModel(model=target.model, tokenizer=tokenizer, name=target.name)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flyspec-tokenize")
        context = getattr(target.model.config, "max_position_embeddings", None)
        self._prompt_limit = min(limits.max_prompt_tokens, context - 1) if context else limits.max_prompt_tokens
        # No token is longer than its vocabulary entry (byte-level and SentencePiece entries spell
        # every character), so a prompt with more characters than this cannot fit: refused untokenized.
        self._longest_token_chars = max(len(entry) for entry in tokenizer.get_vocab())
        self._max_prompt_chars = self._prompt_limit * self._longest_token_chars
        self._context = context or self._prompt_limit  # what a prediction can fill at most
        special = sorted(_special_tokens(tokenizer), key=len, reverse=True)
        strip = special and not security.allow_special_tokens_in_messages
        self._special_tokens = re.compile("|".join(map(re.escape, special))) if strip else None

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def check(self, request: GenerationRequest) -> SpeculationConfig:
        """Every check that needs no model work; the request's speculation settings, resolved."""
        self.check_model(request.model)
        if request.stream_options is not None and not request.stream:
            raise bad_request("stream_options is only allowed with stream: true", param="stream_options")
        speculation = self.speculation(request.speculative)
        self._check_max_tokens_cap(request)
        limit, unit = self._max_prompt_chars, "characters"
        if isinstance(request, ChatCompletionRequest):
            size = sum(len(message.text) for message in request.messages)
        else:
            size = len(request.prompt)
            if isinstance(request.prompt, list):
                limit, unit = self._prompt_limit, "token ids"
        if size > limit:
            raise self._too_long(request, f"{size} {unit}, more than fit in")
        if request.prediction is not None and len(request.prediction.text) > self._context * self._longest_token_chars:
            raise too_long_prediction(f"{len(request.prediction.text)} characters, more", self._context, False)
        return speculation

    async def prepare(self, request: GenerationRequest, speculation: SpeculationConfig, tenant: str) -> Plan:
        """Tokenize, check the prompt's length and ``max_tokens``, and build the decoder (off the event loop)."""
        loop = asyncio.get_running_loop()
        prompt_ids = await loop.run_in_executor(self._executor, self._encode, request)
        if len(prompt_ids) > self._prompt_limit:
            raise self._too_long(request, f"{len(prompt_ids)} tokens, more than")
        max_tokens = self._max_tokens(request, len(prompt_ids))
        predicted = None
        if request.prediction is not None:
            room = context_room(self.target, len(prompt_ids))
            encode = functools.partial(prediction_ids, self._prompt_model.tokenizer, request.prediction, room)
            predicted = await loop.run_in_executor(self._executor, encode)
        build = functools.partial(self._build_decoder, request, speculation, max_tokens, tenant)
        decoder = await loop.run_in_executor(self._executor, build)
        return Plan(prompt_ids, max_tokens, decoder, predicted)

    def _too_long(self, request: GenerationRequest, size: str) -> APIError:
        context_bound = self._prompt_limit < self.limits.max_prompt_tokens
        what = "the model's context window" if context_bound else "this server's --max-prompt-tokens"
        return bad_request(
            f"the prompt is {size} {what} allows ({self._prompt_limit} tokens); shorten it",
            param="messages" if isinstance(request, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded" if context_bound else "prompt_too_long",
        )

    def _build_decoder(
        self, request: GenerationRequest, speculation: SpeculationConfig, max_tokens: int, tenant: str
    ) -> SpeculativeDecoder:
        """A decoder sharing the loaded weights; cheap, but off the event loop (a guard mask is built once)."""
        try:
            sampling = SamplingConfig(request.temperature, request.top_k, request.top_p)
            decode = DecodeConfig(max_new_tokens=max_tokens, stop_strings=request.stop_strings, sampling=sampling)
            return build_decoder(self.target, speculation, decode, resources=self.caches.resources_for(tenant))
        except ConfigError as error:
            raise from_config_error(error, "speculative") from error

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(
                404,
                f"model {shorten(model)} does not exist here; this server serves {self.model_names[0]!r} "
                "(see GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    def speculation(self, options: SpeculativeOptions | None) -> SpeculationConfig:
        """The server defaults with the request's ``speculative`` overrides, validated and allowed."""
        if options is None:
            return self.defaults
        requested = options.model_dump()
        if requested.get("drafter") in MODEL_DRAFTERS and self.draft_model is None:
            raise bad_request(
                f"drafter {requested['drafter']!r} needs a draft model, and this server was started without "
                "--draft-model; use drafter 'ngram'",
                param="speculative.drafter",
            )
        if requested.get("drafter") == "stack" and not self.defaults.stack:
            raise bad_request(
                "drafter 'stack' needs its levels, and this server was started without --stack; use another drafter",
                param="speculative.drafter",
            )
        try:
            resolved = for_request(self.defaults, requested)
        except ConfigError as error:
            raise from_config_error(error, "speculative") from error
        self._check_allowed(resolved)
        return resolved

    def _check_allowed(self, resolved: SpeculationConfig) -> None:
        """The operator's ``--allow-request-speculative``: ``none``, ``lossless`` or ``all`` (see settings.py).

        Under ``lossless`` a request may choose any lossless verifier, with any drafter and draft
        settings: the output is then the target's own, whatever the drafts. With a lossy verifier
        the drafts change the output, so a request may not change anything from a lossy default.
        Whatever the policy, a server with a calibration profile refuses lossy settings looser than
        the profile's (``profile.looser``): its quality bounds hold only for settings at least as strict.
        """
        policy = self.security.allow_request_speculative
        if self.profile is not None and resolved != self.defaults:
            reasons = looser(self.defaults, resolved)
            if reasons:
                raise APIError(
                    403,
                    f"these speculative settings are looser than this server's calibration profile "
                    f"{self.profile.name} allows: {'; '.join(reasons)}; leave them out to use its settings, "
                    "or choose stricter ones or a lossless verifier",
                    param="speculative",
                    code="speculative_not_allowed",
                )
        if policy == "all" or resolved == self.defaults or (policy == "lossless" and is_lossless(resolved)):
            return
        changed = ", ".join(changed_fields(self.defaults, resolved))
        if policy == "none":
            reason = f"it does not let a request change the speculative settings (this one changes {changed})"
        elif resolved.verifier != self.defaults.verifier:
            reason = f"a request may choose only a lossless verifier, and {resolved.verifier!r} is lossy"
        else:
            reason = (
                f"its default verifier {resolved.verifier!r} is lossy, so changing its settings ({changed}) "
                "would change the output; choose a lossless verifier (exact, rejection) to change them"
            )
        raise APIError(
            403,
            f"this server (--allow-request-speculative {policy}) refuses these speculative settings: {reason}; "
            "leave out 'speculative' to use the server's defaults",
            param="speculative",
            code="speculative_not_allowed",
        )

    def _encode(self, request: GenerationRequest) -> list[int]:
        try:
            if isinstance(request, ChatCompletionRequest):
                messages = [self._without_special_tokens(message.as_template_message()) for message in request.messages]
                return self._prompt_model.encode_prompt(messages, use_chat=True)
            if isinstance(request.prompt, list):
                # the schema's validator turned a list of one string into that string: a list here is ids
                return self._checked_token_ids(request.prompt)  # type: ignore[arg-type]
            return self._prompt_model.encode_prompt(request.prompt, use_chat=False)
        except ConfigError as error:
            param = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
            raise from_config_error(error, param) from error

    def _without_special_tokens(self, message: dict[str, str]) -> dict[str, str]:
        """The message with the tokenizer's special tokens removed from its text (unless allowed)."""
        if self._special_tokens is None:
            return message
        content = self._special_tokens.sub("", message["content"])
        found = self._special_tokens.search(content)  # removing one formed another: "<|im_<|im_end|>start|>"
        if found:
            raise bad_request(
                f"a message contains the chat template's control token {found.group()!r}; remove it",
                param="messages",
            )
        return {**message, "content": content}

    def _checked_token_ids(self, token_ids: list[int]) -> list[int]:
        vocab_size = len(self._prompt_model.tokenizer)
        if max(token_ids) >= vocab_size:
            raise bad_request(f"prompt token ids must be below the vocabulary size {vocab_size}", param="prompt")
        return list(token_ids)

    def _check_max_tokens_cap(self, request: GenerationRequest) -> None:
        requested = request.requested_max_tokens
        if requested is not None and requested > self.limits.max_tokens_cap:
            param = _max_tokens_param(request)
            raise bad_request(
                f"{param}={requested} is above this server's cap of {self.limits.max_tokens_cap}; ask for fewer",
                param=param,
                code="max_tokens_too_large",
            )

    def _max_tokens(self, request: GenerationRequest, prompt_length: int) -> int:
        """The request's max_tokens, checked against the context window; or the default."""
        requested = request.requested_max_tokens
        param = _max_tokens_param(request)
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


def _max_tokens_param(request: GenerationRequest) -> str:
    return "max_completion_tokens" if getattr(request, "max_completion_tokens", None) else "max_tokens"


def _special_tokens(tokenizer: Any) -> set[str]:
    """The text of every special token (BOS, EOS, chat-template markers) the tokenizer recognises in text."""
    special = {str(token) for token in tokenizer.all_special_tokens}
    special.update(token.content for token in tokenizer.added_tokens_decoder.values() if token.special)
    return {token for token in special if token}
