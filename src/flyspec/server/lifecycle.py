"""Bounded shutdown: :class:`Lifecycle` (the app's side) and :class:`GracefulServer` (uvicorn's side).

On the first SIGTERM/SIGINT the server stops accepting connections, answers every request that
has not reached the model yet with 503 ``shutting_down`` (queued, being prepared, or still
sending its body), and lets the running generation finish for ``shutdown_timeout_s``; then it
ends that generation (a stream gets a last error event, a waiting client a 503). A second SIGINT
does that at once. The worker thread is joined before the process exits, whichever way it stops.
uvicorn alone would serve the whole queue first, wait for a stalled client without a bound, and
skip the app's shutdown on a second signal.

:class:`GracefulServer` also drops a client that takes none of its response for
``send_timeout_s`` (its receive window stays full: it never reads). uvicorn has no write timeout,
and closing such a connection politely waits, forever, for its buffered data to leave.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from flyspec.server.engine import Engine
from flyspec.server.settings import ServerLimits

logger = logging.getLogger(__name__)

FLUSH_GRACE_S = 2.0  # after ending the running generation: time to send its error event and close
STALL_CHECK_INTERVAL_S = 0.5


class Lifecycle:
    """Shutdown state shared by the app (body reads, the engine) and the server."""

    def __init__(self, engine: Engine, shutdown_timeout_s: float) -> None:
        self.engine = engine
        self.shutdown_timeout_s = shutdown_timeout_s
        self.draining = asyncio.Event()  # set on the first signal
        self._abort: asyncio.TimerHandle | None = None

    def begin_shutdown(self) -> None:
        """On the event loop: refuse new work, fail what is not running, and end the running job later."""
        if self.draining.is_set():
            return
        self.draining.set()
        self.engine.drain()
        logger.info("shutting down: the running generation gets %.0f s to finish", self.shutdown_timeout_s)
        self._abort = asyncio.get_running_loop().call_later(self.shutdown_timeout_s, self.engine.abort_running)

    def force(self) -> None:
        """On the event loop: a second signal ends the running generation now."""
        self.begin_shutdown()
        self.engine.abort_running()

    def finish(self, join_timeout_s: float = 10.0) -> None:
        """Stop the engine and join its worker (idempotent)."""
        if self._abort is not None:
            self._abort.cancel()
        self.engine.stop(join_timeout_s)


class GracefulServer(uvicorn.Server):
    """uvicorn's server, shutting down through :class:`Lifecycle` (see the module docstring).

    Give it ``timeout_graceful_shutdown`` = the lifecycle's ``shutdown_timeout_s`` + :data:`FLUSH_GRACE_S`
    (:func:`server_config` does), so the error events are sent before uvicorn cancels anything.
    Signals are only caught when it runs in the main thread (as uvicorn's); elsewhere call
    :meth:`handle_exit` to stop it the same way.
    """

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        limits = getattr(getattr(config.app, "state", None), "limits", None)
        self.send_timeout_s = (limits if isinstance(limits, ServerLimits) else ServerLimits()).send_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        self._watchdog = asyncio.create_task(self._drop_stalled_clients())

    async def _drop_stalled_clients(self) -> None:
        """Abort connections whose writes stayed paused, with no less data waiting, for ``send_timeout_s``.

        A slow reader empties some of its buffer between checks and is kept; one that never reads is not.
        Reads uvicorn's protocol objects (``transport``, ``flow``): a test covers them across versions.
        """
        stalled: dict[Any, tuple[float, int]] = {}  # connection → (paused since, write buffer size then)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(STALL_CHECK_INTERVAL_S)
            now, connections = loop.time(), list(self.server_state.connections)
            for connection in connections:
                transport, flow = getattr(connection, "transport", None), getattr(connection, "flow", None)
                if transport is None or flow is None or not flow.write_paused or transport.is_closing():
                    stalled.pop(connection, None)
                    continue
                waiting = transport.get_write_buffer_size()
                since, before = stalled.get(connection, (now, waiting))
                if waiting < before:  # some data left: the client reads, slowly
                    since = now
                stalled[connection] = (since, waiting)
                if now - since >= self.send_timeout_s:
                    logger.warning("dropping a client that took none of its response for %.0f s", now - since)
                    transport.abort()
                    stalled.pop(connection)
            for gone in stalled.keys() - set(connections):
                stalled.pop(gone)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self.force_exit and self._loop is not None:
            # a signal handler may interrupt the loop while it holds the engine's lock: hand over, do not call
            self._loop.call_soon_threadsafe(self.lifecycle.force)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.lifecycle.begin_shutdown()
        if self._watchdog is not None:
            self._watchdog.cancel()
        await super().shutdown(sockets=sockets)
        if self.force_exit:  # uvicorn stopped waiting, and skipped the app's lifespan shutdown
            if self.server_state.tasks:  # let the streams just ended send their error event
                await asyncio.wait(list(self.server_state.tasks), timeout=FLUSH_GRACE_S)
            await self.lifespan.shutdown()  # else asyncio.run cancels the lifespan task: a traceback in the log
        self.lifecycle.finish()  # idempotent: for lifespan="off" too


def server_config(app: FastAPI, **options: Any) -> uvicorn.Config:
    """uvicorn's config for an app of :func:`~flyspec.server.app.create_app`, with its limits' timeouts.

    The graceful-shutdown timeout leaves the lifecycle room to end the running generation itself.
    """
    limits: ServerLimits = app.state.limits
    return uvicorn.Config(
        app,
        timeout_graceful_shutdown=math.ceil(limits.shutdown_timeout_s + FLUSH_GRACE_S),
        # uvicorn types this int, but passes it to loop.call_later, which takes a float
        timeout_keep_alive=limits.keep_alive_timeout_s,  # type: ignore[arg-type]
        **options,
    )
