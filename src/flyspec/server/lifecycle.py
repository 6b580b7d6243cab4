"""Bounded shutdown: :class:`Lifecycle` (the app's side) and :class:`GracefulServer` (uvicorn's side).

On the first SIGTERM/SIGINT the server stops accepting connections, answers every request that
has not reached the model yet with 503 ``shutting_down`` (queued, being prepared, or still
sending its body), and lets the running generation finish for ``shutdown_timeout_s``; then it
ends that generation (a stream gets a last error event, a waiting client a 503). A second SIGINT
does that at once. The worker thread is joined before the process exits, whichever way it stops.
uvicorn alone would serve the whole queue first, wait for a stalled client without a bound, and
skip the app's shutdown on a second signal.
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
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self.force_exit and self._loop is not None:
            # a signal handler may interrupt the loop while it holds the engine's lock: hand over, do not call
            self._loop.call_soon_threadsafe(self.lifecycle.force)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.lifecycle.begin_shutdown()
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
