"""OpenAI's ``prediction`` (Predicted Outputs) on vLLM's OpenAI server: the request field, its 400s, its usage counts.

vLLM's server takes unknown request fields and drops them (its ``OpenAIBaseModel`` allows extras and only logs
them). With the plugin, in the API server's process (``patch.install``, where vLLM has loaded its OpenAI server):

* **The field** (``to_sampling_params`` of ``ChatCompletionRequest`` and ``CompletionRequest``, where vLLM turns a
  request into sampling parameters): a request's ``prediction`` is checked as ``flyspec serve`` checks it, with
  flyspec's own rules (``_flyspec.prediction_rules``: its schema, what OpenAI refuses beside a prediction), tokenized
  by the served model's tokenizer (``AutoTokenizer`` from the tokenizer path vLLM's engine config names, loaded once,
  at the first prediction; no special tokens added) and put into ``extra_args["flyspec_prediction"]`` as token ids,
  which the plugin's proposer drafts from (``prediction.py``). A refused one is vLLM's ``VLLMValidationError``
  naming the field, which vLLM's server answers with an OpenAI-style 400. A prediction longer than the context
  window leaves after the prompt is a 400 naming ``prediction``: the room is vLLM's own ``get_max_tokens`` without
  the request's ``max_tokens`` (wrapped in the serving modules, read by the request's ``to_sampling_params`` right
  after; the ``max_tokens`` that method receives is already capped by the request's). Beam search, several prompts
  and an engine whose drafts are not the plugin's proposer's are 400s too: no usage counts would be right there.
* **The usage** (the serving methods that build a response and its final streamed chunk): where the response of a
  request with a prediction carries vLLM's per-request speculative counts (``metrics.speculative_decoding``, which
  ``prediction.wrap_add_request`` turns on for such requests alone), ``usage.completion_tokens_details`` gets
  OpenAI's ``accepted_prediction_tokens`` (draft tokens vLLM kept) and ``rejected_prediction_tokens`` (drafted, not
  kept). On vLLM a request with a prediction drafts from its prediction only, so those are its prediction counts.

A request without a prediction passes every wrapper untouched: its response is vLLM's, byte for byte.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from flyspec_vllm._flyspec import prediction_rules
from flyspec_vllm.internals import RESPONSE_BUILDERS, V1, ServerInternals, wrap
from flyspec_vllm.prediction import PREDICTION_KEY

logger = logging.getLogger(__name__)
PROPOSERS = ("flyspec_vllm.NgramProposer", "flyspec_vllm.proposer.NgramProposer")
ROOM: contextvars.ContextVar[int | None] = contextvars.ContextVar("flyspec_prediction_room", default=None)


@dataclass
class Served:
    """What the engine's config says (recorded at engine start, in the API server's process)."""

    tokenizer: str
    revision: str | None
    trust_remote_code: bool
    proposer: str  # the speculative method (and its class), for the refusal of an engine that drafts otherwise
    # the model runner vLLM chose, and whether the plugin's step hook runs on it: only the V1 hook tells the proposer
    # which rows carry a prediction (elsewhere those rows would get n-gram drafts, counted as the prediction's)
    runner: str = V1
    hooked: bool = True

    @property
    def drafts_predictions(self) -> bool:
        return self.proposer in PROPOSERS and self.runner == V1 and self.hooked

    def why_not(self) -> str:
        """Why this engine does not draft from predictions (when :attr:`drafts_predictions` is False)."""
        if self.proposer not in PROPOSERS:
            return f"its speculative method: {self.proposer}"
        if self.runner != V1:
            return f"vLLM's {self.runner} model runner; the plugin drafts predictions on the V1 runner only"
        return "the plugin's step hook does not run on this vLLM's V1 model runner (its internals differ)"


SERVED: Served | None = None
_tokenizers: dict[tuple[str, str | None], Any] = {}  # loaded once per tokenizer path


def record_engine(vllm_config: Any, runner: str, hooked: bool) -> None:
    """At engine start (``VllmConfig.__post_init__``): the tokenizer, proposer and model ``runner`` this server's
    requests meet (``hooked``: the plugin's step hook runs on that runner)."""
    global SERVED
    model, speculative = getattr(vllm_config, "model_config", None), getattr(vllm_config, "speculative_config", None)
    if model is None or getattr(model, "tokenizer", None) is None:
        return
    method = getattr(speculative, "method", None) or "none"
    proposer = str(getattr(speculative, "model", None)) if method == "custom_class" else str(method)
    SERVED = Served(str(model.tokenizer), getattr(model, "tokenizer_revision", None),
                    bool(getattr(model, "trust_remote_code", False)), proposer, runner, hooked)  # fmt: skip


def tokenizer_of(served: Served) -> Any:
    key = (served.tokenizer, served.revision)
    if key not in _tokenizers:
        from transformers import AutoTokenizer

        _tokenizers[key] = AutoTokenizer.from_pretrained(served.tokenizer, revision=served.revision,
                                                         trust_remote_code=served.trust_remote_code)  # fmt: skip
    return _tokenizers[key]


def refusal(message: str, param: str) -> Exception:
    """vLLM's 400 naming ``param`` (a ValueError, also a 400 on vLLM's server, where it has no such error)."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return ValueError(f"{message} ({param})")
    return VLLMValidationError(message, parameter=param)


def has_prediction(request: Any) -> bool:
    return (getattr(request, "model_extra", None) or {}).get("prediction") is not None


def prediction_ids(request: Any, room: int | None, served: Served | None) -> list[int]:
    """The request's prediction as token ids, checked as ``flyspec serve`` checks it; else a 400 naming the field."""
    rules = prediction_rules()
    extra = request.model_extra or {}
    body = {name: getattr(request, name) for name in request.model_fields_set} | extra
    try:
        rules.check_beside_prediction(body)  # what OpenAI's Predicted Outputs refuse beside a prediction
        prediction = _validated(rules, extra["prediction"])
    except rules.APIError as error:
        raise refusal(error.message, error.param or "prediction") from None
    if body.get("use_beam_search"):
        raise refusal("use_beam_search cannot be used with prediction (beam search keeps several sequences); leave "
                      "it out, or leave out the prediction", "use_beam_search")  # fmt: skip
    if _several_prompts(body.get("prompt")):
        raise refusal("several prompts cannot be used with prediction (a prediction is of one output); send one "
                      "prompt, or leave out the prediction", "prompt")  # fmt: skip
    if served is None or not served.drafts_predictions:
        why = "its speculative method: unknown" if served is None else served.why_not()
        raise refusal(f"this engine does not draft from predictions ({why}); start it with speculative_config "
                      "method 'custom_class', model 'flyspec_vllm.NgramProposer' on the V1 model runner, or leave "
                      "out the prediction", "prediction")  # fmt: skip
    try:
        return rules.prediction_ids(tokenizer_of(served), prediction, room if room is not None else 1 << 62)
    except rules.APIError as error:
        raise refusal(error.message, error.param or "prediction") from None


def _validated(rules: Any, value: Any) -> Any:
    """flyspec's ``Prediction`` schema; a problem is flyspec serve's 400, its field named from ``prediction``."""
    from pydantic import ValidationError, create_model

    body = create_model("PredictionField", prediction=(rules.Prediction, ...))
    try:
        return getattr(body.model_validate({"prediction": value}), "prediction")  # noqa: B009 - a made model
    except ValidationError as error:
        raise rules.from_validation_error(error) from None


def _several_prompts(prompt: Any) -> bool:
    return isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(item, str | list) for item in prompt)


