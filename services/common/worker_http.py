"""The HTTP side of a worker: /metrics and /health, plus the event-loop lag probe."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from services.common.metrics import CONTENT_TYPE, Metrics
from services.common.status_server import start_status_server

LAG_PROBE_INTERVAL = 0.1


async def serve_worker_http(
    host: str, port: int, metrics: Metrics, health: Callable[[], dict[str, Any]]
) -> asyncio.Server:
    async def metrics_route():
        return 200, CONTENT_TYPE, metrics.exposition()

    async def health_route():
        body = health()
        status = 200 if body.get("status") == "ok" else 503
        return status, "application/json", json.dumps(body).encode()

    return await start_status_server(host, port, {"/metrics": metrics_route, "/health": health_route})


async def probe_loop_lag(metrics: Metrics) -> None:
    """Sleep a fixed interval and record the overshoot: how late the loop ran us."""
    while True:
        start = time.monotonic()
        await asyncio.sleep(LAG_PROBE_INTERVAL)
        metrics.observe(metrics.event_loop_lag, max(0.0, time.monotonic() - start - LAG_PROBE_INTERVAL))
