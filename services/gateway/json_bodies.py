"""JSON bodies of the HTTP API: a response, an error as OpenAI shapes it, and where a
request body is worked on; and the event stream a streamed response is sent as."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from shared.errors import HalfmoonError

encoder = msgspec.json.Encoder()

T = TypeVar("T")

# A body this large is templated, tokenized and checked in a worker thread (the tokenizer
# lets go of the GIL): a prompt of megabytes took seconds, and every stream this gateway
# serves stalled behind it on the event loop. Smaller ones take well under a millisecond.
LARGE_BODY_BYTES = 64 << 10


async def worked_on(body: bytes, work: Callable[[], T], *, is_large: bool = False) -> T:
    """`work()` on `body`: on the event loop, or in a thread for a large body (or one the
    caller knows brings more, as a stored conversation it continues)."""
    if not is_large and len(body) < LARGE_BODY_BYTES:
        return work()
    return await asyncio.to_thread(work)


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=encoder.encode(body), status=status,
                        content_type="application/json")


def event_stream() -> web.StreamResponse:
    """A server-sent event stream, to be prepared: never cached, and never held back by a
    proxy in front of the gateway (nginx buffers a response unless `X-Accel-Buffering: no`,
    and its client would see the tokens only at the end)."""
    return web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",
    })


def error_body(exc: HalfmoonError) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": exc.message, "type": exc.error_type, "param": exc.param,
                      "code": exc.openai_code or exc.code.value}}
