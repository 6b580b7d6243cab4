"""The OpenAI-compatible app: ``create_app(target, defaults, limits, security)``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``),
``GET /v1/models``, ``GET /health``, ``GET /metrics``. A request passes the host check, CORS,
the API key and the body limits (:mod:`security`, :mod:`middleware`), is validated and planned
(:mod:`planning`), queued on the model's worker (:mod:`engine`), and answered as one JSON body
or as server-sent events (:mod:`responses`). A client that goes away, while queued or while
generating, cancels its job; so does the request's deadline (``request_timeout_s``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive

from flyspec.config import ConfigError, SpeculationConfig
from flyspec.config.names import VERSION
from flyspec.decoding.result import GenerationResult
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.server.cache_file import DEFAULT_MAX_ENTRIES, CacheFile, load_secret
from flyspec.server.caches import tenant_ids
from flyspec.server.engine import Engine, EngineHooks, Event, Job, QueueFullError, ShuttingDownError
from flyspec.server.errors import APIError, from_config_error, install_error_handlers, internal_error
from flyspec.server.lifecycle import Lifecycle
from flyspec.server.metrics import CONTENT_TYPE, ServerMetrics
from flyspec.server.middleware import (
    CLIENT_CLOSED_REQUEST,
    BodyLimitMiddleware,
    RequestMetricsMiddleware,
    record_status,
)
from flyspec.server.openapi import install_openapi
from flyspec.server.planning import GenerationRequest, Planner, parse_request
from flyspec.server.responses import Kind, ResponseBuilder, sse
from flyspec.server.schemas import ChatCompletionRequest, CompletionRequest
from flyspec.server.security import CORS, AuthMiddleware, HostCheckMiddleware, request_tenant
from flyspec.server.settings import ServerLimits, ServerSecurity, describe

logger = logging.getLogger(__name__)
GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
DEFAULT_CACHE_SAVE_INTERVAL_S = 300.0
OTHER_ENDPOINTS = ("/v1/models", "/health", "/metrics")
STREAM_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}  # no proxy may cache or buffer events
T = TypeVar("T")


class ClientDisconnectedError(Exception):
    """The client closed the connection before its response was ready."""


class DeadlineExceededError(Exception):
    """The request's deadline (``request_timeout_s``) passed before its response was ready."""


