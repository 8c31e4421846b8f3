"""JSON bodies of the HTTP API: a response, and an error as OpenAI shapes it."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from shared.errors import HalfmoonError

encoder = msgspec.json.Encoder()


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=encoder.encode(body), status=status,
                        content_type="application/json")


def error_body(exc: HalfmoonError) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": exc.message, "type": exc.error_type, "param": exc.param,
                      "code": exc.openai_code or exc.code.value}}
