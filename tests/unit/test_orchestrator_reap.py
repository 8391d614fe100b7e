"""Orchestrator.reap: an attempt's Prefill call left to end in the background is bounded by the
request's deadline (the call and its task cancelled past it), its outcome retrieved when it ends
first, and nothing is bounded any more once the orchestrator closes."""

import asyncio
import gc

from services.router.orchestrator import Orchestrator


class Call:
    def __init__(self):
        self.cancelled = 0

    def cancel(self):
        self.cancelled += 1


def orchestrator() -> Orchestrator:
    return Orchestrator(pool=None, eos_ids=[])  # reap uses neither


def test_a_call_that_ends_before_the_deadline_is_left_alone_and_its_error_retrieved():
    async def main():
        o, call, loop = orchestrator(), Call(), asyncio.get_running_loop()
        errors = []
        loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        ended = loop.create_future()

        async def prefill():
            await ended
            raise RuntimeError("worker said no")

        task = asyncio.ensure_future(prefill())
        o.reap(task, call, loop.time() + 0.2)
        ended.set_result(None)
        await asyncio.sleep(0.3)  # past the deadline: nothing left to cancel
        assert task.done() and not task.cancelled() and call.cancelled == 0
        assert o._reapers == {}
        del task
        gc.collect()
        assert errors == []  # "exception was never retrieved" would be reported here

    asyncio.run(main())


def test_a_call_still_running_at_the_deadline_is_cancelled_with_its_task():
    async def main():
        o, call, loop = orchestrator(), Call(), asyncio.get_running_loop()
        task = asyncio.ensure_future(asyncio.sleep(10))
        o.reap(task, call, loop.time() + 0.05)
        await asyncio.wait((task,), timeout=2)
        assert task.cancelled() and call.cancelled == 1 and o._reapers == {}

    asyncio.run(main())


def test_closing_the_orchestrator_stops_bounding_what_it_reaps():
    async def main():
        o, call, loop = orchestrator(), Call(), asyncio.get_running_loop()
        task = asyncio.ensure_future(asyncio.sleep(0.3))
        o.reap(task, call, loop.time() + 0.05)
        await o.close()
        await task  # ran to its end: no deadline cancelled it
        assert call.cancelled == 0 and o._reapers == {}

    asyncio.run(main())
