"""Choosing a pair while the pool changes under an await, against scripted gRPC workers.

A request that finds no healthy decode probes the decodes (an await); a prefill ejected meanwhile
leaves the prefill group empty when the pair is chosen: a 503, as for any request with no
healthy prefill, never a division by zero in the policy.
"""

from __future__ import annotations

import asyncio

import pytest

from services.fakes.workers import FakeDecode, FakePrefill
from services.router.errors import APIError
from services.router.pool import WorkerPool

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
