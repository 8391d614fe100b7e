"""POST /reset_prefix_cache (vLLM's name) and /flush_cache (SGLang's): every worker forgets its
prefix cache, through one ResetPrefixCache RPC per worker, all at once, each bounded.

Benchmarks call it between runs so that a run starts cold. Every worker the router knows is
asked, ejected ones too (an ejected worker may only be unreachable from here, its cache warm);
the answer lists each worker's outcome and is a 503 when any did not answer, since then some
cache may still be warm. Requests running meanwhile keep their pages (the workers drop only the
cache's hold on them) and finish unchanged.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from services.router.errors import APIError
from services.router.pool import WorkerHandle, WorkerPool

RESET_TIMEOUT_S = 5.0


async def _reset_one(w: WorkerHandle, timeout: float) -> dict[str, Any]:
    out: dict[str, Any] = {"worker": repr(w)}
    try:
        reply = await w.transport.reset_prefix_cache(timeout)
    except grpc.aio.AioRpcError as e:
        return {**out, "ok": False, "error": f"{e.code().name}: {e.details() or ''}"}
    except Exception as e:  # noqa: BLE001 - a worker without a channel yet, or one mid-close
        return {**out, "ok": False, "error": repr(e)}
    return {**out, "ok": True, "prefix_cache": reply.enabled, "pages_dropped": reply.pages_dropped}


async def reset_prefix_caches(pool: WorkerPool, timeout: float = RESET_TIMEOUT_S) -> dict[str, Any]:
    """Reset every worker's cache; raises APIError(503) naming the workers that did not answer.
    The router's own view of the caches (services/router/prefix_index.py) empties first, so no
    request is steered by a cache that is going away."""
    dropped = pool.index.clear()
    results = await asyncio.gather(*(_reset_one(w, timeout) for w in pool.workers if w.transport is not None))
    failed = [r for r in results if not r["ok"]]
    if failed:
        names = ", ".join(f"{r['worker']} ({r['error']})" for r in failed)
        raise APIError(503, f"prefix cache not reset on {len(failed)} of {len(results)} workers: {names}",
                       code="prefix_cache_reset_failed")
    return {"object": "prefix_cache_reset", "workers": results, "router_index_pages_dropped": dropped}