def create_app(
    target: LoadedModel,
    defaults: SpeculationConfig | None = None,
    limits: ServerLimits | None = None,
    security: ServerSecurity | None = None,
    *,
    draft_model: LoadedModel | None = None,
    served_model_name: str | None = None,
    hooks: EngineHooks | None = None,
    ngram_cache_file: str | Path | None = None,
    ngram_cache_save_interval_s: float = DEFAULT_CACHE_SAVE_INTERVAL_S,
    ngram_cache_file_max_entries: int = DEFAULT_MAX_ENTRIES,
    ngram_cache_secret_file: str | Path | None = None,
) -> FastAPI:
    """An app serving ``target`` (loaded once, shared by every request) under ``served_model_name``.

    ``ngram_cache_file``: the tenants' n-gram caches are restored from it (if it exists) now, saved
    to it every ``ngram_cache_save_interval_s`` seconds (0: only at shutdown) and at shutdown, with at most
    ``ngram_cache_file_max_entries`` n-grams; tenant ids in it are keyed with the secret of
    ``ngram_cache_secret_file`` (default: ``PATH.key``, made on first use; see :mod:`flyspec.server.cache_file`).
    """
    limits = limits or ServerLimits()
    security = security or ServerSecurity()
    served = served_model_name or target.name
    metrics = ServerMetrics()
    engine = Engine(limits.max_queue, metrics, min_retry_after_s=limits.retry_after_s, hooks=hooks)
    lifecycle = Lifecycle(engine, limits.shutdown_timeout_s)
    planner = Planner(
        target,
        defaults or SpeculationConfig(),
        limits,
        security,
        draft_model=draft_model,
        model_names=tuple(dict.fromkeys((served, target.name))),
    )
    generations = Generations(planner, engine, metrics, served, limits.request_timeout_s)
    cache_file = None
    if ngram_cache_file is not None:
        secret = load_secret(ngram_cache_file, ngram_cache_secret_file)
        cache_file = CacheFile(ngram_cache_file, secret, ngram_cache_file_max_entries)
        saved = cache_file.load(*tenant_ids(security.api_keys, secret))
        restored = planner.caches.restore(saved, planner.defaults.ngram_cache, planner.defaults.ngram)
        logger.info(
            "n-gram caches: %d n-grams of %d tenant(s) restored from %s", restored, len(saved), ngram_cache_file
        )
    else:
        secret = secrets.token_bytes(32)  # tenant ids need not outlive this process

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        saving = None
        if cache_file is not None and ngram_cache_save_interval_s > 0:
            saving = asyncio.create_task(_save_periodically(planner, cache_file, ngram_cache_save_interval_s))
        yield
        if saving is not None:
            saving.cancel()
        lifecycle.finish()
        planner.close()
        if cache_file is not None:
            _save_caches(planner, cache_file)

    app = FastAPI(title="flyspec", version=VERSION, lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.planner = engine, metrics, planner
    app.state.lifecycle, app.state.limits, app.state.cache_file = lifecycle, limits, cache_file
    install_error_handlers(app)
    # added innermost first: metrics → host check → CORS → API key and content type → body limits → routes
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=limits.max_body_bytes,
        body_timeout_s=limits.body_timeout_s,
        draining=lifecycle.draining,
    )
    app.add_middleware(AuthMiddleware, api_keys=security.api_keys, tenant_secret=secret)
    if security.cors_origins:
        app.add_middleware(
            CORS,
            allow_origins=list(security.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type"],
            expose_headers=["x-request-id", "x-flyspec-verifier", "x-flyspec-lossless", "x-flyspec-ignored-fields"],
        )
    if security.allowed_hosts is not None:
        app.add_middleware(HostCheckMiddleware, allowed_hosts=security.allowed_hosts)
    app.add_middleware(
        RequestMetricsMiddleware,
        metrics=metrics,
        endpoints=GENERATION_ENDPOINTS + OTHER_ENDPOINTS,
        timed=GENERATION_ENDPOINTS,
    )
    created = int(time.time())

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "flyspec"}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generations.respond(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generations.respond(request, "chat")

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(served)]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        planner.check_model(model)
        return model_card(model)  # the name asked for: the target's own name is accepted beside an alias

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": served, "queue_depth": engine.queue_depth}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        metrics.observe_caches(planner.caches.totals())
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    install_openapi(app)
    return app


