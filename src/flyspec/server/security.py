"""Who may call the API (pure ASGI middleware; errors in the OpenAI shape).

``HostCheckMiddleware``: the ``Host`` header must name this server (``allowed_hosts``). A
server on 127.0.0.1 is otherwise reachable from any web page through DNS rebinding: a hostile
name that resolves to 127.0.0.1 makes the browser treat the server as that page's own origin.

``AuthMiddleware``: with API keys, every route but ``GET /health`` needs ``Authorization: Bearer
KEY`` (401 otherwise); the matching key names the request's tenant (``scope["state"]["flyspec.tenant"]``),
which keeps per-tenant state such as n-gram caches apart (:func:`tenant_of`). A POST must carry JSON (415 otherwise):
browsers send text/plain and form bodies cross-origin without a CORS preflight.

``CORS``: starlette's CORS middleware for the origins the operator lists (none by default, so
browsers never let another site's page read a response), refusing in the OpenAI error shape.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from flyspec.server.errors import APIError
from flyspec.server.middleware import send_error

OPEN_PATHS = frozenset({"/health"})
DEFAULT_TENANT = "default"
TENANT_KEY = "flyspec.tenant"


def host_name(host: str) -> str:
    """The name in a ``Host`` header, lower-case, without port, brackets or trailing dot."""
    host = host.strip().lower()
    if host.startswith("["):
        host = host[1 : host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def tenant_of(key: str, secret: bytes) -> str:
    """The tenant id of an API key: an HMAC-SHA256 under the server's ``secret`` (in logs, the cache file).

    Not a bare hash: whoever reads one (in a cache file, a log) could test guessed keys against it offline.
    """
    return "key-" + hmac.new(secret, key.encode(), hashlib.sha256).hexdigest()[:32]


class HostCheckMiddleware:
    """Refuse requests whose ``Host`` is not one of ``allowed_hosts`` (400 ``invalid_host``)."""

    def __init__(self, app: ASGIApp, allowed_hosts: tuple[str, ...]) -> None:
        self.app = app
        self.allowed = frozenset(host_name(host) for host in allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = Headers(scope=scope).get("host", "")
            if host_name(host) not in self.allowed:
                message = (
                    f"this server does not answer to the host name {host[:100]!r}; use one it was configured "
                    "with (--allowed-host)"
                )
                await send_error(send, 400, message, "invalid_host")
                return
        await self.app(scope, receive, send)


class AuthMiddleware:
    """API keys (401 ``invalid_api_key``), JSON bodies (415), and the tenant of each request."""

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...], tenant_secret: bytes) -> None:
        self.app = app
        # keys are compared as digests, in constant time; the digests stay in memory only
        self._tenants = {hashlib.sha256(key.encode()).digest(): tenant_of(key, tenant_secret) for key in api_keys}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        tenant = DEFAULT_TENANT
        if self._tenants and scope["path"] not in OPEN_PATHS:
            found = self._tenant(headers.get("authorization", ""))
            if found is None:
                await self._unauthorized(send, "authorization" in headers)
                return
            tenant = found
        if scope["method"] == "POST":
            media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media_type != "application/json":
                shown = media_type[:100] or "none"
                message = f"send the request body as JSON, with Content-Type: application/json (got {shown})"
                await send_error(send, 415, message, "unsupported_media_type")
                return
        scope.setdefault("state", {})[TENANT_KEY] = tenant
        await self.app(scope, receive, send)

    def _tenant(self, authorization: str) -> str | None:
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        digest = hashlib.sha256(key.strip().encode()).digest()
        matches = [tenant for known, tenant in self._tenants.items() if hmac.compare_digest(digest, known)]
        return matches[0] if matches else None

    @staticmethod
    async def _unauthorized(send: Send, sent_a_key: bool) -> None:
        message = "invalid API key" if sent_a_key else "this server needs an API key: send Authorization: Bearer <key>"
        await send_error(send, 401, message, "invalid_api_key", headers={"www-authenticate": "Bearer"})


def request_tenant(scope: Scope) -> str:
    return scope.get("state", {}).get(TENANT_KEY, DEFAULT_TENANT)


class CORS(CORSMiddleware):
    """Starlette's CORS middleware; a refused preflight is answered in the OpenAI error shape."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        kept = {name: value for name, value in response.headers.items() if name.startswith("access-control-")}
        message = f"{bytes(response.body).decode()}: see this server's --cors-origin"
        return APIError(400, message, code="cors_refused", headers=kept).response()
