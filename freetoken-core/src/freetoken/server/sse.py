"""Server-sent events framing: ``data: {json}\\n\\n`` per chunk and a final ``data: [DONE]``."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

from starlette.responses import StreamingResponse

from freetoken.server.errors import APIError, json_dumps

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def event(payload: dict[str, Any]) -> str:
    return f"data: {json_dumps(payload)}\n\n"


async def guarded(chunks: AsyncIterator[str], what: str) -> AsyncIterator[str]:
    """Pass chunks through; an internal error after the headers went out becomes an
    error event (then ``[DONE]``) and a logged traceback. A client disconnect
    (cancellation) propagates, which closes the engine streams."""
    try:
        async for chunk in chunks:
            yield chunk
    except asyncio.CancelledError:
        raise
    except APIError as exc:
        yield event(exc.body())
        yield DONE
    except Exception:  # noqa: BLE001
        logger.exception("internal error while streaming %s", what)
        yield event(APIError(500, "The server had an internal error while streaming the response "
                                  "(details are in the server log).", code="internal_error").body())
        yield DONE


def sse_response(chunks: AsyncIterator[str], what: str) -> StreamingResponse:
    return StreamingResponse(
        guarded(chunks, what),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
