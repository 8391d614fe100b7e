"""The sigstop_after_*attach faults fire even when the KV (and so the whole reply) could land
before decode handles the Attach reply: a cached prompt needs almost no prefill, and on a busy
box the KV notification can overtake the reply. A fault that checked only the reply let that
request finish with the fault never fired, and the chaos test that relies on it failed."""

from __future__ import annotations

import asyncio

import pytest

from services.common.faults import Faults
from services.common.metrics import Metrics
from services.decode import admission as admission_module
from services.decode.jobs import Phase
from services.decode.worker import DecodeWorker
from services.transfer.receiver import KVReceiver
from tests.unit.prefix_cache_engine import empty_cache_then_whole_pool, random_engine_with_prefix_cache
from tests.unit.test_decode_prefix_cache import GREEDY, NEXT, PREFILL, PROMPT, FakeCoordinator, P, arrive
from tests.unit.test_transfer_managers import FakeAgent


class HeldReplyCoordinator(FakeCoordinator):
    """Holds every Attach reply until the test lets it go."""

    def __init__(self, receiver):
        super().__init__(receiver)
        self.reply = asyncio.Event()

    async def attach(self, room, address, dst_pages, skip_pages=0, held_pages=()):
        await super().attach(room, address, dst_pages, skip_pages, held_pages)
        await self.reply.wait()
        return True


@pytest.fixture(scope="module")
def engine():
    return random_engine_with_prefix_cache(32, P)


@pytest.fixture
def freezes(monkeypatch):
    """The SIGSTOPs the worker sends itself, recorded instead of sent."""
    sent: list[int] = []
    monkeypatch.setattr(admission_module.os, "kill", lambda pid, sig: sent.append(sig))
    return sent


def worker_with(engine, faults: Faults) -> DecodeWorker:
    receiver = KVReceiver(FakeAgent("D1", 10, 0, 100_000), engine.pool)
    return DecodeWorker(engine, receiver, HeldReplyCoordinator(receiver), Metrics("decode", "m", "w"), faults, 8,
                        quarantine_retry=0.01)


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_the_kv_arriving_before_the_attach_reply_still_freezes_once(engine, freezes):
    async def go():
        with empty_cache_then_whole_pool(engine):
            w = worker_with(engine, Faults(sigstop_after_attach=True))
            job = w.submit(1, list(PROMPT), GREEDY, PREFILL)
            w.admission.admit()
            await settle()
            assert job.phase is Phase.ATTACHING and freezes == []
            arrive(w, job)  # the KV overtakes the reply
            assert len(freezes) == 1 and job.phase is Phase.RUNNING
            w.coordinator.reply.set()
            await settle()
            assert len(freezes) == 1  # once, not again when the reply is handled
            w.abort(1, "done")
            await settle()

    asyncio.run(go())


def test_the_held_fault_waits_for_an_attach_that_offers_held_pages(engine, freezes):
    async def go():
        with empty_cache_then_whole_pool(engine):
            w = worker_with(engine, Faults(sigstop_after_held_attach=True))
            w.coordinator.reply.set()
            first = w.submit(1, list(PROMPT), GREEDY, PREFILL)
            w.admission.admit()
            await settle()
            arrive(w, first)
            w.emit(first, 6, -0.1)
            w.abort(1, "done")  # its full pages stay cached
            await settle()
            assert freezes == []  # nothing was offered: no freeze
            w.coordinator.reply.clear()
            second = w.submit(2, list(NEXT), GREEDY, PREFILL)
            w.admission.admit()
            await settle()
            assert second.offered_pages == 2 and freezes == []
            arrive(w, second, cached_tokens=32)
            assert len(freezes) == 1
            w.coordinator.reply.set()
            await settle()
            assert len(freezes) == 1
            w.abort(2, "done")
            await settle()

    asyncio.run(go())
