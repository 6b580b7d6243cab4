"""OpenAI's ``prediction`` in the vLLM plugin, without vLLM: the proposer's rows with a prediction, the per-request
state, the scheduler hook, and the API server's request field and usage (its end-to-end test:
``tests/vllm_engine/test_prediction_server.py``; on vLLM 0.33's source: ``tests/vllm033/test_prediction.py``)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pydantic
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations" / "vllm" / "src"))

from flyspec_vllm import patch, prediction_api  # noqa: E402
from flyspec_vllm.prediction import PREDICTION_KEY, wrap_add_request  # noqa: E402
from flyspec_vllm.proposer import NgramProposer  # noqa: E402

from test_vllm_plugin import fake_vllm, fresh_predictions, importer, proposer_config  # noqa: E402, F401 - a fixture

PROMPT = [5, 6, 7, 8, 9, 5, 6]  # the n-gram "5 6" recurs: the n-gram proposer drafts 7 8 9 5
PREDICTION = [20, 21, 22, 23, 24, 25, 26, 27]


def runner_of(extra_args: dict[str, Any | None]) -> SimpleNamespace:
    """A V1 runner whose batch holds one request per ``extra_args`` entry (request id → its extra_args), each with
    ``PROMPT`` as its prompt."""
    ids = list(extra_args)
    return SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=ids, num_prompt_tokens=np.full(len(ids), len(PROMPT))),
        requests={
            name: SimpleNamespace(sampling_params=SimpleNamespace(extra_args=args)) for name, args in extra_args.items()
        },  # fmt: skip
    )


def propose(proposer: NgramProposer, outputs: list[list[int]]) -> list[list[int]]:
    """The proposer's drafts for rows whose committed tokens are ``PROMPT`` + ``outputs[row]``."""
    token_ids = np.zeros((len(outputs), 64), dtype=np.int32)
    lengths = []
    for row, output in enumerate(outputs):
        tokens = PROMPT + output
        token_ids[row, : len(tokens)] = tokens
        lengths.append(len(tokens))
    return proposer.propose([[1]] * len(outputs), np.asarray(lengths), token_ids)


def test_a_row_with_a_prediction_drafts_it_aligned_and_reanchored_the_others_keep_the_ngram_proposer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(patch, "STATE", None)
    predictions = patch.prediction.PREDICTIONS  # this test's (fresh_predictions)
    proposer = NgramProposer(proposer_config())  # 4 draft tokens
    runner = runner_of({"plain": None, "predicted": {PREDICTION_KEY: PREDICTION}})
    steps = [  # the predicted row's output after each step → its drafts (the plain row's stay the n-gram ones)
        ([20], [21, 22, 23, 24]),  # follows the prediction: its next tokens
        ([20, 21, 22], [23, 24, 25, 26]),
        ([20, 21, 22, 99], []),  # left it, nothing to re-anchor on: no drafts (not the n-gram proposer's)
        ([20, 21, 22, 99, 24], [25, 26, 27]),  # "24" found again just after the cursor: re-anchored, to the end
        ([20, 21, 22, 99, 24, 25, 26, 27], []),  # used up
    ]
    for output, drafts in steps:
        predictions.gather(runner)
        assert propose(proposer, [[], output]) == [[7, 8, 9, 5], drafts], output
    assert set(predictions.requests) == {"predicted"}
    predictions.gather(runner_of({"plain": None}))  # it left the batch: its state is dropped
    assert predictions.requests == {} and predictions.rows == {}


def test_a_fault_gathering_the_rows_leaves_the_step_without_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(patch, "STATE", None)
    predictions = patch.prediction.PREDICTIONS
    broken = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["a"], num_prompt_tokens=[7]), requests={})
    predictions.gather(broken)  # runner.requests["a"] raises: never out of the hook
    assert predictions.rows is None
    assert propose(NgramProposer(proposer_config()), [[1]]) == [[]]  # plain decoding, lossless


