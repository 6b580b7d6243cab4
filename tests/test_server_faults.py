"""Fault injection on ``flyspec serve`` (issue 31, item 2): failures stay inside the request that met them.

A forward that raises fails its own request only (a safe 500, or an error event once streaming);
SIGTERM under load ends every request cleanly or with a clear error and the caches come back
after a restart; a client that never reads its stream is dropped once the server could send it
nothing for ``send_timeout_s``. (``kill -9`` while the cache file is written, 50 times:
``benchmarks/kill9.py``; ENOSPC on save: ``test_server_cache_durability.py``.)
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from flyspec.api import build_decoder
from flyspec.config import DecodeConfig, SamplingConfig, SpeculationConfig
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.runtime.target import Target
from flyspec.server import responses
from flyspec.server.app import create_app
from flyspec.server.errors import INTERNAL_ERROR_MESSAGE
from flyspec.server.settings import ServerLimits, ServerSecurity
from server_helpers import (
    Recorder,
    RunningServer,
    one_torch_thread,  # noqa: F401 - autouse fixture, applies to this module
    read_until_closed,
    sse_events,
)

POISON = "Once upon a time"  # the tiny target runs long on it; its fourth target forward raises in the test below
PROMPTS = ["The capital of France is", "def add(a, b):", "Speculative decoding drafts", "Paris Rome"]


def greedy(target: LoadedModel, prompt: str, max_tokens: int) -> str:
    decode = DecodeConfig(max_new_tokens=max_tokens, sampling=SamplingConfig(temperature=0.0))
    decoder = build_decoder(target, SpeculationConfig(), decode)
    return decoder.generate(target.encode_prompt(prompt, use_chat=False)).text


def test_a_forward_that_raises_fails_only_its_own_request(
    tiny_target: LoadedModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    start, score = Target.start, Target.score
    calls: dict[int, int] = {}
    poison_ids = tiny_target.encode_prompt(POISON, use_chat=False)

    def recording_start(self: Target, prompt_ids: list[int]) -> int:
        self.poisoned = list(prompt_ids) == poison_ids  # type: ignore[attr-defined]
        return start(self, prompt_ids)

    def failing_score(self: Target, last_token: int, draft_tokens: torch.Tensor) -> torch.Tensor:
        if getattr(self, "poisoned", False):
            calls[id(self)] = calls.get(id(self), 0) + 1
            if calls[id(self)] == 2:  # after the first step's text went out
                raise RuntimeError("secret internal detail: CUDA error, device-side assert")
        return score(self, last_token, draft_tokens)

    monkeypatch.setattr(Target, "start", recording_start)
    monkeypatch.setattr(Target, "score", failing_score)
    expected = {prompt: greedy(tiny_target, prompt, 12) for prompt in PROMPTS}
    app = create_app(tiny_target, SpeculationConfig(num_draft_tokens=1), served_model_name="tiny")
    with RunningServer(app) as server:

        def ask(prompt: str, stream: bool) -> httpx.Response:
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": stream}
            return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)

        jobs = [(prompt, index % 2 == 0) for index, prompt in enumerate(PROMPTS)] + [(POISON, False), (POISON, True)]
        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(lambda job: ask(*job), jobs))
        assert server.metric("flyspec_failed_generations_total") == 2
        assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
        assert ask(PROMPTS[0], False).status_code == 200  # the worker goes on
    for (prompt, stream), answer in zip(jobs, answers, strict=True):
        if prompt == POISON and not stream:  # nothing sent yet: a plain 500 in the OpenAI shape
            assert answer.status_code == 500
            assert answer.json()["error"] == {
                "message": INTERNAL_ERROR_MESSAGE, "type": "server_error", "param": None, "code": "internal_error"
            }  # fmt: skip
        elif prompt == POISON:  # headers sent: the stream's last event is the error, then it ends
            events = sse_events(answer.text.splitlines())
            assert answer.status_code == 200 and events[-1]["error"]["code"] == "internal_error"
            assert events[-1]["error"]["message"] == INTERNAL_ERROR_MESSAGE and "[DONE]" not in events
            assert len(events) >= 2  # text came before the failure
        elif stream:
            events = sse_events(answer.text.splitlines())
            assert events[-1] == "[DONE]"
            assert "".join(event["choices"][0]["text"] for event in events[:-1] if event["choices"]) == expected[prompt]
        else:
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected[prompt]
    assert "secret internal detail" not in "".join(answer.text for answer in answers)
    assert "secret internal detail" in caplog.text  # the operator sees it


def test_sigterm_under_load_then_a_restart_restores_the_caches(tiny_target: LoadedModel, tmp_path: Path) -> None:
    path = tmp_path / "caches.json"
    keys = ("key-a", "key-b")
    spec = SpeculationConfig(drafter="ngram-cache", num_draft_tokens=4)
    limits = ServerLimits(shutdown_timeout_s=1.0, max_tokens_cap=400)
    recorder = Recorder(delay_s=0.05)  # each piece takes a while: the load is still running at SIGTERM

    def app() -> Any:
        return create_app(tiny_target, spec, limits, ServerSecurity(api_keys=keys), served_model_name="tiny",
                          hooks=recorder.hooks(), ngram_cache_file=path)  # fmt: skip

    outcomes: list[str] = []
    with RunningServer(app()) as server:

        def stream(index: int) -> None:
            prompt = POISON if index < 2 else PROMPTS[index % 4]  # the first ones run longer than the shutdown timeout
            body = {"prompt": prompt, "max_tokens": 300, "temperature": 0, "stream": True}
            headers = {"authorization": f"Bearer {keys[index % 2]}"}
            try:
                with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers,
                                  timeout=60) as response:  # fmt: skip
                    if response.status_code != 200:
                        response.read()
                        code = response.json()["error"]["code"]
                        outcomes.append(f"{response.status_code} {code}")
                        return
                    events = sse_events(response.iter_lines())
            except httpx.HTTPError as error:
                outcomes.append(f"lost: {error!r}")
                return
            last = events[-1] if events else None
            outcomes.append("complete" if last == "[DONE]" else f"event {last['error']['code']}" if last else "empty")

        threads = [threading.Thread(target=stream, args=(index,)) for index in range(6)]
        threads[0].start()  # a long one runs first (deterministically), the others queue behind it
        assert recorder.started.wait(20)
        for thread in threads[1:]:
            thread.start()
        time.sleep(0.5)
        server.signal(signal.SIGTERM)
        for thread in threads:
            thread.join(30)
        assert server.wait_stopped(15)
    assert len(outcomes) == 6, outcomes
    # each ends as a whole answer or with a clear error: the queued ones 503, the running one an error event
    assert set(outcomes) <= {"complete", "503 shutting_down", "event shutting_down"}, outcomes
    assert "503 shutting_down" in outcomes and "event shutting_down" in outcomes
    saved = json.loads(path.read_text())["tenants"]
    assert saved  # the shutdown saved the caches of the generations that ran
    restarted = app()
    entries = sum(len(cache) for view in restarted.state.planner.caches._tenants.values()
                  for cache in view.ngram_caches())  # fmt: skip
    assert entries == sum(len(cache) for tenant in saved.values() for cache in tenant["caches"].values()) > 0


def test_a_client_that_never_reads_its_stream_is_let_go(
    tiny_target: LoadedModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # every chunk carries a 4 KB SSE comment (which clients ignore), so the stream outgrows the socket buffers
    piece_chunk = responses.ResponseBuilder.piece_chunk
    monkeypatch.setattr(
        responses.ResponseBuilder, "piece_chunk", lambda self, text: f": {'x' * 4096}\n\n" + piece_chunk(self, text)
    )
    limits = ServerLimits(send_timeout_s=2.0, max_tokens_cap=400)
    recorder = Recorder()
    app = create_app(tiny_target, SpeculationConfig(num_draft_tokens=1), limits, served_model_name="tiny",
                     hooks=recorder.hooks())  # fmt: skip
    server = RunningServer(app)
    server._socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # accepted sockets inherit it
    with server:
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0, "stream": True})
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        client.connect(("127.0.0.1", server.port))
        client.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        with recorder.done:  # the worker is done with it (finished, or stopped when the client was dropped)
            assert recorder.done.wait_for(lambda: recorder.finished, 60)
        assert recorder.finished[0][0].num_pieces > 20  # more than the buffers hold (4 KB each)
        other = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
        assert other.status_code == 200  # the worker serves others meanwhile
        time.sleep(limits.send_timeout_s + 2.5)  # the server could send it nothing all that time
        client.settimeout(10)
        received = b""
        try:
            while chunk := client.recv(65536):
                received += chunk
        except (ConnectionResetError, TimeoutError):
            pass
        finally:
            client.close()
        assert b"[DONE]" not in received  # it was dropped, not waited for: before, reading now got it all
    assert "dropping a client that took none of its response" in caplog.text


def test_an_oversized_body_gets_its_413_not_a_connection_reset(tiny_target: LoadedModel) -> None:
    """Found by the soak: a 900 KB body over a 64 KB limit was refused before it was read and the connection
    closed, so a client still sending it (httpx, requests) got a broken pipe or reset, never the 413."""
    limits = ServerLimits(max_body_bytes=65536)
    app = create_app(tiny_target, SpeculationConfig(), limits, served_model_name="tiny")
    body = json.dumps({"prompt": "word " * 180_000}).encode()  # 900 KB
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    with RunningServer(app) as server:
        for _ in range(5):  # a client whose body is still on its way when the server has decided
            client = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            try:  # as httpx and requests do: the whole body first, then read the answer
                client.sendall(head)
                time.sleep(0.2)
                client.sendall(body)  # before: BrokenPipeError or ConnectionResetError, the 413 never read
                received = read_until_closed(client)
            finally:
                client.close()
            assert received.startswith(b"HTTP/1.1 413") and b"request_too_large" in received, received[:200]
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