def wrap_to_sampling_params(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def to_sampling_params(self: Any, max_tokens: int, default_sampling_params: dict, *args: Any, **kwargs: Any) -> Any:
        if not has_prediction(self):
            return original(self, max_tokens, default_sampling_params, *args, **kwargs)
        room = ROOM.get()
        ROOM.set(None)  # read once: never a later request's
        ids = prediction_ids(self, room, SERVED)
        params = original(self, max_tokens, default_sampling_params, *args, **kwargs)
        params.extra_args = {**(params.extra_args or {}), PREDICTION_KEY: ids}
        return params

    return to_sampling_params


def wrap_get_max_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's ``get_max_tokens``, which also records the room after the prompt (:data:`ROOM`) for the request's
    ``to_sampling_params`` that the serving code calls right after it."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def get_max_tokens(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            given = dict(bound.arguments, max_tokens=None, default_sampling_params={})  # the request's cap left out
            if "override_max_tokens" in given:
                given["override_max_tokens"] = None
            ROOM.set(int(original(**given)))
        except Exception:  # noqa: BLE001 - without a room, a prediction's length is not checked (drafts stop at it)
            ROOM.set(None)
        return result

    return get_max_tokens


def add_prediction_usage(usage: dict[str, Any] | Any, counts: Any, details_class: Any = None) -> None:
    """Put OpenAI's ``accepted_prediction_tokens`` / ``rejected_prediction_tokens`` into ``usage``'s
    ``completion_tokens_details`` (a response's pydantic ``UsageInfo``, or its dict in a streamed chunk), from vLLM's
    per-request speculative counts ``counts`` (``SpeculativeDecodingMetrics`` or its dict)."""
    read: Callable[[str], Any] = counts.__getitem__ if isinstance(counts, dict) else functools.partial(getattr, counts)
    drafted, accepted = int(read("num_draft_tokens")), int(read("num_accepted_draft_tokens"))
    mine = {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": drafted - accepted}
    if isinstance(usage, dict):
        usage["completion_tokens_details"] = {**(usage.get("completion_tokens_details") or {}), **mine}
        return
    details = usage.completion_tokens_details
    if details is None:
        usage.completion_tokens_details = details_class(**mine)
        return
    for name, value in mine.items():
        setattr(details, name, value)


def _response_counts(response: Any) -> Any:
    return getattr(getattr(response, "metrics", None), "speculative_decoding", None)


def wrap_response(original: Callable[..., Any], details_class: Any) -> Callable[..., Any]:
    """A method that returns a response (``request`` its first argument): with the prediction's usage."""

    def finish(request: Any, response: Any) -> Any:
        counts = _response_counts(response)
        if has_prediction(request) and counts is not None and getattr(response, "usage", None) is not None:
            add_prediction_usage(response.usage, counts, details_class)
        return response

    request_of = _request_argument(original)
    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def build_async(self: Any, *args: Any, **kwargs: Any) -> Any:
            return finish(request_of(self, *args, **kwargs), await original(self, *args, **kwargs))

        return build_async

    @functools.wraps(original)
    def build(self: Any, *args: Any, **kwargs: Any) -> Any:
        return finish(request_of(self, *args, **kwargs), original(self, *args, **kwargs))

    return build


def _request_argument(method: Callable[..., Any]) -> Callable[..., Any]:
    """The function that finds the ``request`` argument of a call of ``method``."""
    signature = inspect.signature(method)
    return lambda *args, **kwargs: signature.bind(*args, **kwargs).arguments.get("request")


def wrap_stream(original: Callable[..., Any]) -> Callable[..., Any]:
    """A streaming generator (``request`` its first argument): its final usage chunk with the prediction's usage."""

    request_of = _request_argument(original)

    @functools.wraps(original)
    def stream(self: Any, *args: Any, **kwargs: Any) -> AsyncIterator[str]:
        chunks = original(self, *args, **kwargs)
        return _with_usage(chunks) if has_prediction(request_of(self, *args, **kwargs)) else chunks

    return stream


async def _with_usage(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    async for chunk in chunks:
        yield usage_chunk(chunk)


def usage_chunk(chunk: str) -> str:
    """A server-sent event of vLLM's stream, with the prediction's usage where it is the usage chunk with counts."""
    if not chunk.startswith("data: {") or '"speculative_decoding"' not in chunk or '"usage"' not in chunk:
        return chunk
    try:
        data = json.loads(chunk[len("data: ") :])
        counts = (data.get("metrics") or {}).get("speculative_decoding")
        if counts is None or not isinstance(data.get("usage"), dict):
            return chunk
        add_prediction_usage(data["usage"], counts)
    except (ValueError, TypeError, AttributeError):
        return chunk
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def install(server: ServerInternals) -> None:
    """Wrap what the ``prediction`` field needs on vLLM's OpenAI server (``internals.check_server_internals``)."""
    for request_class in server.requests.values():
        wrap(request_class, "to_sampling_params", wrap_to_sampling_params)
    for endpoint, serving in server.servings.items():
        wrap(serving, "get_max_tokens", wrap_get_max_tokens)
        for name in RESPONSE_BUILDERS[endpoint]:
            wrapper = wrap_stream if name.endswith("_stream_generator") else functools.partial(
                wrap_response, details_class=server.details_class)  # fmt: skip
            wrap(server.serving_classes[endpoint], name, wrapper)


def refuse_predictions(request_classes: dict[str, Any], problems: list[str]) -> None:
    """Where vLLM's server differs from the tested ones but its requests can still be refused: a request with a
    prediction is a 400 naming ``prediction`` (never served with its field silently dropped)."""
    reason = "; ".join(problems)

    def wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def to_sampling_params(self: Any, *args: Any, **kwargs: Any) -> Any:
            if has_prediction(self):
                raise refusal(f"flyspec-vllm: this vLLM's OpenAI server differs from the tested ones ({reason[:300]}): "
                              "prediction is not served; leave it out", "prediction")  # fmt: skip
            return original(self, *args, **kwargs)

        return to_sampling_params

    for request_class in request_classes.values():
        wrap(request_class, "to_sampling_params", wrapper)
