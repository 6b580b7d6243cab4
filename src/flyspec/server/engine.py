"""One worker thread per model: a bounded queue of generation jobs, served one at a time.

The decoders keep per-instance KV caches and a CPU box has few cores, so target forwards are
serialized: the event loop only enqueues jobs and awaits their events; the worker thread iterates
each job's :class:`~flyspec.decoding.streaming.GenerationStream` (one target forward per step) and hands the
text pieces back to the loop with ``call_soon_threadsafe``.

A job's life: ``reserve`` (a place in the queue, taken before its prompt is tokenized, so
requests being prepared count against ``max_queue`` too) → ``submit`` (prepared: queued) →
running → finished. Cancellation (the client went away, or its deadline passed) drops a reserved
or queued job at once (its place is free immediately) and stops a running one before its next
target forward. Shutdown: :meth:`Engine.drain` fails every job not yet running with
:class:`ShuttingDownError` and refuses new ones; :meth:`Engine.abort_running` ends the running one
the same way; :meth:`Engine.stop` does both and joins the worker.
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
from flyspec.decoding.generation import Decoder
from flyspec.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

EventKind = Literal["piece", "done", "error"]
Event = tuple[EventKind, Any]  # ("piece", str) | ("done", GenerationResult) | ("error", BaseException)
Outcome = Literal["done", "cancelled", "error"]
JobState = Literal["new", "preparing", "queued", "running", "cancelled", "finished"]
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

    def __init__(self, seed: int | None = None, label: str = "") -> None:
        self.id = next(_job_ids)
        self.label = label
        self.seed = seed
        self.decoder: Decoder | None = None  # set by Engine.submit
        self.prompt_ids: list[int] = []
        self.prediction_ids: list[int] | None = None  # the request's prediction (OpenAI's Predicted Outputs)
        self.state: JobState = "new"
        self.num_pieces = 0
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._cancel = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def emit(self, kind: EventKind, value: Any) -> None:
        """Called from any thread; a closed loop means nobody is listening any more."""
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:
            self._cancel.set()

    async def next_event(self) -> Event:
        return await self.events.get()


class Engine:
    """Serializes generations on one model. ``max_queue`` jobs may wait (or be prepared) besides the one running."""

    def __init__(
        self, max_queue: int, metrics: ServerMetrics, *, min_retry_after_s: int = 1, hooks: EngineHooks | None = None
    ) -> None:
        self.max_queue = max_queue
        self.metrics = metrics
        self.hooks: EngineHooks = hooks or EngineHooks()
        self._min_retry_after_s = min_retry_after_s
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting: set[Job] = set()  # reserved (being prepared) or queued
        self._running: Job | None = None
        self._mean_duration_s = 0.0  # exponential moving average of generation time
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name="flyspec-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def reserve(self, job: Job) -> None:
        """Take a place in the queue for a job about to be prepared, or raise QueueFull/ShuttingDown."""
        with self._lock:
            if self._stopping:
                raise ShuttingDownError("the server is shutting down")
            if len(self._waiting) + (self._running is not None) > self.max_queue:
                raise QueueFullError(self._retry_after())
            self._waiting.add(job)
            job.state = "preparing"
            self.metrics.queue_depth.set(len(self._waiting))

    def submit(
        self, job: Job, decoder: Decoder, prompt_ids: list[int], prediction_ids: list[int] | None = None
    ) -> None:
        """Queue a reserved job, now that it is prepared; ShuttingDownError if the server began stopping."""
        with self._lock:
            if job.state != "preparing" or self._stopping:
                raise ShuttingDownError("the server is shutting down")
            job.decoder, job.prompt_ids, job.prediction_ids = decoder, prompt_ids, prediction_ids
            job.state = "queued"
        self._queue.put(job)

    def cancel(self, job: Job) -> None:
        """Drop a reserved or queued job now, or stop a running one before its next target forward."""
        with self._lock:
            self._drop_locked(job)
        job._cancel.set()

    def drain(self) -> None:
        """Refuse new jobs and fail every job not yet running with ShuttingDownError (first shutdown signal)."""
        with self._lock:
            self._stopping = True
            waiting = list(self._waiting)
            for job in waiting:
                self._drop_locked(job)
        for job in waiting:
            job.emit("error", ShuttingDownError("the server is shutting down; this request was not started"))
            job._cancel.set()

    def abort_running(self) -> None:
        """End the running job with ShuttingDownError (the shutdown timeout passed, or a second signal)."""
        with self._lock:
            job = self._running
        if job is not None and not job.cancelled:
            job.emit("error", ShuttingDownError("the server shut down before this generation finished"))
            job._cancel.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Drain, abort the running job, and join the worker (it stops before its next target forward)."""
        self.drain()
        self.abort_running()
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("the generation worker did not stop within %.0f s", timeout_s)

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def worker_alive(self) -> bool:
        return self._thread.is_alive()

    def _drop_locked(self, job: Job) -> None:
        if job in self._waiting:
            self._waiting.discard(job)
            job.state = "cancelled"
            self.metrics.queue_depth.set(len(self._waiting))

    def _retry_after(self) -> int:
        estimate = math.ceil(self._mean_duration_s * (len(self._waiting) + 1))
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
                self._mean_duration_s = 0.8 * self._mean_duration_s + 0.2 * (time.perf_counter() - started)
            logger.debug("job %d (%s) %s after %d pieces", job.id, job.label, outcome, job.num_pieces)
            if self.hooks.on_finish is not None:
                self.hooks.on_finish(job, outcome)

    def _begin(self, job: Job) -> bool:
        with self._lock:
            if job.state != "queued":  # cancelled while waiting
                return False
            job.state = "running"
            self._running = job
            self._waiting.discard(job)
            self.metrics.queue_depth.set(len(self._waiting))
            return True

    def _generate(self, job: Job) -> Outcome:
        """Run one job to its end, its cancellation, or its failure; send the events."""
        assert job.decoder is not None
        try:
            generator = make_generator(job.seed, job.decoder.device)
            stream = job.decoder.stream(job.prompt_ids, generator=generator, prediction=job.prediction_ids)
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
