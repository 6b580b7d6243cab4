"""The server's OpenAPI document: request bodies, responses and errors as the server really sends them.

The generation routes read their bodies themselves (:func:`flyspec.server.planning.parse_request`,
for OpenAI-shaped errors), so FastAPI cannot see their schemas; :func:`install_openapi` adds them
from the pydantic models of :mod:`flyspec.server.schemas`, with the response shapes of
:mod:`flyspec.server.responses` and the error every rejection carries. Clients and fuzzers
(schemathesis, in the test suite) read it at ``/openapi.json``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from flyspec.server.schemas import ChatCompletionRequest, CompletionRequest

REF = "#/components/schemas/{model}"
NULLABLE_STRING = {"type": ["string", "null"]}
ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string", "minLength": 1},
                "type": {"type": "string", "enum": ["invalid_request_error", "rate_limit_error", "server_error"]},
                "param": NULLABLE_STRING,
                "code": {"type": "string", "minLength": 1},
            },
        }
    },
}
USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        name: {"type": "integer", "minimum": 0} for name in ("prompt_tokens", "completion_tokens", "total_tokens")
    },  # fmt: skip
}
FINISH_REASON = {"type": "string", "enum": ["stop", "length"]}
# one server-sent event: its data is a chunk (JSON), an error object (JSON), or [DONE]
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string", "minLength": 1}}}


def _completion(chat: bool) -> dict[str, Any]:
    if chat:
        message = {"type": "object", "required": ["role", "content"],
                   "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}}  # fmt: skip
        choice = {"message": message, "finish_reason": FINISH_REASON}
    else:
        choice = {"text": {"type": "string"}, "finish_reason": FINISH_REASON}
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "chat.completion" if chat else "text_completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "minItems": 1, "maxItems": 1,
                        "items": {"type": "object", "required": ["index", *choice], "properties": choice}},
            "usage": USAGE,
            "flyspec": {"type": "object", "required": ["verifier", "lossless", "drafter"]},
        },
    }  # fmt: skip


MODEL_CARD = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by"],
    "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                   "owned_by": {"type": "string"}},
}  # fmt: skip
RESPONSE_SCHEMAS = {
    "Error": ERROR,
    "Completion": _completion(chat=False),
    "ChatCompletion": _completion(chat=True),
    "Model": MODEL_CARD,
    "ModelList": {"type": "object", "required": ["object", "data"],
                  "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": MODEL_CARD}}},
    "Health": {"type": "object", "required": ["status", "model", "queue_depth"],
               "properties": {"status": {"const": "ok"}, "model": {"type": "string"},
                              "queue_depth": {"type": "integer", "minimum": 0}}},
}  # fmt: skip
# every status a route may answer with, and why (all but 2xx in the Error shape)
ERRORS = {
    "400": "invalid request (the message says what to change)",
    "401": "missing or wrong API key",
    "403": "speculative settings this server does not allow",
    "404": "unknown model or route",
    "408": "the request body did not arrive in time",
    "413": "request body too large",
    "415": "the body is not JSON",
    "429": "queue full; retry after Retry-After seconds",
    "500": "the generation failed (logged; no details sent)",
    "503": "shutting down",
    "504": "the request's deadline passed",
}
GENERATION_ERRORS = ERRORS
OTHER_ERRORS = {status: ERRORS[status] for status in ("400", "401", "404")}


def _json(schema: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": REF.format(model=schema)}}}


def _errors(statuses: dict[str, str]) -> dict[str, Any]:
    return {status: {"description": meaning, "content": _json("Error")} for status, meaning in statuses.items()}


def _generation(request: str, response: str) -> dict[str, Any]:
    return {
        "requestBody": {"required": True, "content": _json(request)},
        "responses": {
            "200": {
                "description": "the answer, or server-sent events when stream is true",
                "content": {**_json(response), "text/event-stream": {"schema": SSE_EVENT}},
            },
            **_errors(GENERATION_ERRORS),
        },
    }


def install_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` (``/openapi.json``) describe the bodies and every response of each route."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        document = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, definitions = models_json_schema(
            [(CompletionRequest, "validation"), (ChatCompletionRequest, "validation")], ref_template=REF
        )
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(definitions.get("$defs", {}))
        schemas.update(RESPONSE_SCHEMAS)
        paths = document["paths"]
        paths["/v1/completions"]["post"].update(_generation("CompletionRequest", "Completion"))
        paths["/v1/chat/completions"]["post"].update(_generation("ChatCompletionRequest", "ChatCompletion"))
        content = {"/v1/models": "ModelList", "/v1/models/{model}": "Model", "/health": "Health"}
        for path, schema in content.items():
            paths[path]["get"]["responses"] = {"200": {"description": "OK", "content": _json(schema)},
                                               **_errors(OTHER_ERRORS)}  # fmt: skip
        paths["/metrics"]["get"]["responses"] = {
            "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
            **_errors(OTHER_ERRORS),
        }
        app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]
