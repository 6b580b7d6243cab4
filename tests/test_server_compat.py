"""What lm-eval's ``local-completions`` and other vLLM clients send: token-id prompts, many stop strings, vLLM extras.

Each answer is checked against the library run alone (as in test_server.py), through FastAPI's TestClient.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from flyspec.api import build_decoder
from flyspec.config import DecodeConfig, SamplingConfig, SpeculationConfig
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.server.app import create_app
from flyspec.server.schemas import MAX_STOP_STRINGS, VLLM_EXTRAS

NUM_DRAFT_TOKENS = 4
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(tiny_target: LoadedModel) -> Iterator[TestClient]:
    app = create_app(tiny_target, SpeculationConfig(num_draft_tokens=NUM_DRAFT_TOKENS), served_model_name="tiny")
    with TestClient(app, base_url="http://127.0.0.1") as running:
        yield running


def reference(target: LoadedModel, prompt: str | list[int], max_tokens: int, stop: tuple[str, ...] = ()) -> str:
    decode = DecodeConfig(max_new_tokens=max_tokens, stop_strings=stop, sampling=SamplingConfig(0.0))
    decoder = build_decoder(target, SpeculationConfig(num_draft_tokens=NUM_DRAFT_TOKENS), decode)
    return decoder.generate(prompt, use_chat=False).text


def complete(client: TestClient, **body: Any) -> Any:
    return client.post("/v1/completions", json={"model": "tiny", "temperature": 0, "max_tokens": 8, **body})


def test_token_id_prompts_single_and_batched_form(client: TestClient, tiny_target: LoadedModel) -> None:
    ids = tiny_target.tokenizer(PROMPT)["input_ids"]
    expected = reference(tiny_target, ids, 8)
    for prompt in (ids, [ids]):  # lm-eval sends [[ids]]: a batch of one
        response = complete(client, prompt=prompt)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected
        assert response.json()["usage"]["prompt_tokens"] == len(ids)
    two = complete(client, prompt=[ids, ids])
    assert (two.status_code, two.json()["error"]["param"]) == (400, "prompt")
    assert "one prompt per request" in two.json()["error"]["message"]
    empty = complete(client, prompt=[[]])
    assert empty.status_code == 400 and "empty" in empty.json()["error"]["message"]


def test_many_stop_strings_up_to_the_cap(client: TestClient, tiny_target: LoadedModel) -> None:
    full = reference(tiny_target, PROMPT, 12)
    stop = next(full[i : i + 2] for i in range(3, len(full)) if "\ufffd" not in full[i : i + 2])
    stops = [f"never-{index}" for index in range(MAX_STOP_STRINGS - 1)] + [stop]
    expected = reference(tiny_target, PROMPT, 12, tuple(stops))
    assert len(expected) < len(full)
    response = complete(client, prompt=PROMPT, max_tokens=12, stop=stops)
    assert response.status_code == 200, response.text
    assert (response.json()["choices"][0]["text"], response.json()["choices"][0]["finish_reason"]) == (expected, "stop")
    too_many = complete(client, prompt=PROMPT, stop=[*stops, "one more"])
    assert (too_many.status_code, too_many.json()["error"]["param"]) == (400, "stop")
    assert f"at most {MAX_STOP_STRINGS} stop strings" in too_many.json()["error"]["message"]


def test_what_lm_eval_local_completions_sends(client: TestClient, tiny_target: LoadedModel) -> None:
    """lm-eval 0.4.13's payload: token ids in a batch of one, ``seed``, its stop words plus EOS, task extras."""
    ids = tiny_target.tokenizer("Question: 2 + 3\nAnswer:")["input_ids"]
    until = ["\n", ".", "Question:", "</s>", "<|im_end|>", "\n\n"]
    body = {"prompt": [ids], "max_tokens": 6, "stop": until, "seed": 1234, "top_k": -1, "min_p": 0.0}
    response = complete(client, **body, repetition_penalty=1.0)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == reference(tiny_target, ids, 6, tuple(until))
    assert response.json()["flyspec"]["ignored_fields"] == ["min_p", "repetition_penalty"]
    assert response.headers["x-flyspec-ignored-fields"] == "min_p, repetition_penalty"


def test_vllm_extras_that_would_change_the_output_are_refused(client: TestClient) -> None:
    for name, value in (("min_p", 0.1), ("repetition_penalty", 1.2), ("ignore_eos", True), ("stop_token_ids", [5])):
        response = complete(client, prompt=PROMPT, **{name: value})
        error = response.json()["error"]
        assert (response.status_code, error["param"], error["code"]) == (400, name, "unsupported_parameter")
        assert f"{name} is not supported" in error["message"]
    assert "send 0, which changes nothing" in complete(client, prompt=PROMPT, min_p=0.5).json()["error"]["message"]
    plain = complete(client, prompt=PROMPT)
    assert "ignored_fields" not in plain.json()["flyspec"] and "x-flyspec-ignored-fields" not in plain.headers


def test_every_vllm_extra_has_a_value_that_changes_nothing() -> None:
    assert all(None in values for values in VLLM_EXTRAS.values())


def test_chat_takes_the_extras_too(client: TestClient) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    response = client.post("/v1/chat/completions", json={**body, "skip_special_tokens": True, "top_k": -1})
    assert response.status_code == 200, response.text
    assert response.json()["flyspec"]["ignored_fields"] == ["skip_special_tokens"]