class Generations:
    """The two generation endpoints: check, reserve a place, prepare, queue, then answer as JSON or a stream."""

    def __init__(
        self, planner: Planner, engine: Engine, metrics: ServerMetrics, served_model: str, timeout_s: float
    ) -> None:
        self.planner = planner
        self.engine = engine
        self.metrics = metrics
        self.served_model = served_model
        self.timeout_s = timeout_s

    async def respond(self, request: Request, kind: Kind) -> Response:
        arrived = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        raw = await request.body()
        body: GenerationRequest = (
            parse_request(raw, ChatCompletionRequest) if kind == "chat" else parse_request(raw, CompletionRequest)
        )
        speculation = self.planner.check(body)  # 4xx before a place in the queue is taken
        described = describe(speculation)
        if self.planner.profile is not None:
            described["profile"] = self.planner.profile.name
        if body.ignored_fields:
            described["ignored_fields"] = body.ignored_fields
        builder = ResponseBuilder(
            kind, self.served_model, described, body.include_usage, prediction=body.prediction is not None
        )
        job = Job(body.seed, label=builder.request_id)
        self._admit(lambda: self.engine.reserve(job))  # counts against the queue while it is tokenized
        disconnected = asyncio.create_task(_wait_for_disconnect(request.receive))
        try:
            prepare = self.planner.prepare(body, speculation, request_tenant(request.scope))
            plan = await _until(prepare, disconnected, deadline)
            self._admit(lambda: self.engine.submit(job, plan.decoder, plan.prompt_ids, plan.prediction_ids))
            first = await _until(job.next_event(), disconnected, deadline)
            if first[0] != "error":
                self.metrics.time_to_first_token.labels(request.url.path).observe(time.perf_counter() - arrived)
            if body.stream:
                self._raise_for_error(first)  # nothing sent yet: a plain error response with its status
                stream = self._stream(request, job, first, builder, deadline)
                headers = {**builder.headers(), **STREAM_HEADERS}
                return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
            result = await _until(self._collect(job, first), disconnected, deadline)
        except ClientDisconnectedError:
            self.engine.cancel(job)
            self.metrics.cancelled.inc()
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except DeadlineExceededError as error:
            self.engine.cancel(job)
            self.metrics.timed_out.inc()
            raise _deadline_error(self.timeout_s) from error
        except BaseException:  # an error response, or the server stopping: the job has no reader any more
            self.engine.cancel(job)
            raise
        finally:
            disconnected.cancel()
        self.metrics.observe_result(result, speculation.verifier, speculation.drafter, builder.prediction)
        return JSONResponse(builder.body(result), headers=builder.headers())

    def _admit(self, admit: Callable[[], None]) -> None:
        """Run ``admit`` (a reservation or a submission), mapping a full queue to 429 and shutdown to 503."""
        try:
            admit()
        except QueueFullError as error:
            self.metrics.rejected.inc()
            headers = {"Retry-After": str(error.retry_after_s)}
            raise APIError(429, str(error), code="queue_full", headers=headers) from error
        except ShuttingDownError as error:
            raise APIError(503, str(error), code="shutting_down") from error

    async def _collect(self, job: Job, event: Event) -> GenerationResult:
        """Wait for the end of a non-streamed generation."""
        while event[0] == "piece":
            event = await job.next_event()
        self._raise_for_error(event)
        return event[1]

    async def _stream(
        self, request: Request, job: Job, first: Event, builder: ResponseBuilder, deadline: float
    ) -> AsyncIterator[str]:
        """Server-sent events; leaving early (the client went away) cancels the job."""
        finished = False
        try:
            for chunk in builder.first_chunks():
                yield chunk
            event = first
            while event[0] == "piece":
                yield builder.piece_chunk(event[1])
                try:
                    async with asyncio.timeout_at(deadline):  # around the wait only: never across a yield
                        event = await job.next_event()
                except TimeoutError:
                    event = ("error", DeadlineExceededError())
            finished = True
            if event[0] == "error":  # headers are sent: the error goes in the stream, as OpenAI does
                self.engine.cancel(job)
                error = self._error_for(event[1])
                if isinstance(event[1], DeadlineExceededError):
                    self.metrics.timed_out.inc()
                record_status(request.scope, error.status)
                yield sse(error.body())
                return
            flyspec = builder.flyspec
            self.metrics.observe_result(event[1], flyspec["verifier"], flyspec["drafter"], builder.prediction)
            for chunk in builder.last_chunks(event[1]):
                yield chunk
        finally:
            if not finished:
                self.engine.cancel(job)
                self.metrics.cancelled.inc()

    def _raise_for_error(self, event: Event) -> None:
        if event[0] == "error":
            raise self._error_for(event[1])

    def _error_for(self, error: BaseException) -> APIError:
        if isinstance(error, ConfigError):
            return from_config_error(error)
        if isinstance(error, ShuttingDownError):
            return APIError(503, str(error), code="shutting_down")
        if isinstance(error, DeadlineExceededError):
            return _deadline_error(self.timeout_s)
        return internal_error()  # the engine logged the exception; the client gets no details


def _save_caches(planner: Planner, file: CacheFile) -> None:
    """One save; no failure of it stops the server (the previous file is intact; the next save may work)."""
    try:
        planner.caches.save(file)
    except OSError as error:  # a full disk, a read-only mount
        logger.error("could not save the n-gram caches to %s (the previous file is kept): %s", file.path, error)
    except Exception:  # a bug must not end the periodic saves either
        logger.exception("could not save the n-gram caches to %s (the previous file is kept)", file.path)


async def _save_periodically(planner: Planner, file: CacheFile, interval_s: float) -> None:
    """Save the caches every ``interval_s`` (off the event loop), so a crash loses at most that much."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval_s)
        await loop.run_in_executor(None, _save_caches, planner, file)


def _deadline_error(timeout_s: float) -> APIError:
    message = f"the request did not finish within this server's --request-timeout of {timeout_s:g} s"
    return APIError(504, message, code="deadline_exceeded")


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until(awaitable: Awaitable[T], disconnected: asyncio.Task[None], deadline: float) -> T:
    """Await ``awaitable``, unless the client leaves first (ClientDisconnectedError) or ``deadline`` passes.

    ``deadline`` is in the event loop's clock; passing it raises DeadlineExceededError.
    """
    task = asyncio.ensure_future(awaitable)
    timeout = max(deadline - asyncio.get_running_loop().time(), 0.0)
    try:
        await asyncio.wait({task, disconnected}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    if task.done():
        return task.result()
    task.cancel()
    raise ClientDisconnectedError if disconnected.done() else DeadlineExceededError
