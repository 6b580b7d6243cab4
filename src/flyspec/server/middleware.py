"""Pure ASGI middleware (no BaseHTTPMiddleware, which would buffer streams and hide disconnects).

``BodyLimitMiddleware`` refuses request bodies over the limit with a 413 before any parsing;
``RequestMetricsMiddleware`` counts every response by endpoint and status and times the
generation endpoints up to their last byte (so a stream is timed to its end).
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flyspec.server.errors import error_body
from flyspec.server.metrics import ServerMetrics


async def send_error(send: Send, status: int, message: str, code: str) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """Read at most ``max_body_bytes`` of a request body; a larger one gets a 413 in the OpenAI shape."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await self._too_large(send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                await self._too_large(send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _too_large(self, send: Send) -> None:
        message = f"the request body is larger than the server's limit of {self.max_body_bytes} bytes"
        await send_error(send, 413, message, "request_too_large")


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields the buffered body once, then the client's later messages (disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class RequestMetricsMiddleware:
    """Count responses by endpoint (unknown paths as ``other``) and status; time generation endpoints."""

    def __init__(
        self, app: ASGIApp, metrics: ServerMetrics, endpoints: Collection[str], timed: Collection[str]
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = frozenset(endpoints)
        self.timed = frozenset(timed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in self.endpoints else "other"
        started = time.perf_counter()
        status = 500  # if the app fails before it starts a response

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()
            if endpoint in self.timed and status < 400:
                self.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
