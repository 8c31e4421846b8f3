"""CORS for the OpenAI routes: browser apps calling the gateway directly (`--cors-origins`).

Off unless origins are configured: then a browser's preflight (`OPTIONS` on a `/v1` route,
with `Origin` and `Access-Control-Request-Method`) from an allowed origin is answered 204
without an API key (browsers send none on a preflight), and every `/v1` response to an
allowed origin says so (`Access-Control-Allow-Origin`) and exposes `x-request-id`. An origin
not allowed gets no CORS header, so its browser keeps the response from the page; the
request itself is served or refused as any other. `*` allows every origin (credentials are
a bearer header, never cookies, so the wildcard holds).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ALLOWED_METHODS = "GET, POST, OPTIONS"
ALLOWED_HEADERS = "Authorization, Content-Type, X-Request-Id"
EXPOSED_HEADERS = "x-request-id"
PREFLIGHT_MAX_AGE_S = 600


def parse_origins(setting: str | None) -> frozenset[str]:
    """`--cors-origins`: comma-separated origins (`https://app.example.com`), or `*`."""
    return frozenset(origin.strip().rstrip("/") for origin in (setting or "").split(",")
                     if origin.strip())


class Cors:
    """The allowed origins; a middleware for preflights and a hook for response headers."""

    def __init__(self, origins: frozenset[str]) -> None:
        self._origins = origins

    def allowed(self, request: web.Request) -> str | None:
        """What `Access-Control-Allow-Origin` says to this request; None: no CORS headers."""
        origin = request.headers.get("Origin")
        if not self._origins or origin is None or not request.path.startswith("/v1/"):
            return None
        if "*" in self._origins:
            return "*"
        return origin if origin in self._origins else None

    @web.middleware
    async def preflight(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Answer an allowed origin's preflight here, before the API key is asked for."""
        if (request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers
                and self.allowed(request) is not None):
            return web.Response(status=204, headers={
                "Access-Control-Allow-Methods": ALLOWED_METHODS,
                "Access-Control-Allow-Headers": request.headers.get(
                    "Access-Control-Request-Headers", ALLOWED_HEADERS),
                "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S)})
        return await handler(request)

    async def on_response_prepare(self, request: web.Request,
                                  response: web.StreamResponse) -> None:
        if self._origins and "*" not in self._origins and request.path.startswith("/v1/"):
            response.headers["Vary"] = "Origin"  # the answer depends on it: caches must know
        allow = self.allowed(request)
        if allow is not None:
            response.headers["Access-Control-Allow-Origin"] = allow
            response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
