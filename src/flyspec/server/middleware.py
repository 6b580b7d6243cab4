"""Pure ASGI middleware (no BaseHTTPMiddleware, which would buffer streams and hide disconnects).

``BodyLimitMiddleware`` reads the whole request body before any parsing, refusing one over the
size limit (413), one that does not arrive within the body timeout (408: a client stalled
mid-body holds nothing for long), and one still arriving when the server starts shutting down
(503). A body over the limit is read to its end (up to :data:`DRAIN_FACTOR` times the limit,
and discarded) before the 413 is sent: a server that closes a connection with unread data
resets it, and the client, still sending, never sees why it was refused.

``RequestMetricsMiddleware`` counts every response by endpoint and status and times the
generation endpoints up to their last byte (so a stream is timed to its end); a response the
client left before its end counts as 499, and the app may record another final status
(a stream ended by its deadline or by shutdown) under :data:`STATUS_KEY` in the scope's state.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Collection

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flyspec.server.errors import error_body
from flyspec.server.metrics import ServerMetrics

STATUS_KEY = "flyspec.status"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; only ever seen in metrics and logs
DRAIN_FACTOR = 16  # a body up to this many times the limit is read (and dropped) before its 413


async def send_error(
    send: Send, status: int, message: str, code: str, *, headers: dict[str, str] | None = None
) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(name.encode(), value.encode()) for name, value in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


def record_status(scope: Scope, status: int) -> None:
    """The status the metrics should count for this request, when it differs from the one sent."""
    scope.setdefault("state", {})[STATUS_KEY] = status


class _TooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """Read the body (at most ``max_body_bytes``, within ``body_timeout_s``) before the app sees the request."""

    def __init__(
        self, app: ASGIApp, max_body_bytes: int, body_timeout_s: float, draining: asyncio.Event | None = None
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.drain_bytes = DRAIN_FACTOR * max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.draining = draining or asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.drain_bytes):
            await self._too_large(send)  # too large to read even to drop it: the client may see a reset
            return
        reading = asyncio.ensure_future(self._read(receive))
        draining = asyncio.ensure_future(self.draining.wait())
        try:
            await asyncio.wait({reading, draining}, timeout=self.body_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            draining.cancel()
        if not reading.done():
            reading.cancel()
            close = {"connection": "close"}  # the rest of the body may still come: this connection is done
            if self.draining.is_set():
                await send_error(send, 503, "the server is shutting down", "shutting_down", headers=close)
            else:
                message = f"the request body did not arrive within {self.body_timeout_s:g} s"
                await send_error(send, 408, message, "request_timeout", headers=close)
            return
        try:
            body = reading.result()
        except _TooLarge:
            await self._too_large(send)
            return
        if body is None:  # the client left before sending its body
            record_status(scope, CLIENT_CLOSED_REQUEST)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> bytes | None:
        """The body; _TooLarge once a body over the limit ended (or passed ``drain_bytes``); None: the client left."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            size += len(message.get("body", b""))
            if size <= self.max_body_bytes:
                chunks.append(message.get("body", b""))
            elif size > self.drain_bytes or not message.get("more_body", False):
                raise _TooLarge
            else:
                chunks.clear()  # read on, keeping nothing, so the client is still listening when the 413 comes
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, send: Send) -> None:
        message = f"the request body is larger than the server's limit of {self.max_body_bytes} bytes"
        await send_error(send, 413, message, "request_too_large", headers={"connection": "close"})


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
        complete = False

        async def send_and_record(message: Message) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            if status < 400 and not complete:  # a stream the client left (a full body is sent in one go)
                status = CLIENT_CLOSED_REQUEST
            status = scope.get("state", {}).get(STATUS_KEY, status)
            self.metrics.requests.labels(endpoint, str(status)).inc()
            if endpoint in self.timed and status < 400:
                self.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
