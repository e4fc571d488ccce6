"""What stands between a client and the routes: the API key check and the bounded body read.

Both answer in OpenAI's error shape. Neither touches the engine, so a refused request costs no KV.
Plain ASGI, no Starlette imports: app.py stays the only Starlette file.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import orjson

from gateway.protocol import ApiError, error_body

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
OPEN_PATHS = frozenset({"/health"})  # load balancers probe it without credentials
# Read-only aggregates (never prompt or output text), open to GET so a browser's EventSource, which cannot
# send headers, can feed the dashboard. Writes to them (POST /v1/stats/reset) still need the key.
OPEN_READS = frozenset({"/dashboard", "/v1/stats", "/v1/stats/stream"})


class ApiKeyMiddleware:
    """Require ``Authorization: Bearer KEY`` on every HTTP path except ``OPEN_PATHS`` and GETs of ``OPEN_READS``.

    The whole header is compared with ``hmac.compare_digest`` so the time taken does not tell how much of
    a guess was right. A pure ASGI middleware (no ``BaseHTTPMiddleware``), so streams and disconnects
    pass through untouched.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _is_open(scope) or self._is_authorized(scope):
            await self.app(scope, receive, send)
            return
        body = orjson.dumps(error_body("missing or incorrect API key: send Authorization: Bearer KEY",
                                       "invalid_request_error", code="invalid_api_key"))
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _is_authorized(self, scope: Scope) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return hmac.compare_digest(given, self.expected)


def _is_open(scope: Scope) -> bool:
    path = scope["path"]
    return path in OPEN_PATHS or (path in OPEN_READS and scope["method"] in ("GET", "HEAD"))


async def read_body(declared: str | None, chunks: AsyncIterator[bytes], limit: int) -> bytes:
    """The request body, refused with 413 once it passes ``limit`` bytes: a declared Content-Length is
    checked before reading, a chunked body while it arrives, so no more than ``limit`` is ever held."""
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, "Content-Length must be a non-negative integer")
        if int(declared) > limit:
            raise _too_large(limit)
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        parts.append(chunk)
    return b"".join(parts)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than {limit} bytes", code="request_too_large")
