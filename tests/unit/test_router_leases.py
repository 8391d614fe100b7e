"""Reservations release exactly once, on every path that ends a request.

The Lease itself (double release is a no-op, the context manager), then each end path through
the real router app against scripted gRPC workers (services/fakes/workers.py): success, client
disconnect, fail-over, migration and error. After each, no admission slot and no worker
in-flight count is left outstanding, and the ledgers show every lease taken was released.
"""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from services.fakes.workers import Behaviour
from services.router.leases import Lease, Ledger, PairLease
from services.router.pool import WorkerHandle, WorkerPool
from tests.unit.test_router_app import (  # noqa: F401 - cluster_factory is a fixture
    Cluster,
    cluster_factory,
    completion,
    post,
    sse_payloads,
    wait_for,
)

pytestmark = pytest.mark.timeout(60)


def test_a_lease_releases_once_and_a_second_release_is_a_no_op():
    count, ledger = [0], Ledger()

    def adjust(delta: int) -> None:
        count[0] += delta

    lease = Lease(adjust, 3, ledger)
    assert count == [3] and ledger.outstanding == 3 and not lease.released
    assert lease.release() is True
    assert count == [0] and ledger.outstanding == 0 and lease.released
    assert lease.release() is False  # the second path that ends the request finds nothing to free
    assert count == [0] and (ledger.taken, ledger.released) == (3, 3)
    with Lease(adjust, 1, ledger) as held:
        assert count == [1]
    assert count == [0] and held.released and ledger.outstanding == 0


def test_a_lease_released_inside_its_with_block_is_not_released_again():
    count = [0]
    with Lease(lambda d: count.__setitem__(0, count[0] + d)) as lease:
        lease.release()
        assert count == [0]
    assert count == [0]


def test_pool_reserve_and_pair_lease_count_each_worker_once():
    pool = WorkerPool([], [], lane=False)
    p, d = WorkerHandle("prefill", "p:1", healthy=True), WorkerHandle("decode", "d:1", healthy=True)
    pair = PairLease(p, d, pool.reserve(p), pool.reserve(d))
    assert (p.inflight, d.inflight, pool.leases.outstanding) == (1, 1, 2)
    pair.release_prefill()  # the Prefill RPC ended
    pair.release_prefill()
    assert (p.inflight, d.inflight) == (0, 1)
    pair.release()  # the request ends: only decode's is still held
    pair.release()
    assert (p.inflight, d.inflight, pool.leases.outstanding) == (0, 0, 0)


def test_choose_pair_hands_out_a_lease():
    async def run() -> None:
        pool = WorkerPool([], [], lane=False)
        pool.prefills = [WorkerHandle("prefill", "p:1", healthy=True)]
        pool.decodes = [WorkerHandle("decode", "d:1", healthy=True)]
        pair = await pool.choose_pair()
        prefill, decode = pair
        assert (prefill.inflight, decode.inflight, pool.leases.outstanding) == (1, 1, 2)
        pair.release()
        pair.release()
        assert (prefill.inflight, decode.inflight, pool.leases.outstanding) == (0, 0, 0)

    asyncio.run(run())


# --- every end path of a request, through the router --------------------------------------------


def settled(c: Cluster, attempts: int, admitted: int) -> None:
    """Nothing outstanding, and the ledgers saw the expected leases taken (and all released)."""
    c.all_rpcs_ended()  # includes both ledgers' outstanding == 0
    r = c.router
    assert r.admission.ledger.taken == r.admission.ledger.released == admitted
    # one lease per worker of each attempt's pair: prefill + decode
    assert r.pool.leases.taken == r.pool.leases.released == 2 * attempts


def test_success_releases_each_lease_once(cluster_factory):  # noqa: F811
    c = cluster_factory()
    assert post(c, "/v1/completions", completion()).status_code == 200
    r = post(c, "/v1/completions", completion(stream=True, n=2))
    assert r.status_code == 200 and sse_payloads(r.text)
    settled(c, attempts=3, admitted=3)  # 1 + 2 choices, each its own attempt


