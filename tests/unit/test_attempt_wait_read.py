"""`attempt.wait_read`: an attempt's wait for its next decode chunk, woken by the chunk itself (one
wake-up), by another future (ejection, a Prefill reply) or by the stall timer, which set the
read's future to WOKEN; a read that is a task is waited on as first_of does, never set."""

from __future__ import annotations

import asyncio

import pytest

from services.router.attempt import WOKEN, wait_read

pytestmark = pytest.mark.timeout(30)


def run(coro):
    return asyncio.run(coro)


async def waiting_on(read: asyncio.Future, others: list[asyncio.Future]) -> asyncio.Task:
    """wait_read(read, others) in a task of its own, already waiting (its timer 10 s away)."""
    waiting = asyncio.ensure_future(wait_read(read, others, asyncio.get_running_loop().time() + 10))
    await asyncio.sleep(0)
    return waiting


def test_a_chunk_wakes_the_wait_on_the_next_turn_of_the_loop():
    async def main():
        loop = asyncio.get_running_loop()
        read, other = loop.create_future(), loop.create_future()
        waiting = await waiting_on(read, [other])
        read.set_result("chunk")
        await asyncio.sleep(0)  # the waiting task wakes on this turn: no callback in between
        assert waiting.done() and read.result() == "chunk"
        assert not other._callbacks  # nothing left on the other future

    run(main())


def test_another_future_or_the_timer_wakes_it_with_woken():
    async def main():
        loop = asyncio.get_running_loop()
        read, other = loop.create_future(), loop.create_future()
        waiting = await waiting_on(read, [other])
        other.set_result(None)
        await asyncio.wait_for(waiting, 5)
        assert read.result() is WOKEN

        read = loop.create_future()
        t0 = loop.time()
        await asyncio.wait_for(wait_read(read, [loop.create_future()], t0 + 0.05), 5)
        assert read.result() is WOKEN and loop.time() >= t0 + 0.05

    run(main())


def test_another_future_already_done_returns_at_once_and_leaves_the_read_alone():
    async def main():
        loop = asyncio.get_running_loop()
        read, other = loop.create_future(), loop.create_future()
        other.set_result(None)
        await wait_read(read, [other], loop.time() + 10)
        assert not read.done()

    run(main())


def test_a_task_is_waited_on_and_never_set():
    async def main():
        loop = asyncio.get_running_loop()
        never = asyncio.ensure_future(asyncio.sleep(30))
        other = loop.create_future()
        waiting = await waiting_on(never, [other])
        other.set_result(None)
        await asyncio.wait_for(waiting, 5)
        assert not never.done()
        never.cancel()

    run(main())


def test_cancelling_the_wait_leaves_no_callback_behind():
    async def main():
        loop = asyncio.get_running_loop()
        read, other = loop.create_future(), loop.create_future()
        waiting = await waiting_on(read, [other])
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not other._callbacks
        other.set_result(None)  # a late wake-up sets nothing
        await asyncio.sleep(0)
        assert read.cancelled()  # the awaited future goes with the cancelled wait; its call keeps the chunk

    run(main())


def test_a_failed_or_cancelled_read_returns_for_the_caller_to_read():
    async def main():
        loop = asyncio.get_running_loop()
        read = loop.create_future()
        waiting = await waiting_on(read, [])
        read.set_exception(RuntimeError("the call failed"))
        await asyncio.wait_for(waiting, 5)  # returns, raises nothing
        assert isinstance(read.exception(), RuntimeError)

        read = loop.create_future()
        waiting = await waiting_on(read, [])
        read.cancel()  # the call cancelled its own read, not this task
        await asyncio.wait_for(waiting, 5)
        assert read.cancelled() and not waiting.cancelled()

    run(main())
