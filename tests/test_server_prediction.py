"""``prediction`` (OpenAI's Predicted Outputs) on ``flyspec serve``, through the official ``openai`` client.

Each answer is checked against the library run alone with the same prompt, settings and prediction: the text is the
one without a prediction, and the usage's ``completion_tokens_details`` counts are the library's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from flyspec.api import build_decoder
from flyspec.config import DecodeConfig, DraftLengthConfig, SamplingConfig, SpeculationConfig
from flyspec.decoding.result import GenerationResult
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.server.app import create_app
from flyspec.server.settings import ServerLimits
from server_helpers import RunningServer, one_torch_thread  # noqa: F401 - autouse fixture, applies to this module

MODEL = "tiny"
MAX_TOKENS = 24
SPECULATION = SpeculationConfig(num_draft_tokens=8, draft_length=DraftLengthConfig(policy="fixed"))
CHAT_PROMPT = "Once upon a time"
ACCEPTED = 'flyspec_prediction_tokens_total{outcome="accepted"}'
REJECTED = 'flyspec_prediction_tokens_total{outcome="rejected"}'


@pytest.fixture(scope="module")
def server(tiny_target: LoadedModel) -> Iterator[RunningServer]:
    app = create_app(tiny_target, SPECULATION, ServerLimits(max_tokens_cap=400), served_model_name=MODEL)
    with RunningServer(app) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=30)


def reference(target: LoadedModel, prompt: Any, *, chat: bool, prediction: str | None = None) -> GenerationResult:
    """The library alone, with the server's settings."""
    decode = DecodeConfig(max_new_tokens=MAX_TOKENS, sampling=SamplingConfig(0.0))
    return build_decoder(target, SPECULATION, decode).generate(prompt, use_chat=chat, prediction=prediction)


def chat(client: openai.OpenAI, **options: Any) -> Any:
    messages = [{"role": "user", "content": CHAT_PROMPT}]
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, **options
    )


def details(usage: Any) -> tuple[int, int]:
    found = usage.completion_tokens_details
    return found.accepted_prediction_tokens, found.rejected_prediction_tokens


def test_chat_with_a_prediction_streamed_and_not(
    server: RunningServer, client: openai.OpenAI, tiny_target: LoadedModel
) -> None:
    messages = [{"role": "user", "content": CHAT_PROMPT}]
    plain = chat(client)
    assert plain.choices[0].message.content == reference(tiny_target, messages, chat=True).text
    assert plain.usage.completion_tokens_details is None  # a request without a prediction is served as before
    predicted_text = plain.choices[0].message.content + " and more"
    expected = reference(tiny_target, messages, chat=True, prediction=predicted_text)
    counts = (expected.stats.num_accepted_prediction_tokens, expected.stats.num_rejected_prediction_tokens)
    assert counts[0] > 0 and expected.text == plain.choices[0].message.content
    accepted_before, rejected_before = server.metric(ACCEPTED), server.metric(REJECTED)
    requests_before = server.metric("flyspec_prediction_requests_total")

    prediction = {"type": "content", "content": predicted_text}
    response = chat(client, prediction=prediction)
    assert response.choices[0].message.content == expected.text
    assert details(response.usage) == counts
    assert response.usage.num_target_forwards == expected.stats.num_target_forwards < plain.usage.num_target_forwards

    options = {"stream": True, "stream_options": {"include_usage": True}}
    chunks = list(chat(client, prediction=prediction, **options))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].choices == [] and details(chunks[-1].usage) == counts

    assert server.metric("flyspec_prediction_requests_total") == requests_before + 2
    assert server.metric(ACCEPTED) == accepted_before + 2 * counts[0]
    assert server.metric(REJECTED) == rejected_before + 2 * counts[1]


def test_completions_take_a_prediction_of_text_parts(client: openai.OpenAI, tiny_target: LoadedModel) -> None:
    prompt = "def add(a, b):"
    text = reference(tiny_target, prompt, chat=False).text
    parts = [{"type": "text", "text": text[:5]}, {"type": "text", "text": text[5:]}]
    expected = reference(tiny_target, prompt, chat=False, prediction=text)
    prediction = {"type": "content", "content": parts}
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"prediction": prediction}
    )
    assert response.choices[0].text == text
    counts = (expected.stats.num_accepted_prediction_tokens, expected.stats.num_rejected_prediction_tokens)
    assert details(response.usage) == counts and counts[0] > 0
    assert response.usage.model_dump()["drafter"]["prediction"]["prediction_tokens"] > 0


PREDICTION = {"type": "content", "content": "anything"}
# (field, value): what OpenAI's Predicted Outputs refuse beside a prediction
REFUSED_BESIDE = [
    ("n", 2),
    ("logprobs", True),
    ("top_logprobs", 2),
    ("presence_penalty", 0.5),
    ("frequency_penalty", 1.0),
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("functions", [{"name": "f"}]),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("max_completion_tokens", 8),
]


def post(server: RunningServer, body: dict[str, Any], path: str = "/v1/chat/completions") -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    if path == "/v1/completions":
        del body["messages"]
        body["prompt"] = "hi"
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


@pytest.mark.parametrize(("name", "value"), REFUSED_BESIDE, ids=[name for name, _ in REFUSED_BESIDE])
def test_what_openai_refuses_beside_a_prediction_is_a_400_naming_the_field(
    server: RunningServer, name: str, value: Any
) -> None:
    response = post(server, {"prediction": PREDICTION, name: value})
    error = response.json()["error"]
    assert (response.status_code, error["param"], error["code"]) == (400, name, "unsupported_parameter")
    assert "cannot be used with prediction" in error["message"]
    if name == "max_completion_tokens":
        assert "send max_tokens instead" in error["message"]
        assert post(server, {name: value}).status_code == 200  # without a prediction it is fine


BAD_PREDICTIONS = [
    ("another type", {"type": "text", "content": "x"}, "prediction.type"),
    (
        "an image part",
        {"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
        "prediction.content",
    ),  # fmt: skip
    ("a number", {"type": "content", "content": 5}, "prediction.content"),
    ("no content", {"type": "content"}, "prediction.content"),
    ("a string", "just text", "prediction"),
    ("an unknown key", {"type": "content", "content": "x", "weight": 2}, "prediction.weight"),
]


@pytest.mark.parametrize(("case", "prediction", "param"), BAD_PREDICTIONS, ids=[case for case, *_ in BAD_PREDICTIONS])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_bad_prediction_is_a_400_naming_it(
    server: RunningServer, case: str, prediction: Any, param: str, path: str
) -> None:
    response = post(server, {"prediction": prediction}, path)
    assert (response.status_code, response.json()["error"]["param"]) == (400, param), response.text
    if case == "an image part":
        assert "text parts" in response.json()["error"]["message"]


def test_a_prediction_longer_than_the_context_window_is_a_400(server: RunningServer, tiny_target: LoadedModel) -> None:
    context = tiny_target.model.config.max_position_embeddings
    content = "Paris Rome " * (context // 2)  # more tokens than the context leaves after the prompt
    assert len(tiny_target.tokenizer.encode(content, add_special_tokens=False)) > context
    for text in (content, "x" * 10**6):  # tokenized, and too many characters to bother tokenizing
        response = post(server, {"prediction": {"type": "content", "content": text}})
        error = response.json()["error"]
        assert (response.status_code, error["param"], error["code"]) == (400, "prediction", "context_length_exceeded")
        assert "context window" in error["message"]