def test_the_scheduler_keeps_speculative_counts_of_requests_with_a_prediction_only() -> None:
    class Metrics:
        @classmethod
        def new(cls, num_spec_tokens: int) -> tuple[str, int]:
            return ("counts", num_spec_tokens)

    class Scheduler:
        num_spec_tokens = 15

        def __init__(self) -> None:
            self.requests: dict[str, Any] = {}

        def add_request(self, request: Any) -> None:
            self.requests[request.request_id] = request
            request.spec_decode_metrics = None  # vLLM's --per-request-spec-decode-metrics none

    add_request = wrap_add_request(Scheduler.add_request, Metrics)
    scheduler = Scheduler()
    extra_args = {"plain": None, "other": {"x": 1}, "predicted": {PREDICTION_KEY: [1]}}
    requests = {name: SimpleNamespace(request_id=name, sampling_params=SimpleNamespace(extra_args=args))
                for name, args in extra_args.items()}  # fmt: skip
    for request in requests.values():
        add_request(scheduler, request)
    assert [request.spec_decode_metrics for request in requests.values()] == [None, None, ("counts", 15)]


class Request(pydantic.BaseModel):
    """A stand-in for vLLM's request models (``OpenAIBaseModel``: unknown fields allowed, kept in ``model_extra``)."""

    model_config = pydantic.ConfigDict(extra="allow")
    model: str = "m"
    n: int | None = 1
    max_tokens: int | None = None
    prompt: Any = None

    def to_sampling_params(self, max_tokens: int, default_sampling_params: dict) -> SimpleNamespace:
        return SimpleNamespace(max_tokens=max_tokens, extra_args={"kept": 1})


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch, tokenizer: Any) -> Any:
    """The API server of an engine with the plugin's proposer, tokenizing with the tiny tokenizer."""
    monkeypatch.setattr(
        prediction_api, "SERVED", prediction_api.Served("tiny", None, False, "flyspec_vllm.NgramProposer")
    )
    monkeypatch.setitem(prediction_api._tokenizers, ("tiny", None), tokenizer)
    return tokenizer


def sampling_params(room: int | None = None, **fields: Any) -> Any:
    if room is not None:
        prediction_api.ROOM.set(room)
    request = Request(**fields)
    return prediction_api.wrap_to_sampling_params(Request.to_sampling_params)(request, 16, {})


def test_a_prediction_becomes_its_token_ids_in_extra_args(served: Any) -> None:
    text = "def add(a, b):\n    return a + b\n"
    params = sampling_params(prediction={"type": "content", "content": [{"type": "text", "text": text}]})
    assert params.extra_args == {"kept": 1, PREDICTION_KEY: served.encode(text, add_special_tokens=False)}
    assert params.max_tokens == 16
    assert sampling_params(max_tokens=8).extra_args == {"kept": 1}  # no prediction: vLLM's parameters, untouched


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"n": 2}, "n", "cannot be used with prediction"),
        ({"logprobs": True}, "logprobs", "cannot be used with prediction"),
        ({"max_completion_tokens": 9}, "max_completion_tokens", "send max_tokens instead"),
        ({"use_beam_search": True}, "use_beam_search", "beam search"),
        ({"prompt": ["one", "two"]}, "prompt", "several prompts"),
        ({"prediction": {"type": "text", "content": "x"}}, "prediction.type", "invalid value"),
        ({"prediction": {"type": "content", "content": [{"type": "image_url"}]}}, "prediction.content", "text parts"),
        ({"prediction": "just text"}, "prediction", "invalid value"),
    ],
)
def test_what_flyspec_serve_refuses_beside_or_in_a_prediction_is_a_400_naming_the_field(
    served: Any, fields: dict[str, Any], param: str, says: str
) -> None:
    body = {"prediction": {"type": "content", "content": "x"}} | fields
    with pytest.raises(ValueError, match=says) as refused:  # vLLM's VLLMValidationError, or a ValueError without vLLM
        sampling_params(**body)
    assert refused.value.args[0].endswith(f"({param})") or getattr(refused.value, "parameter", None) == param


