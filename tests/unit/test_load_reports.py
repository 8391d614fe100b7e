"""Load reports count only live requests, so the router's choice never weighs phantom load.

- Decode: a finished job whose pages still wait for a forward (or an attach) to let go is not
  queued load: its request is over.
- Router: a request of ours that ends while a Load call is out is not someone else's: the
  worker counted it, and set against our count at the reply it would read as another router's
  request until the next report (a second long). That phantom sent several new conversations
  in a row to the other decode.
"""

from __future__ import annotations

import asyncio

import pytest

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.mesh_protocol import MIN_PEER_VERSION, PROTOCOL_VERSION
from services.decode.jobs import Phase
from services.router.pool import WorkerHandle, WorkerPool, load_of
from tests.unit.test_decode_prefix_cache import GREEDY, PREFILL, PROMPT, engine, worker  # noqa: F401 - fixtures

pytestmark = pytest.mark.timeout(30)


def test_a_finished_job_held_by_a_forward_is_not_load(worker):  # noqa: F811 - the fixture
    async def scenario():
        job = worker.submit(1, list(PROMPT), GREEDY, PREFILL)
        other = worker.submit(2, list(PROMPT), GREEDY, PREFILL)
        assert worker.load() == (2, 0)
        worker.scheduler.in_forward = [job]  # a forward still uses its pages: the release waits
        worker.finish(job)
        assert job.phase is Phase.FINISHED and job.room in worker.jobs
        assert worker.load() == (1, 0)  # only the other
        worker.scheduler.in_forward = []
        worker.finish(other)
        worker.release(job)
        assert worker.load() == (0, 0)

    asyncio.run(scenario())


class _LoadDuring:
    """A worker transport whose Load reply is made while one of ours runs there, and delivered
    after something else happened (`during`, run between the worker's count and the reply)."""

    def __init__(self, queued: int, running: int, during):
        self.queued, self.running, self.during = queued, running, during

    async def load(self, request, timeout: float):
        reply = wpb.LoadReply(queued=self.queued, running=self.running, protocol_version=PROTOCOL_VERSION,
                              min_protocol_version=MIN_PEER_VERSION)
        self.during()
        await asyncio.sleep(0)
        return reply


def _pool_with(w: WorkerHandle) -> WorkerPool:
    pool = WorkerPool([], [], lane=False)
    pool.decodes = [w]
    return pool


def test_our_request_ending_while_the_load_reply_is_on_its_way_is_not_external_load():
    async def scenario() -> int:
        w = WorkerHandle("decode", "d:1")
        pool = _pool_with(w)
        lease = pool.reserve(w)  # ours, running on the worker when it counts
        w.transport = _LoadDuring(0, 1, lease.release)  # ends before the reply is read
        await pool._read_load(w)
        return w.external_load, load_of(w)

    assert asyncio.run(scenario()) == (0, 0)


def test_a_request_of_ours_begun_during_the_call_is_not_external_either_and_others_still_count():
    async def scenario() -> list[tuple[int, int]]:
        w = WorkerHandle("decode", "d:1")
        pool = _pool_with(w)
        leases = []
        # the worker counted 3: ours (begun while the call was out) and two of another router's
        w.transport = _LoadDuring(1, 2, lambda: leases.append(pool.reserve(w)))
        await pool._read_load(w)
        seen = [(w.external_load, load_of(w))]
        leases[0].release()
        # the next report: the other router's two only, ours over
        w.transport = _LoadDuring(0, 2, lambda: None)
        await pool._read_load(w)
        seen.append((w.external_load, load_of(w)))
        return seen

    assert asyncio.run(scenario()) == [(2, 3), (2, 2)]
