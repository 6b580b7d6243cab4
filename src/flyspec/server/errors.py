"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Bad input is always a 4xx with a message that says what to change, and every error has a
``code``; an unexpected failure is a 500 with a fixed, safe message (the exception and its
traceback go to the log, never the client). :func:`parse_json_object` refuses what would make
later stages fail: NaN/Infinity, lone surrogates, deep nesting and oversized integers.
"""

from __future__ import annotations

import json
import logging
import math
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
MAX_JSON_DEPTH = 32  # a request body is a few levels deep; deeper only costs recursion
_UNION_MEMBER = re.compile(r"^(str|int|float|bool)$|\[")
_TOO_DEEP = f"the request body is nested more than {MAX_JSON_DEPTH} levels deep; no field needs that"
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_TYPES = {429: "rate_limit_error"}  # others: invalid_request_error below 500, server_error from 500
_CODES = {  # an error raised without a code gets its status's
    400: "invalid_value",
    401: "invalid_api_key",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    415: "unsupported_media_type",
    429: "rate_limit_exceeded",
    500: "internal_error",
    503: "service_unavailable",
    504: "deadline_exceeded",
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
    code = code or _CODES.get(status, "invalid_request" if status < 500 else "server_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def shorten(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to about ``limit`` characters: a client's value never makes a message huge."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def bad_request(message: str, *, param: str | None = None, code: str = "invalid_value") -> APIError:
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


class _NonFinite(float):
    """A NaN or Infinity literal (or an overflowing number) in the body, kept so the check can name its field."""


def _finite_float(text: str) -> float:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(value)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400.

    Refused here, naming the field: NaN, Infinity and numbers that overflow to infinity (not
    JSON; Python's parser accepts them), strings with a lone surrogate (``"\\ud800"``: no
    tokenizer or response can encode it), nesting deeper than :data:`MAX_JSON_DEPTH`, and integers
    of more than 4300 digits (Python refuses to convert them).
    """
    try:
        data = json.loads(raw, parse_constant=lambda name: _NonFinite(name), parse_float=_finite_float)
    except RecursionError as error:
        raise bad_request(_TOO_DEEP, code="invalid_json") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise bad_request(f"the request body is not valid JSON ({str(error)[:200]})", code="invalid_json") from error
    except ValueError as error:  # an integer too long for Python to convert (sys.get_int_max_str_digits)
        raise bad_request("a number in the request body has thousands of digits; no field needs that") from error
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    _check_values(data)
    return data


def _check_values(data: dict[str, Any]) -> None:
    """Walk the parsed body (iteratively: no recursion on hostile nesting) for values nothing downstream can handle."""
    pending: list[tuple[Any, tuple[str, ...]]] = [(data, ())]
    while pending:
        value, path = pending.pop()
        param = ".".join(path)[:200] or None
        if len(path) > MAX_JSON_DEPTH:
            raise bad_request(_TOO_DEEP, code="invalid_json")
        if isinstance(value, _NonFinite):
            raise bad_request(
                f"invalid value for {param!r}: {value} is not a finite number (JSON has no NaN or Infinity)",
                param=param,
            )
        if isinstance(value, str) and _LONE_SURROGATE.search(value):
            raise bad_request(
                f"invalid value for {param!r}: the text contains a lone UTF-16 surrogate (an escape like "
                "\\ud800 without its pair), which is not a character; fix the client's encoding",
                param=param,
            )
        if isinstance(value, dict):
            for key, inner in value.items():
                if _LONE_SURROGATE.search(key):
                    raise bad_request("a field name contains a lone UTF-16 surrogate", param=param)
                pending.append((inner, (*path, key)))
        elif isinstance(value, list):
            pending.extend((inner, (*path, str(index))) for index, inner in enumerate(value))


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
        message = {404: f"no route {shorten(request.url.path)}", 405: f"method {request.method} not allowed here"}
        body = error_body(error.status_code, message.get(error.status_code, str(error.detail)))
        return JSONResponse(body, status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=error)
        return internal_error().response()
