"""The OpenAI-compatible app: ``create_app(target, defaults, limits)``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``),
``GET /v1/models``, ``GET /health``, ``GET /metrics``. A request is validated and planned
(:mod:`planning`), queued on the model's worker (:mod:`engine`), and answered as one JSON body
or as server-sent events (:mod:`responses`). A client that goes away, while queued or while
generating, cancels its job.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive

from flyspec import __version__
from flyspec.config import ConfigError
from flyspec.models import LoadedModel
from flyspec.server.engine import Engine, EngineHooks, Event, Job, QueueFullError, ShuttingDownError
from flyspec.server.errors import APIError, from_config_error, install_error_handlers, internal_error
from flyspec.server.metrics import CONTENT_TYPE, ServerMetrics
from flyspec.server.middleware import BodyLimitMiddleware, RequestMetricsMiddleware
from flyspec.server.planning import Planner, parse_request
from flyspec.server.responses import Kind, ResponseBuilder, sse
from flyspec.server.schemas import ChatCompletionRequest, CompletionRequest
from flyspec.server.settings import ServerLimits, SpeculationDefaults
from flyspec.types import GenerationResult

GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
OTHER_ENDPOINTS = ("/v1/models", "/health", "/metrics")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; only ever seen in metrics and logs
T = TypeVar("T")


class ClientDisconnectedError(Exception):
    """The client closed the connection before its response was ready."""


def create_app(
    target: LoadedModel,
    defaults: SpeculationDefaults | None = None,
    limits: ServerLimits | None = None,
    *,
    draft_model: LoadedModel | None = None,
    served_model_name: str | None = None,
    hooks: EngineHooks | None = None,
) -> FastAPI:
    """An app serving ``target`` (loaded once, shared by every request) under ``served_model_name``."""
    limits = limits or ServerLimits()
    served = served_model_name or target.name
    metrics = ServerMetrics()
    engine = Engine(limits.max_queue, metrics, min_retry_after_s=limits.retry_after_s, hooks=hooks)
    planner = Planner(
        target,
        defaults or SpeculationDefaults(),
        limits,
        draft_model=draft_model,
        model_names=tuple(dict.fromkeys((served, target.name))),
    )
    generations = Generations(planner, engine, metrics, served)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.stop()
        planner.close()

    app = FastAPI(title="flyspec", version=__version__, lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.planner = engine, metrics, planner
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=limits.max_body_bytes)
    app.add_middleware(
        RequestMetricsMiddleware,
        metrics=metrics,
        endpoints=GENERATION_ENDPOINTS + OTHER_ENDPOINTS,
        timed=GENERATION_ENDPOINTS,
    )
    created = int(time.time())
    model_card = {"id": served, "object": "model", "created": created, "owned_by": "flyspec"}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generations.respond(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generations.respond(request, "chat")

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        planner.check_model(model)
        return model_card

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": served, "queue_depth": engine.queue_depth}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    return app


class Generations:
    """The two generation endpoints: plan, queue, then answer as JSON or as a stream."""

    def __init__(self, planner: Planner, engine: Engine, metrics: ServerMetrics, served_model: str) -> None:
        self.planner = planner
        self.engine = engine
        self.metrics = metrics
        self.served_model = served_model

    async def respond(self, request: Request, kind: Kind) -> Response:
        arrived = time.perf_counter()
        schema = ChatCompletionRequest if kind == "chat" else CompletionRequest
        body = parse_request(await request.body(), schema)
        self._admit(self.engine.check_room)  # a full server refuses before tokenizing anything
        plan = await self.planner.plan(body)
        builder = ResponseBuilder(kind, self.served_model, plan.speculation.describe(), body.include_usage)
        job = Job(plan.decoder, plan.prompt_ids, body.seed, label=builder.request_id)
        self._admit(lambda: self.engine.submit(job))
        disconnected = asyncio.create_task(_wait_for_disconnect(request.receive))
        try:
            first = await _unless_disconnected(job.next_event(), disconnected)
            if first[0] != "error":
                self.metrics.time_to_first_token.labels(request.url.path).observe(time.perf_counter() - arrived)
            if body.stream:
                self._raise_for_error(first)  # nothing sent yet: a plain error response with its status
                stream = self._stream(job, first, builder)
                return StreamingResponse(stream, media_type="text/event-stream", headers=builder.headers())
            result = await _unless_disconnected(self._collect(job, first), disconnected)
        except ClientDisconnectedError:
            self.engine.cancel(job)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except BaseException:  # an error response, or the server stopping: the job has no reader any more
            self.engine.cancel(job)
            raise
        finally:
            disconnected.cancel()
        self.metrics.observe_result(result, plan.speculation.verifier, plan.speculation.drafter)
        return JSONResponse(builder.body(result), headers=builder.headers())

    def _admit(self, admit: Callable[[], None]) -> None:
        """Run ``admit`` (a queue check or a submission), mapping a full queue to 429 and shutdown to 503."""
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

    async def _stream(self, job: Job, first: Event, builder: ResponseBuilder) -> AsyncIterator[str]:
        """Server-sent events; leaving early (the client went away) cancels the job."""
        finished = False
        try:
            for chunk in builder.first_chunks():
                yield chunk
            event = first
            while event[0] == "piece":
                yield builder.piece_chunk(event[1])
                event = await job.next_event()
            finished = True
            if event[0] == "error":  # headers are sent: the error goes in the stream, as OpenAI does
                yield sse(self._error_for(event[1]).body())
                return
            self.metrics.observe_result(event[1], builder.flyspec["verifier"], builder.flyspec["drafter"])
            for chunk in builder.last_chunks(event[1]):
                yield chunk
        finally:
            if not finished:
                self.engine.cancel(job)

    def _raise_for_error(self, event: Event) -> None:
        if event[0] == "error":
            raise self._error_for(event[1])

    @staticmethod
    def _error_for(error: BaseException) -> APIError:
        if isinstance(error, ConfigError):
            return from_config_error(error)
        if isinstance(error, ShuttingDownError):
            return APIError(503, str(error), code="shutting_down")
        return internal_error()  # the engine logged the exception; the client gets no details


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(awaitable: Awaitable[T], disconnected: asyncio.Task[None]) -> T:
    """Await ``awaitable``, or raise :class:`ClientDisconnectedError` if the client leaves first."""
    task = asyncio.ensure_future(awaitable)
    await asyncio.wait({task, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return task.result()
    task.cancel()
    raise ClientDisconnectedError
