"""ASGI middleware: errors and status metrics, API-key check, request-body limit.

Plain ASGI (not BaseHTTPMiddleware) so streaming responses and client-disconnect
messages pass through untouched.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any, Awaitable, Callable, Iterable, Optional

from freetoken.server.anthropic_protocol import response_for
from freetoken.server.errors import APIError
from freetoken.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyTooLarge(Exception):
    pass


async def _send_error(scope: Scope, send: Send, error: APIError,
                      headers: Optional[list[tuple[bytes, bytes]]] = None) -> None:
    """The error in the shape of the requested endpoint's API (OpenAI, or Anthropic on /v1/messages)."""
    response = response_for(scope.get("path", ""), error)
    await send({
        "type": "http.response.start",
        "status": response.status_code,
        "headers": list(response.raw_headers) + list(headers or []),
    })
    await send({"type": "http.response.body", "body": response.body})


#: Up to this many bytes of a refused body are read and dropped, so the client can
#: finish sending and read the 413; beyond it the connection is simply closed.
_DRAIN_LIMIT = 64 * 1024 * 1024


async def _drain(receive: Receive, announced: int) -> None:
    if announced > _DRAIN_LIMIT:
        return
    while True:
        msg = await receive()
        if msg["type"] != "http.request" or not msg.get("more_body", False):
            return


class ErrorAndMetricsMiddleware:
    """Outermost layer: counts every response by endpoint and status, and turns an
    exception escaping a route into a 500 error object with the traceback logged."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, endpoints: Iterable[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = set(endpoints)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in self.endpoints else "other"
        status: dict[str, Optional[int]] = {"code": None}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except BodyTooLarge as exc:
            if status["code"] is None:
                await _send_error(scope, send_wrapper, APIError(413, str(exc), code="request_too_large"))
        except Exception:  # noqa: BLE001 - one request fails, the server keeps serving
            logger.exception("internal error while serving %s %s", scope.get("method"), path)
            if status["code"] is None:
                await _send_error(
                    scope, send_wrapper,
                    APIError(500, "The server had an internal error while processing the request "
                                  "(details are in the server log).", code="internal_error"),
                )
        finally:
            if status["code"] is not None:
                self.metrics.observe_status(endpoint, status["code"])


class APIKeyMiddleware:
    """With a key configured, /v1/* needs ``Authorization: Bearer KEY`` or ``x-api-key: KEY``
    (Anthropic's header), else 401. /health and /metrics stay open for load balancers
    and scrapers."""

    def __init__(self, app: ASGIApp, api_key: Optional[str], protected_prefix: str = "/v1") -> None:
        self.app = app
        self.api_key = api_key
        self.prefix = protected_prefix

    def _authorized(self, scope: Scope) -> bool:
        key = self.api_key.encode()
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key):
                    return True
            elif name == b"x-api-key" and hmac.compare_digest(value.strip(), key):
                return True
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.api_key
            and scope["type"] == "http"
            and scope.get("path", "").startswith(self.prefix)
            and scope.get("method") != "OPTIONS"
            and not self._authorized(scope)
        ):
            await _send_error(
                scope, send,
                APIError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
                         code="invalid_api_key", type="invalid_request_error"),
                headers=[(b"www-authenticate", b"Bearer")],
            )
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuses request bodies above ``max_bytes`` with 413, by Content-Length up front
    or while reading a chunked body."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        message = f"Request body too large: the limit is {limit} bytes."
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    await _send_error(scope, send, APIError(400, "invalid Content-Length header"))
                    return
                if length > limit:
                    await _drain(receive, length)
                    await _send_error(scope, send, APIError(413, message, code="request_too_large"))
                    return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(message)
            return msg

        await self.app(scope, limited_receive, send)
