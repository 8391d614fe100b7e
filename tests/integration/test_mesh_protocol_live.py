"""A real worker reports its router-worker protocol versions in Load (what the router's health
probe checks), and a real router admits it: the versions of one release fit."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.generated.pdmesh.v1 import worker_pb2_grpc as wpb_grpc
from services.common.mesh_protocol import MIN_PEER_VERSION, PROTOCOL_VERSION

pytestmark = pytest.mark.integration


async def _load(addr: str, stub_class) -> wpb.LoadReply:
    async with grpc.aio.insecure_channel(addr) as channel:
        return await stub_class(channel).Load(
            wpb.LoadRequest(protocol_version=PROTOCOL_VERSION, min_protocol_version=MIN_PEER_VERSION), timeout=10)


def test_workers_report_their_versions_and_the_router_admits_them(mesh):
    (p,), (d,) = mesh.start_workers(1, 1)
    for proc, stub in ((p, wpb_grpc.PrefillStub), (d, wpb_grpc.DecodeStub)):
        reply = asyncio.run(_load(proc.grpc_addr, stub))
        assert (reply.protocol_version, reply.min_protocol_version) == (PROTOCOL_VERSION, MIN_PEER_VERSION)
    r = mesh.start_router([p], [d])
    pool = httpx.get(r.http_url + "/health", timeout=10).json()
    assert all(w["healthy"] and w["last_error"] is None for role in ("prefill", "decode")
               for w in pool[role].values()), pool
    assert "incompatible protocol version" not in r.log()
