"""The router-worker protocol version: exchanged in every health probe (Load), checked on both
sides. A worker whose version does not fit is ejected at once with one clear log line, and
admitted again once it fits; compatible skew is accepted. Real gRPC with fake workers."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.mesh_protocol import MIN_PEER_VERSION, PROTOCOL_VERSION, incompatibility
from services.fakes.workers import FakeDecode, FakePrefill
from services.router.pool import WorkerPool


def test_compatibility_rule():
    assert incompatibility("w", PROTOCOL_VERSION, MIN_PEER_VERSION) == ""
    assert incompatibility("w", 0, 0) == ""  # a release from before the versions speaks version 1
    assert incompatibility("w", 2, 1, version=1, min_version=0) == ""  # a newer peer that still serves us
    older = incompatibility("w", 1, 0, version=3, min_version=2)
    assert "older than this side's minimum 2" in older and "version 1" in older
    newer = incompatibility("w", 4, 3, version=2, min_version=1)
    assert "needs router-worker protocol version 3" in newer and "speaks 2" in newer


async def _pool(prefill, decode) -> WorkerPool:
    pool = WorkerPool([prefill.addr], [decode.addr], interval=30, timeout=1, failure_threshold=3)
    await pool.refresh_addresses()
    await pool.probe_all()
    return pool


@contextlib.asynccontextmanager
async def _probed_pool(prefill, decode):
    """The fake workers serving, and a router pool that has probed them once; all stopped after."""
    await prefill.start()
    await decode.start()
    pool = await _pool(prefill, decode)
    try:
        yield pool
    finally:
        await pool.close()
        await prefill.stop()
        await decode.stop()


class _Log:
    """Records the pool's log calls (whatever another test did to the logging configuration)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __getattr__(self, level):
        return lambda event, **kw: self.lines.append(f"{level} {event} {kw}")


def test_a_worker_with_an_incompatible_version_is_ejected_with_a_clear_line(monkeypatch):
    from services.router import pool as pool_module

    recorded = _Log()
    monkeypatch.setattr(pool_module, "log", recorded)
    asyncio.run(_incompatible_worker_is_ejected())
    lines = [line for line in recorded.lines if "incompatible protocol version" in line]
    assert len(lines) == 1, lines  # said once, not at every probe
    assert "needs router-worker protocol version" in lines[0] and "decode" in lines[0]


async def _incompatible_worker_is_ejected():
    prefill, decode = FakePrefill(), FakeDecode()
    async with _probed_pool(prefill, decode) as pool:
        assert all(w.healthy for w in pool.workers)
        (d,) = pool.decodes
        # the probe tells the worker this router's versions
        assert decode.load_requests[-1].protocol_version == PROTOCOL_VERSION
        assert decode.load_requests[-1].min_protocol_version == MIN_PEER_VERSION
        # a decode replaced by a release that dropped this router's version: out at the first probe
        decode.min_protocol_version = PROTOCOL_VERSION + 1
        decode.protocol_version = PROTOCOL_VERSION + 1
        assert not await pool.probe(d)
        assert not d.healthy and "needs router-worker protocol version" in d.last_error
        assert not await pool.probe(d)  # still out, the log line not repeated
        assert pool.status()["decode"][d.addr]["last_error"] == d.last_error
        # one release newer that still speaks ours: fine
        decode.min_protocol_version = MIN_PEER_VERSION
        assert await pool.probe(d) and d.healthy


def test_worker_refuses_a_router_below_its_minimum():
    """The workers' side of the check (their servicers call it): FAILED_PRECONDITION, which the
    router's pool turns into an ejection naming the reason."""
    asyncio.run(_worker_refuses())


class _RefusingDecode(FakeDecode):
    async def Load(self, request, context):  # noqa: N802 - as services/common/worker_servicer.py checks
        problem = incompatibility("the router", request.protocol_version, request.min_protocol_version,
                                  version=PROTOCOL_VERSION + 1, min_version=PROTOCOL_VERSION + 1)
        if problem:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        return wpb.LoadReply()


async def _worker_refuses():
    prefill, decode = FakePrefill(), _RefusingDecode()
    async with _probed_pool(prefill, decode) as pool:
        (d,) = pool.decodes
        assert not d.healthy
        assert "refuses this router" in d.last_error and "older than this side's minimum" in d.last_error
