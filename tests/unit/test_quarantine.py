"""Decode's quarantine (services/decode/quarantine.py) against a fake coordinator: pages come
back only when prefill says quiesced, or is really gone, or the bound passes."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.decode.quarantine import Quarantine
from services.transfer.bootstrap import AbortResult, BootstrapCallError

pytestmark = pytest.mark.timeout(10)


class FakeClient:
    def __init__(self, replies):
        self.replies = list(replies)  # AbortResult or an exception per call; the last repeats
        self.calls = 0

    async def abort(self, room, reason, agent_name="", timeout=None):
        self.calls += 1
        r = self.replies[min(self.calls, len(self.replies)) - 1]
        if isinstance(r, Exception):
            raise r
        return r


class FakeCoordinator:
    heartbeat_max_failures = 3
    heartbeat_interval = 0.05
    rpc_timeout = 1.0

    def __init__(self, client):
        self._client = client
        self.generation = 0
        self.receiver = type("R", (), {"agent_name": "decode-agent"})()

    def client(self, addr):
        return self._client

    def prefill_generation(self, addr):
        return self.generation


class FakeAllocator:
    def __init__(self):
        self.freed: list[tuple[list[int], int]] = []

    def free(self, pages, owner):
        self.freed.append((pages, owner))


UNAVAILABLE = BootstrapCallError("p:1", "Abort", grpc.StatusCode.UNAVAILABLE, "unavailable", "down")
NOT_QUIESCED, QUIESCED = AbortResult(True, False), AbortResult(True, True)


def make(replies, max_wait=5.0, unreachable_hold=0.0):
    client = FakeClient(replies)
    coord = FakeCoordinator(client)
    alloc = FakeAllocator()
    freed = []
    q = Quarantine(coord, alloc, lambda: freed.append(1), max_wait=max_wait, retry=0.01,
                   unreachable_hold=unreachable_hold)
    return q, coord, client, alloc, freed


async def settle(q, timeout=3.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while q.held and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.005)


def test_released_only_once_prefill_is_quiesced():
    async def run():
        q, _, client, alloc, freed = make([NOT_QUIESCED, NOT_QUIESCED, QUIESCED])
        q.hold(7, "p:1", [1, 2, 3])
        assert q.pages_held() == 3 and q
        await settle(q)
        assert client.calls == 3 and alloc.freed == [([1, 2, 3], 7)] and freed == [1]
        assert q.pages_held() == 0 and q.released == {"quiesced": 1}

    asyncio.run(run())


def test_one_unavailable_is_not_gone_but_the_threshold_is():
    async def run():
        # a graceful shutdown / reconnect answers UNAVAILABLE once, then the prefill is back
        q, _, client, alloc, _ = make([UNAVAILABLE, NOT_QUIESCED, UNAVAILABLE, QUIESCED])
        q.hold(1, "p:1", [4])
        await settle(q)
        assert client.calls == 4 and q.released == {"quiesced": 1}
        # really unreachable: heartbeat_max_failures failures in a row
        q, _, client, alloc, _ = make([UNAVAILABLE])
        q.hold(2, "p:1", [5])
        await settle(q)
        assert client.calls == 3 and q.released == {"gone": 1} and alloc.freed == [([5], 2)]

    asyncio.run(run())


def test_new_prefill_generation_releases():
    async def run():
        q, coord, client, alloc, _ = make([NOT_QUIESCED])
        q.hold(3, "p:1", [6, 7])
        await asyncio.sleep(0.05)
        assert q.pages_held() == 2 and not alloc.freed  # prefill answers, still writing
        coord.generation += 1  # the coordinator saw a restart (new epoch) or declared it dead
        await settle(q)
        assert q.released == {"gone": 1} and alloc.freed == [([6, 7], 3)]

    asyncio.run(run())


def test_bound_releases_with_a_warning_and_close_stops_retrying():
    async def run():
        q, _, _, alloc, _ = make([NOT_QUIESCED], max_wait=0.1)
        q.hold(4, "p:1", [8])
        await settle(q)
        assert q.released == {"bound": 1} and alloc.freed == [([8], 4)]
        q, _, _, alloc, _ = make([NOT_QUIESCED], max_wait=60)
        q.hold(5, "p:1", [9])
        await asyncio.sleep(0.03)
        await q.close()
        assert q.pages_held() == 1 and not alloc.freed

    asyncio.run(run())


TIMED_OUT = BootstrapCallError("p:1", "Abort", grpc.StatusCode.DEADLINE_EXCEEDED, "rpc-error", "Deadline Exceeded")
REFUSED = BootstrapCallError("p:1", "Abort", grpc.StatusCode.UNAVAILABLE, "unavailable",
                             "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Connection refused")


def test_a_prefill_that_does_not_answer_keeps_its_pages_for_the_unreachable_hold():
    # no answer at all may be a partition: prefill's WRITE may still be queued in its kernel
    async def run():
        q, _, client, alloc, _ = make([TIMED_OUT], unreachable_hold=0.3)
        t0 = asyncio.get_running_loop().time()
        q.hold(5, "p:1", [4])
        await settle(q)
        assert alloc.freed == [([4], 5)] and q.released == {"gone": 1}
        assert asyncio.get_running_loop().time() - t0 >= 0.3 and client.calls > 3

    asyncio.run(run())


def test_a_refused_connection_releases_without_the_hold():
    # the host answered and nothing listens: the process is gone, nothing more can arrive
    async def run():
        q, _, client, alloc, _ = make([REFUSED], unreachable_hold=5.0)
        q.hold(6, "p:1", [8, 9])
        await settle(q, timeout=2.0)
        assert alloc.freed == [([8, 9], 6)] and q.released == {"gone": 1} and client.calls == 3

    asyncio.run(run())
