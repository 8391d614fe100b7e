"""The router's HTTP surface: the OpenAI API on FastAPI + uvicorn, assembled here.

POST /v1/completions, POST /v1/chat/completions (JSON or SSE: generation_routes.py),
GET /v1/models[/{id}] (model_routes.py), GET /health (200 while a healthy prefill+decode pair
exists, else 503), GET /metrics, POST /reset_prefix_cache (service_routes.py), vLLM's extras
(extra_routes.py), POST /v1/responses (translated into chat: responses_route.py). The router object they share: service.py.
Browsers' cross-origin requests: CORS rules in front of all of it (cors.py).

A streaming response starts (status 200, first SSE byte) only once decode's first token is
in hand, so every failure before it is a proper HTTP status and is failed over to another
pair; after it, a decode fault migrates the request (services/router/orchestrator.py), and only
a failure that cannot be migrated ends the stream with `data: {"error": ...}` and
`data: [DONE]`; the keep-alive connection stays usable (request_driver.py).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.config import RouterSettings
from services.common.logging_setup import get_logger
from services.common.tokenizer import Tokenizer
from services.router import (
    errors,
    extra_routes,
    generation_routes,
    messages_route,
    model_routes,
    openapi,
    responses_route,
    service_routes,
)
from services.router.cors import cors
from services.router.errors import APIError
from services.router.fastpath import RouterApp
from services.router.service import Router

log = get_logger("router")


def create_app(settings: RouterSettings, tokenizer: Tokenizer | None = None) -> FastAPI:
    router = Router(settings, tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.close()

    docs = not settings.disable_fastapi_docs
    app = RouterApp(title="pdmesh router", summary="OpenAI-compatible API of a prefill/decode-disaggregated mesh",
                    lifespan=lifespan, redoc_url=None, openapi_url="/openapi.json" if docs else None,
                    docs_url="/docs" if docs else None)
    # --root-path, as vLLM sets it: on the app (every request's scope, the schema's server URL),
    # not uvicorn's, which would prefix every path and so only serve a proxy that strips it
    app.root_path = settings.root_path
    app.state.router = router
    generation_routes.register(app, router)

    schema_names: list[list[str]] = [[]]  # the served names the cached schema lists

    def custom_openapi() -> dict[str, Any]:
        # FastAPI's own schema, plus the request models the routes parse by hand (services/router/openapi.py);
        # built again when the LoRA adapters change (runtime updates), since `model` lists them too
        names = [router.info.name, *sorted(router.info.aliases - {router.info.name}), *router.info.adapters]
        if app.openapi_schema is None or names != schema_names[0]:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            app.openapi_schema = openapi.add_components(schema, names)
            schema_names[0] = names
        return app.openapi_schema

    app.openapi = custom_openapi  # type: ignore[method-assign]
    model_routes.register(app, router)
    service_routes.register(app, router)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            error = errors.route_not_found(request.method, request.url.path)
        elif exc.status_code == 405:
            error = errors.method_not_allowed(request.method, request.url.path)
        else:
            error = APIError(exc.status_code, str(exc.detail))
        return router.error_response(error)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        log.error("unhandled error", path=request.url.path, error=repr(exc))
        return router.error_response(APIError(500, "Internal server error.", code="internal_error"))

    app.fast_error = internal_error
    app.cors = cors(app.route_through_send, settings.allowed_origins, settings.allowed_methods,
                    settings.allowed_headers, settings.allow_credentials)
    extra_routes.register(app, router)
    responses_route.register(app, router)
    messages_route.register(app, router)
    return app