def test_client_disconnect_releases_each_lease_once(cluster_factory):  # noqa: F811
    c = cluster_factory()
    c.decodes[0].behaviour = Behaviour(token_delay=0.05)
    c.prefills[0].behaviour = Behaviour(mode="hang")  # prefill's lease is held until its RPC is cancelled
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", c.url + "/v1/completions", json=completion(stream=True, max_tokens=1000)) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            wait_for(lambda: c.router.pool.leases.outstanding == 2, what="both leases held mid-stream")
    settled(c, attempts=1, admitted=1)


def test_fail_over_releases_the_failed_pairs_leases(cluster_factory):  # noqa: F811
    c = cluster_factory(n_prefill=2, n_decode=2)
    c.decodes[0].behaviour = Behaviour(mode="fail", code=grpc.StatusCode.INTERNAL)
    c.prefills[0].behaviour = Behaviour(delay=5)  # still computing when decode fails: cancelled
    assert post(c, "/v1/completions", completion()).status_code == 200
    settled(c, attempts=2, admitted=1)


def test_migration_releases_the_first_pairs_leases(cluster_factory):  # noqa: F811
    c = cluster_factory(n_decode=2)
    for d in c.decodes:
        d.positional = True
    c.decodes[0].behaviour = Behaviour(mode="fail_after", after=3, code=grpc.StatusCode.UNAVAILABLE)
    r = post(c, "/v1/completions", completion(stream=True, max_tokens=8))
    assert r.status_code == 200 and not any("error" in e for e in sse_payloads(r.text))
    settled(c, attempts=2, admitted=1)


def test_errors_release_each_lease_once(cluster_factory):  # noqa: F811
    c = cluster_factory(request_timeout=2.0)  # room for the 400 on a loaded machine; the hang then ends at the deadline
    c.decodes[0].behaviour = Behaviour(mode="fail", code=grpc.StatusCode.INVALID_ARGUMENT, times=1)
    assert post(c, "/v1/completions", completion()).status_code == 400  # refused: no retry
    c.decodes[0].behaviour = Behaviour(mode="hang")
    assert post(c, "/v1/completions", completion()).status_code == 504  # the deadline
    settled(c, attempts=2, admitted=2)


def test_the_canary_releases_its_pairs_leases_whether_it_passes_or_fails():
    from services.fakes.workers import FakeDecode, FakePrefill
    from services.router.canary import Canary
    from services.router.orchestrator import Orchestrator

    async def run() -> None:
        p, d = FakePrefill(), FakeDecode()
        await p.start()
        await d.start()
        pool = WorkerPool([p.addr], [d.addr], timeout=2.0)
        orchestrator = Orchestrator(pool, [])
        try:
            await pool.refresh_addresses()
            await pool.probe_all()
            prefill, decode = pool.prefills[0], pool.decodes[0]
            canary = Canary(pool, orchestrator.reap, [1, 2, 3], interval=0.0, timeout=2.0)
            assert await canary.probe(prefill, decode)
            d.behaviour = Behaviour(mode="fail", code=grpc.StatusCode.INTERNAL)
            assert not await canary.probe(prefill, decode)
            for _ in range(200):  # the Prefill RPC of the failed one ends (cancelled) a moment later
                if pool.leases.outstanding == 0:
                    break
                await asyncio.sleep(0.01)
            assert pool.leases.outstanding == 0 and pool.leases.taken == 4
            assert prefill.inflight == decode.inflight == 0
        finally:
            await orchestrator.close()
            await pool.close()
            await p.stop()
            await d.stop()

    asyncio.run(run())


def test_colocated_requests_hold_one_lease_per_attempt(cluster_factory):  # noqa: F811
    c = cluster_factory(n_prefill=0, mode="colocated")
    assert post(c, "/v1/completions", completion()).status_code == 200
    c.all_rpcs_ended()
    assert c.router.pool.leases.taken == c.router.pool.leases.released == 1  # decode's only: no prefill