def test_a_prediction_longer_than_the_room_after_the_prompt_or_on_an_engine_drafting_otherwise_is_refused(
    served: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    prediction = {"type": "content", "content": " word" * 20}
    length = len(served.encode(prediction["content"], add_special_tokens=False))
    with pytest.raises(ValueError, match="more than the model's context window leaves after the prompt"):
        sampling_params(room=length - 1, prediction=prediction)
    assert len(sampling_params(room=length, prediction=prediction).extra_args[PREDICTION_KEY]) == length
    monkeypatch.setattr(prediction_api.SERVED, "runner", "V2")  # no step hook there to say which rows predict
    with pytest.raises(ValueError, match="does not draft from predictions .*V2 model runner"):
        sampling_params(prediction=prediction)
    monkeypatch.setattr(prediction_api.SERVED, "runner", "V1")
    monkeypatch.setattr(prediction_api.SERVED, "hooked", False)
    with pytest.raises(ValueError, match="does not draft from predictions .*step hook does not run"):
        sampling_params(prediction=prediction)
    monkeypatch.setattr(prediction_api.SERVED, "hooked", True)
    monkeypatch.setattr(prediction_api.SERVED, "proposer", "eagle")
    with pytest.raises(ValueError, match="does not draft from predictions .*eagle"):
        sampling_params(prediction=prediction)


def test_the_room_is_vllms_own_get_max_tokens_without_the_requests_cap() -> None:
    def get_max_tokens(max_model_len, max_tokens, input_length, default_sampling_params, override_max_tokens=None,
                       truncate_prompt_tokens=None):  # fmt: skip
        default = default_sampling_params.get("max_tokens")
        caps = [max_model_len - input_length, max_tokens, default, override_max_tokens]
        return min(cap for cap in caps if cap is not None)

    wrapped = prediction_api.wrap_get_max_tokens(get_max_tokens)
    assert wrapped(100, 8, 30, {"max_tokens": 16}, 12) == 8  # vLLM's answer, unchanged
    assert prediction_api.ROOM.get() == 70  # the room a prediction may fill


def test_the_usage_gets_openais_prediction_counts_from_vllms_per_request_counts() -> None:
    counts = {"num_draft_tokens": 30, "num_accepted_draft_tokens": 21, "num_spec_steps": 3}
    chunk = {"id": "c", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 24, "total_tokens": 29},
             "metrics": {"speculative_decoding": counts}}  # fmt: skip
    event = prediction_api.usage_chunk(f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n")
    assert event.startswith("data: {") and event.endswith("\n\n")
    details = json.loads(event[len("data: ") :])["usage"]["completion_tokens_details"]
    assert details == {"accepted_prediction_tokens": 21, "rejected_prediction_tokens": 9}
    for other in ('data: {"choices":[{"delta":{"content":"x"}}]}\n\n', "data: [DONE]\n\n", ": keep-alive\n\n"):
        assert prediction_api.usage_chunk(other) == other  # every other event as vLLM sent it

    class Details(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="allow")
        reasoning_tokens: int = 0

    usage = SimpleNamespace(completion_tokens_details=None)
    prediction_api.add_prediction_usage(usage, SimpleNamespace(**counts), Details)
    assert usage.completion_tokens_details.model_dump() == {"reasoning_tokens": 0, "accepted_prediction_tokens": 21,
                                                            "rejected_prediction_tokens": 9}  # fmt: skip


async def _response(self: Any, request: Any) -> Any:
    usage = SimpleNamespace(completion_tokens_details=None)
    counts = SimpleNamespace(num_draft_tokens=4, num_accepted_draft_tokens=4)
    return SimpleNamespace(usage=usage, metrics=SimpleNamespace(speculative_decoding=counts))


def test_only_a_response_to_a_request_with_a_prediction_gets_the_counts() -> None:
    import asyncio

    build = prediction_api.wrap_response(_response, dict)
    with_prediction = Request(prediction={"type": "content", "content": "x"})
    details = asyncio.run(build(None, with_prediction)).usage.completion_tokens_details
    assert details == {"accepted_prediction_tokens": 4, "rejected_prediction_tokens": 0}
    assert asyncio.run(build(None, request=Request())).usage.completion_tokens_details is None


def test_a_vllm_whose_server_differs_refuses_predictions_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class ChatCompletionRequest(Request):
        pass

    modules = fake_vllm(with_rejection_sample=True)
    chat_protocol = patch.OPENAI_MODULES["chat"][0]
    modules[chat_protocol] = SimpleNamespace(ChatCompletionRequest=ChatCompletionRequest)
    with caplog.at_level(logging.WARNING, logger="flyspec_vllm"):
        patch.install_predictions(importer(modules), "0.99", server=True)
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "OpenAI server differs" in warnings[0] and "are refused" in warnings[0], warnings
    with pytest.raises(ValueError, match="prediction is not served"):
        ChatCompletionRequest(prediction={"type": "content", "content": "x"}).to_sampling_params(8, {})
    assert ChatCompletionRequest().to_sampling_params(8, {}).max_tokens == 8  # the others: served as before
