"""Choosing a pair while the pool changes under an await, against scripted gRPC workers.

A request that finds no healthy decode probes the decodes (an await); a prefill ejected meanwhile
leaves the prefill group empty when the pair is chosen: a 503, as for any request with no
healthy prefill, never a division by zero in the policy.
"""

from __future__ import annotations

import asyncio

import pytest
from grpc_health.v1 import health_pb2

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.mesh_protocol import MIN_PEER_VERSION, PROTOCOL_VERSION
from services.fakes.workers import FakeDecode, FakePrefill
from services.router.errors import APIError
from services.router.pool import WorkerHandle, WorkerPool

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "power_of_two"])
def test_a_group_that_empties_while_another_is_probed_is_a_503(policy):
    async def scenario() -> None:
        p, d = FakePrefill(), FakeDecode()
        await p.start()
        await d.start()
        pool = WorkerPool([p.addr], [d.addr], policy=policy, timeout=2.0, lane=False)
        try:
            await pool.refresh_addresses()
            await pool.probe_all()
            prefill, decode = pool.prefills[0], pool.decodes[0]
            assert prefill.healthy and decode.healthy
            decode.healthy = False  # ejected a moment ago; it serves again, so the probe re-admits it

            while pool._probing:  # the start's probes are done and forgotten
                await asyncio.sleep(0)
            choosing = asyncio.ensure_future(pool.choose_pair())
            while decode not in pool._probing:  # the request is probing the decodes now
                await asyncio.sleep(0)
            pool._mark(prefill, False, "ejected while the decodes were probed")
            with pytest.raises(APIError) as refused:
                await choosing
            assert refused.value.status == 503 and refused.value.code == "no_healthy_workers"
            assert decode.healthy and decode.inflight == 0 and prefill.inflight == 0
        finally:
            await pool.close()
            await p.stop()
            await d.stop()

    asyncio.run(scenario())


class _ScriptedHealth:
    """A worker transport whose health answers come from a script, the first held until released."""

    def __init__(self, answers: list[int]):
        self.answers, self.calls, self.release = list(answers), 0, asyncio.Event()

    async def health(self, timeout: float):
        self.calls += 1
        status = self.answers.pop(0)
        if self.calls == 1:
            await self.release.wait()  # answered (NOT_SERVING) before the worker came back, delivered late
        return health_pb2.HealthCheckResponse(status=status)

    async def load(self, request, timeout: float):
        return wpb.LoadReply(protocol_version=PROTOCOL_VERSION, min_protocol_version=MIN_PEER_VERSION)


def test_a_fresh_probe_does_not_take_the_answer_of_a_probe_begun_before_it():
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

    async def scenario() -> tuple[bool, bool, int]:
        pool = WorkerPool([], [], lane=False)
        w = WorkerHandle("decode", "d:1")
        w.transport = _ScriptedHealth([not_serving, serving])
        pool.decodes = [w]
        periodic = asyncio.ensure_future(pool.probe(w))  # the health loop's probe, in flight
        await asyncio.sleep(0)
        shared = asyncio.ensure_future(pool.probe(w))  # joins it, and takes its answer
        fresh = asyncio.ensure_future(pool.probe(w, fresh=True))  # a request that found no healthy decode
        await asyncio.sleep(0)
        w.transport.release.set()
        return await shared, await fresh, w.transport.calls, await periodic

    shared, fresh, calls, periodic = asyncio.run(scenario())
    assert (periodic, shared) == (False, False) and fresh and calls == 2
