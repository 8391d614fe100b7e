"""The generation routes as plain ASGI, in front of FastAPI's middleware and routing.

`POST /v1/completions` and `POST /v1/chat/completions` carry every token the router serves, and
they parse their bodies by hand (services/router/protocol.py): FastAPI's routing, dependency
solving and its two exception middlewares (which also wrap every `send` of a stream) cost about
a tenth of a request's CPU and add nothing for them. `RouterApp` hands exactly those two
method + path pairs to their handler directly; everything else — other methods on those paths
(405), other paths, a trailing slash (redirect), lifespan, the OpenAPI schema, which still lists
both routes — goes through FastAPI as before. An exception escaping the handler is answered as
FastAPI's catch-all handler would (the same 500 body), then re-raised as Starlette's
ServerErrorMiddleware does, so uvicorn logs it the same way.

A request from a browser (one with an `Origin` header) goes through the CORS rules first
(`cors`, services/router/cors.py), which add their headers as the response starts: its whole
body then goes out through `send` too, not past it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from services.router.connection_guard import CYCLE_EXTENSION, write_whole
from services.router.cors import has_origin

Handler = Callable[[Request], Awaitable[Response]]
ErrorHandler = Callable[[Request, Exception], Awaitable[Response]]


class RouterApp(FastAPI):
    """FastAPI, with some POST routes served without its middleware stack (`fast_post`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fast_post: dict[str, Handler] = {}  # path → handler, also registered as FastAPI routes
        self.fast_error: ErrorHandler | None = None  # what FastAPI's Exception handler would answer
        self.cors: ASGIApp | None = None  # the CORS rules, wrapping `route_through_send`

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if self.cors is not None and has_origin(scope["headers"]):
                await self.cors(scope, receive, send)
                return
            handler = self._fast_handler(scope)
            if handler is not None:
                await self._serve(handler, scope, receive, send, True)
                return
            if scope["method"] == "HEAD":
                scope = self._head_as_get(scope)
        await super().__call__(scope, receive, send)

    async def route_through_send(self, scope: Scope, receive: Receive, send: Send) -> None:
        """__call__'s routing with every response through `send` (what a middleware wrapping this
        sees), the one-write shortcut left out; not shared with __call__, whose requests would
        then pay one more await each."""
        handler = self._fast_handler(scope) if scope["type"] == "http" else None
        if handler is not None:
            await self._serve(handler, scope, receive, send, False)
            return
        if scope["type"] == "http" and scope["method"] == "HEAD":
            scope = self._head_as_get(scope)
        await super().__call__(scope, receive, send)

    def _head_as_get(self, scope: Scope) -> Scope:
        """HEAD of a GET route is served as its GET (HTTP requires it of every GET resource:
        uptime monitors and `curl -I` send it; FastAPI's routes answer only the methods they
        name). The server leaves the body out, since its own scope still says HEAD. Elsewhere the
        scope stays as it came, so a 404 or 405 names the method the client sent."""
        as_get = dict(scope, method="GET")
        if any(route.matches(as_get)[0] is Match.FULL for route in self.router.routes):
            return as_get
        return scope

    def _fast_handler(self, scope: Scope) -> Handler | None:
        if scope["method"] != "POST":
            return None
        path = scope["path"]
        # behind a proxy that keeps the prefix (--root-path), as FastAPI's routing takes it off
        if self.root_path and path.startswith(self.root_path + "/"):
            path = path[len(self.root_path):]
        return self.fast_post.get(path)

    async def _serve(self, handler: Handler, scope: Scope, receive: Receive, send: Send, direct: bool) -> None:
        scope["app"] = self
        request = Request(scope, receive)
        try:
            response = await handler(request)
        except Exception as exc:
            if self.fast_error is not None:
                await (await self.fast_error(request, exc))(scope, receive, send)
            raise
        # a body already whole (not a stream, nothing to run after it): one write on the connection
        if direct and type(response).__call__ is Response.__call__ and response.background is None:
            cycle = scope.get("extensions", {}).get(CYCLE_EXTENSION)
            if cycle is not None and write_whole(cycle, response.status_code, response.raw_headers, response.body):
                return
        # Not wrapped: the responses build their bodies before sending the start, so a failure in
        # here comes after it (nothing else could be sent), and every send stays one call.
        await response(scope, receive, send)
