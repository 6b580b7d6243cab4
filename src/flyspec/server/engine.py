"""One worker thread per model: a bounded queue of generation jobs, served one at a time.

The decoders keep per-instance KV caches and a CPU box has few cores, so target forwards are
serialized: the event loop only enqueues jobs and awaits their events; the worker thread iterates
each job's :class:`~flyspec.streaming.GenerationStream` (one target forward per step) and hands the
text pieces back to the loop with ``call_soon_threadsafe``.

Cancellation: a client that goes away calls :meth:`Engine.cancel`. A queued job is dropped at
once (its slot is free immediately); a running job stops before its next target forward.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from flyspec.api import make_generator
from flyspec.config import ConfigError
from flyspec.decoding import Decoder
from flyspec.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

EventKind = Literal["piece", "done", "error"]
Event = tuple[EventKind, Any]  # ("piece", str) | ("done", GenerationResult) | ("error", BaseException)
Outcome = Literal["done", "cancelled", "error"]
_MAX_RETRY_AFTER_S = 60
_job_ids = itertools.count(1)


class QueueFullError(Exception):
    """The queue is full; the client should retry after ``retry_after_s`` seconds."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"the server is busy; retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


class ShuttingDownError(Exception):
    """The server is stopping and takes no more work."""


@dataclass
class EngineHooks:
    """Callbacks in the worker thread, for tests and instrumentation.

    ``on_piece`` runs after each text piece is handed to the client (an exception there counts as a
    failed generation); ``on_finish`` runs once per job that reached the worker, with its outcome.
    """

    on_piece: Callable[[Job], None] | None = None
    on_finish: Callable[[Job, Outcome], None] | None = None


class Job:
    """One request's generation: what to run, and the events the worker sends back to the loop."""

    def __init__(self, decoder: Decoder, prompt_ids: list[int], seed: int | None, label: str = "") -> None:
        self.id = next(_job_ids)
        self.label = label
        self.decoder = decoder
        self.prompt_ids = prompt_ids
        self.seed = seed
        self.state: Literal["new", "queued", "running", "cancelled", "finished"] = "new"
        self.num_pieces = 0
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._cancel = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def emit(self, kind: EventKind, value: Any) -> None:
        """Called from the worker thread; a closed loop means nobody is listening any more."""
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:
            self._cancel.set()

    async def next_event(self) -> Event:
        return await self.events.get()


class Engine:
    """Serializes generations on one model. ``max_queue`` jobs may wait besides the one running."""

    def __init__(
        self, max_queue: int, metrics: ServerMetrics, *, min_retry_after_s: int = 1, hooks: EngineHooks | None = None
    ) -> None:
        self.max_queue = max_queue
        self.metrics = metrics
        self.hooks: EngineHooks = hooks or EngineHooks()
        self._min_retry_after_s = min_retry_after_s
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._running: Job | None = None
        self._jobs: set[Job] = set()  # admitted and not finished
        self._mean_duration_s = 0.0  # exponential moving average of generation time
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name="flyspec-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Refuse new jobs, fail the queued ones, stop the running one, and join the worker."""
        with self._lock:
            self._stopping = True
            pending = list(self._jobs)
        for job in pending:
            job.emit("error", ShuttingDownError("the server is shutting down"))
            self.cancel(job)
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def check_room(self) -> None:
        """Raise :class:`QueueFullError` / :class:`ShuttingDownError` now, before a request is prepared."""
        with self._lock:
            self._check_room_locked()

    def submit(self, job: Job) -> None:
        """Queue a job, or raise :class:`QueueFullError` / :class:`ShuttingDownError`."""
        with self._lock:
            self._check_room_locked()
            self._waiting += 1
            self._jobs.add(job)
            job.state = "queued"
            self.metrics.queue_depth.set(self._waiting)
        self._queue.put(job)

    def cancel(self, job: Job) -> None:
        """The client is gone: drop a queued job now, or stop a running one before its next forward."""
        with self._lock:
            if job.state == "queued":
                job.state = "cancelled"
                self._waiting -= 1
                self._jobs.discard(job)
                self.metrics.queue_depth.set(self._waiting)
                self.metrics.cancelled.inc()
        job._cancel.set()

    def _check_room_locked(self) -> None:
        if self._stopping:
            raise ShuttingDownError("the server is shutting down")
        if self._waiting + (self._running is not None) > self.max_queue:
            raise QueueFullError(self._retry_after())

    @property
    def queue_depth(self) -> int:
        return self._waiting

    def _retry_after(self) -> int:
        estimate = math.ceil(self._mean_duration_s * (self._waiting + 1))
        return min(max(self._min_retry_after_s, estimate), _MAX_RETRY_AFTER_S)

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            if not self._begin(job):
                continue
            started = time.perf_counter()
            outcome = self._generate(job)
            with self._lock:
                job.state = "finished"
                self._running = None
                self._jobs.discard(job)
                self._mean_duration_s = 0.8 * self._mean_duration_s + 0.2 * (time.perf_counter() - started)
            if outcome == "cancelled":
                self.metrics.cancelled.inc()
            logger.debug("job %d (%s) %s after %d pieces", job.id, job.label, outcome, job.num_pieces)
            if self.hooks.on_finish is not None:
                self.hooks.on_finish(job, outcome)

    def _begin(self, job: Job) -> bool:
        with self._lock:
            if job.state != "queued":  # cancelled while waiting
                return False
            job.state = "running"
            self._running = job
            self._waiting -= 1
            self.metrics.queue_depth.set(self._waiting)
            return True

    def _generate(self, job: Job) -> Outcome:
        """Run one job to its end, its cancellation, or its failure; send the events."""
        try:
            stream = job.decoder.stream(job.prompt_ids, generator=make_generator(job.seed))
            pieces = iter(stream)
            try:
                for piece in pieces:
                    if job.cancelled:
                        return "cancelled"
                    job.num_pieces += 1
                    job.emit("piece", piece)
                    if self.hooks.on_piece is not None:
                        self.hooks.on_piece(job)
            finally:
                pieces.close()  # type: ignore[attr-defined]
            job.emit("done", stream.result)
            return "done"
        except ConfigError as error:  # bad input found late (e.g. by the decoder): the client's 400
            job.emit("error", error)
            return "error"
        except Exception as error:
            logger.exception("generation failed for job %d (%s)", job.id, job.label)
            self.metrics.failed.inc()
            job.emit("error", error)
            return "error"
