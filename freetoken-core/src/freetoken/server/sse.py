"""Server-sent events framing: ``data: {json}\\n\\n`` per chunk and a final ``data: [DONE]``
(OpenAI's framing; the error events of another framing are a parameter)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable

from starlette.responses import StreamingResponse

from freetoken.server.errors import APIError, json_dumps

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def event(payload: dict[str, Any]) -> str:
    return f"data: {json_dumps(payload)}\n\n"


def openai_error_events(error: APIError) -> list[str]:
    """How an OpenAI stream ends on an error: the error object, then ``[DONE]``."""
    return [event(error.body()), DONE]


ErrorEvents = Callable[[APIError], list[str]]


async def guarded(chunks: AsyncIterator[str], what: str,
                  error_events: ErrorEvents = openai_error_events) -> AsyncIterator[str]:
    """Pass chunks through; an internal error after the headers went out becomes the
    stream's error events and a logged traceback. A client disconnect (cancellation)
    propagates, which closes the engine streams."""
    try:
        async for chunk in chunks:
            yield chunk
    except asyncio.CancelledError:
        raise
    except APIError as exc:
        for chunk in error_events(exc):
            yield chunk
    except Exception:  # noqa: BLE001
        logger.exception("internal error while streaming %s", what)
        error = APIError(500, "The server had an internal error while streaming the response "
                              "(details are in the server log).", code="internal_error")
        for chunk in error_events(error):
            yield chunk


def sse_response(chunks: AsyncIterator[str], what: str,
                 error_events: ErrorEvents = openai_error_events) -> StreamingResponse:
    return StreamingResponse(
        guarded(chunks, what, error_events),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
