"""The routes about the router itself: /health, vLLM's /load, /metrics, and emptying the
workers' prefix caches (/reset_prefix_cache, /flush_cache). vLLM's /tokenize, /detokenize, /version, /ping:
extra_routes.py."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.common.metrics import CONTENT_TYPE
from services.router.cache_reset import reset_prefix_caches
from services.router.errors import APIError


def register(app: FastAPI, router) -> None:
    """`router`: the Router (services/router/service.py)."""

    @app.post("/reset_prefix_cache")
    @app.post("/flush_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        """Empty every worker's prefix cache (services/router/cache_reset.py)."""
        try:
            router.check_auth(request)
            body = await reset_prefix_caches(router.pool)
        except APIError as e:
            return router.error_response(e)
        router.count(200)
        return JSONResponse(body)

    @app.get("/health")
    async def health() -> Response:
        # 200 while a healthy prefill + decode pair exists and the router is not draining, else 503
        ok = router.pool.has_healthy_pair() and not router.draining
        status = "draining" if router.draining else "ok" if ok else "unavailable"
        body = {"status": status, "running_requests": router.active, **router.pool.status()}
        if not ok and not router.draining:
            body["reason"] = router.pool.unavailable_reason()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/load")
    async def load() -> Response:
        # vLLM's server-load endpoint, for a load balancer in front of several routers: what this
        # process is serving now, counted as admission counts it (a request with n = 4 is 4)
        return JSONResponse({"server_load": router.active})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await router.metrics_exposition(), media_type=CONTENT_TYPE)
