"""A real uvicorn server in a background thread on 127.0.0.1, and a controllable engine hook."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import httpx
import pytest
import torch
from fastapi import FastAPI

from flyspec.server.engine import EngineHooks, Job, Outcome
from flyspec.server.lifecycle import GracefulServer, server_config

START_TIMEOUT_S = 20.0
WORDS = ("capital", "France", "Paris", "Italy", "Rome", "def", "add", "return", "print", "Speculative", "decoding")
CHAT = {"messages": [{"role": "user", "content": "x"}]}

# (case, path, body, status, param, code): bad requests and the OpenAI error each must get.
# fmt: off
MALFORMED_REQUESTS = [
    ("bad JSON", "/v1/completions", b'{"prompt": ', 400, None, "invalid_json"),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None, "invalid_json"),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt", "missing_field"),
    ("wrong type", "/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", "invalid_value"),
    ("prompt type", "/v1/completions", {"prompt": 5}, 400, "prompt", "invalid_value"),
    ("string number", "/v1/completions", {"prompt": "hi", "temperature": "0.5"}, 400, "temperature", "invalid_value"),
    ("messages type", "/v1/chat/completions", {"messages": "hi"}, 400, "messages", "invalid_value"),
    ("no messages", "/v1/chat/completions", {"messages": []}, 400, "messages", "invalid_value"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, 400, "messages.0.role",
     "invalid_value"),
    ("unknown verifier", "/v1/completions", {"prompt": "hi", "speculative": {"verifier": "nope"}}, 400,
     "speculative.verifier", "invalid_value"),
    ("param of another verifier", "/v1/completions", {"prompt": "hi", "speculative": {"window_size": 2}}, 400,
     "speculative", "invalid_value"),
    ("no draft model", "/v1/completions", {"prompt": "hi", "speculative": {"drafter": "draft-model"}}, 400,
     "speculative.drafter", "invalid_value"),
    ("no stack", "/v1/completions", {"prompt": "hi", "speculative": {"drafter": "stack"}}, 400,
     "speculative.drafter", "invalid_value"),
    ("adaptive not bool", "/v1/completions", {"prompt": "hi", "speculative": {"adaptive_draft": "yes"}}, 400,
     "speculative.adaptive_draft", "invalid_value"),
    ("unknown draft length", "/v1/completions", {"prompt": "hi", "speculative": {"draft_length": "fast"}}, 400,
     "speculative.draft_length", "invalid_value"),
    ("two draft lengths", "/v1/completions",
     {"prompt": "hi", "speculative": {"draft_length": "cost", "adaptive_draft": True}}, 400, "speculative",
     "invalid_value"),
    ("window > k", "/v1/completions", {"prompt": "hi", "speculative": {"verifier": "fly", "window_size": 9}}, 400,
     "speculative", "invalid_value"),
    ("max_tokens 0", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("max_tokens < 0", "/v1/chat/completions", {**CHAT, "max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    ("above the cap", "/v1/completions", {"prompt": "hi", "max_tokens": 100_000}, 400, "max_tokens",
     "max_tokens_too_large"),
    ("huge prompt", "/v1/completions", {"prompt": "Paris Rome " * 600}, 400, "prompt", "context_length_exceeded"),
    ("prompt + max_tokens", "/v1/completions", {"prompt": "Paris Rome " * 40, "max_tokens": 400}, 400, "max_tokens",
     "context_length_exceeded"),
    ("n=2", "/v1/completions", {"prompt": "hi", "n": 2}, 400, "n", "unsupported_parameter"),
    ("logprobs", "/v1/chat/completions", {**CHAT, "logprobs": True}, 400, "logprobs", "unsupported_parameter"),
    ("tools", "/v1/chat/completions", {**CHAT, "tools": [{"type": "x"}]}, 400, "tools", "unsupported_parameter"),
    ("unknown field", "/v1/completions", {"prompt": "hi", "frobnicate": 1}, 400, "frobnicate", "unknown_parameter"),
    ("empty stop", "/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop", "invalid_value"),
    ("stream_options alone", "/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options", "invalid_value"),
    ("empty prompt", "/v1/completions", {"prompt": "  "}, 400, "prompt", "invalid_value"),
    ("two prompts", "/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", "invalid_value"),
    ("token id out of vocab", "/v1/completions", {"prompt": [1, 999_999]}, 400, "prompt", "invalid_value"),
    ("unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model", "model_not_found"),
]
# fmt: on


class RunningServer:
    """``with RunningServer(app) as server:`` serves ``app`` on a free loopback port until the block ends."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))  # bound here, so no other process can take the port meanwhile
        self.port = self._socket.getsockname()[1]
        config = server_config(app, log_level="warning", lifespan="on")
        self._server = GracefulServer(config, app.state.lifecycle)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> RunningServer:
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._server.should_exit = True
        self._thread.join(15)
        self._socket.close()

    def signal(self, sig: int) -> None:
        """What SIGTERM/SIGINT do to ``flyspec serve`` (signals reach only the main thread)."""
        self._server.handle_exit(sig, None)

    def wait_stopped(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def metric(self, name: str, labels: str = "") -> float:
        """One sample from ``GET /metrics`` (``labels`` as in the exposition, e.g. ``endpoint="/health"``)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        wanted = f"{name}{{{labels}}}" if labels else name
        for line in text.splitlines():
            if line.startswith(wanted + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def wait_for_metric(self, name: str, value: float, timeout_s: float = 10.0) -> float:
        """Poll until the metric reaches ``value``; return what it last was."""
        deadline = time.monotonic() + timeout_s
        while (current := self.metric(name)) < value and time.monotonic() < deadline:
            time.sleep(0.05)
        return current


@dataclass
class Recorder:
    """Engine hooks the tests steer: slow each piece, hold the worker at a gate, fail, and record outcomes."""

    delay_s: float = 0.0
    hold: bool = False
    fail: bool = False
    started: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    finished: list[tuple[Job, Outcome]] = field(default_factory=list)
    done: threading.Condition = field(default_factory=threading.Condition)

    def hooks(self) -> EngineHooks:
        return EngineHooks(on_piece=self.on_piece, on_finish=self.on_finish)

    def on_piece(self, job: Job) -> None:
        self.started.set()
        if self.fail:
            raise RuntimeError("secret internal detail")
        if self.hold:
            self.release.wait(START_TIMEOUT_S)
        if self.delay_s:
            time.sleep(self.delay_s)

    def on_finish(self, job: Job, outcome: Outcome) -> None:
        with self.done:
            self.finished.append((job, outcome))
            self.done.notify_all()

    def wait_for_outcome(self, outcome: Outcome, timeout_s: float = 15.0) -> Job:
        """The first job that ended with ``outcome`` (jobs of earlier tests may still report theirs)."""
        with self.done:
            assert self.done.wait_for(lambda: any(o == outcome for _, o in self.finished), timeout_s), self.finished
            return next(job for job, o in self.finished if o == outcome)

    def reset(self) -> None:
        self.delay_s, self.hold, self.fail = 0.0, False, False
        self.started.clear()
        self.release.clear()
        with self.done:
            self.finished.clear()


def sse_events(lines: Any) -> list[Any]:
    """The JSON objects (and ``"[DONE]"``) of a server-sent event stream, from its text lines."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def raw_request(port: int, head: bytes, timeout_s: float = 10.0) -> socket.socket:
    """A client socket that sent ``head`` (request line, headers, and maybe part of a body) and waits."""
    client = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    client.sendall(head)
    return client


def read_until_closed(client: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it never does)."""
    received = b""
    while chunk := client.recv(65536):
        received += chunk
    return received


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The CI box has 2 shared cores; torch's thread pool thrashes when it oversubscribes them.

    Server test modules import this fixture, which makes it apply to every test in them."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
