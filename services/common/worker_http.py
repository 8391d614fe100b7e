"""The HTTP side of a worker: /metrics and /health (Starlette on uvicorn), plus the event-loop
lag probe."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.common.metrics import CONTENT_TYPE, Metrics
from services.common.status_server import StatusServer, start_status_server

LAG_PROBE_INTERVAL = 0.1


def worker_app(metrics: Metrics, health: Callable[[], dict[str, Any]]) -> Starlette:
    async def metrics_route(_: Request) -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    async def health_route(_: Request) -> Response:
        body = health()
        return JSONResponse(body, status_code=200 if body.get("status") == "ok" else 503)

    return Starlette(
        routes=[
            Route("/metrics", metrics_route, methods=["GET", "HEAD"]),
            Route("/health", health_route, methods=["GET", "HEAD"]),
        ]
    )


async def serve_worker_http(
    host: str, port: int, metrics: Metrics, health: Callable[[], dict[str, Any]], supervisor=None
) -> StatusServer:
    """Serve on the running loop; under `supervisor` the server task is supervised as "http"."""
    spawn = supervisor.spawn if supervisor is not None else None
    return await start_status_server(worker_app(metrics, health), host, port, spawn)


async def probe_loop_lag(metrics: Metrics) -> None:
    """Sleep a fixed interval and record the overshoot: how late the loop ran us."""
    while True:
        start = time.monotonic()
        await asyncio.sleep(LAG_PROBE_INTERVAL)
        metrics.observe(metrics.event_loop_lag, max(0.0, time.monotonic() - start - LAG_PROBE_INTERVAL))
