"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Bad input is always a 4xx with a message that says what to change; an unexpected failure is a
500 with a fixed, safe message (the exception and its traceback go to the log, never the client).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from flyspec.config import ConfigError

logger = logging.getLogger(__name__)

INTERNAL_ERROR_MESSAGE = "the server failed while generating; the error was logged (try again or report it)"
_UNION_MEMBER = re.compile(r"^(str|int|float|bool)$|\[")
_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error to send to the client as it is."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    error_type = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_config_error(error: ConfigError, param: str | None = None) -> APIError:
    return bad_request(str(error), param=param, code="invalid_value")


def internal_error() -> APIError:
    return APIError(500, INTERNAL_ERROR_MESSAGE, code="internal_error")


def _split_location(location: tuple[Any, ...]) -> tuple[str | None, str | None]:
    """``(param, union member)``: pydantic puts the member type (``str``, ``list[...]``) into union locations."""
    parts: list[str] = []
    for part in location:
        if part == "body":
            continue
        if isinstance(part, str) and _UNION_MEMBER.search(part):
            return ".".join(parts) or None, part.replace("constrained-", "")
        parts.append(str(part))
    return ".".join(parts) or None, None


def from_validation_error(error: ValidationError | RequestValidationError) -> APIError:
    """The first problem pydantic found, as a 400 naming the field (``param``) in dotted form."""
    problems = error.errors()
    problem = problems[0]
    param, member = _split_location(tuple(problem.get("loc", ())))
    message = str(problem.get("msg", "invalid request")).removeprefix("Value error, ")
    if member is not None:  # no member of a union matched: list what would have
        members = [_split_location(tuple(other.get("loc", ())))[1] for other in problems]
        alternatives = list(dict.fromkeys(name for name in members if name))
        message = f"should be one of: {', '.join(alternatives)}"
    if problem.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON ({message})", code="invalid_json")
    if problem.get("type") == "extra_forbidden":
        return bad_request(
            f"unknown field {param!r}: flyspec serve does not know it (a typo?); leave it out",
            param=param,
            code="unknown_parameter",
        )
    if problem.get("type") == "missing":
        return bad_request(f"missing required field {param!r}", param=param, code="missing_field")
    subject = f"invalid value for {param!r}" if param else "invalid request body"
    return bad_request(f"{subject}: {message}", param=param, code="invalid_value")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise bad_request(f"the request body is not valid JSON ({error})", code="invalid_json") from error
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    return data


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves the app in the OpenAI shape; FastAPI's 422 never does."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, error: RequestValidationError) -> JSONResponse:
        return from_validation_error(error).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no route {request.url.path!r}", 405: f"method {request.method} not allowed here"}
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        body = error_body(error.status_code, message.get(error.status_code, str(error.detail)), code=code)
        return JSONResponse(body, status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=error)
        return internal_error().response()
