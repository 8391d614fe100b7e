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
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from services.router.connection_guard import CYCLE_EXTENSION, write_whole

Handler = Callable[[Request], Awaitable[Response]]
ErrorHandler = Callable[[Request, Exception], Awaitable[Response]]


class RouterApp(FastAPI):
    """FastAPI, with some POST routes served without its middleware stack (`fast_post`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fast_post: dict[str, Handler] = {}  # path → handler, also registered as FastAPI routes
        self.fast_error: ErrorHandler | None = None  # what FastAPI's Exception handler would answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not self.root_path:
            handler = self.fast_post.get(scope["path"])
            if handler is not None:
                await self._serve(handler, scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    async def _serve(self, handler: Handler, scope: Scope, receive: Receive, send: Send) -> None:
        scope["app"] = self
        request = Request(scope, receive)
        try:
            response = await handler(request)
        except Exception as exc:
            if self.fast_error is not None:
                await (await self.fast_error(request, exc))(scope, receive, send)
            raise
        # a body already whole (not a stream, nothing to run after it): one write on the connection
        if type(response).__call__ is Response.__call__ and response.background is None:
            cycle = scope.get("extensions", {}).get(CYCLE_EXTENSION)
            if cycle is not None and write_whole(cycle, response.status_code, response.raw_headers, response.body):
                return
        # Not wrapped: the responses build their bodies before sending the start, so a failure in
        # here comes after it (nothing else could be sent), and every send stays one call.
        await response(scope, receive, send)
