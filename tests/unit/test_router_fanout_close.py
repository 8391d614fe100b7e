"""FanIn.close when the caller is cancelled while a choice is being closed (its client left as
that choice ended): every choice is still closed, and the cancellation reaches the caller."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from services.router.fanout import FanIn, Single

pytestmark = pytest.mark.timeout(10)


@dataclass
class Chunk:
    token_ids: list[int] = field(default_factory=lambda: [1])


class Choice:
    """An endless choice whose close cancels its calls at once (as Attempt.close does), then
    awaits a moment more (what else the end of a stream awaits)."""

    def __init__(self) -> None:
        self.closing = asyncio.Event()
        self.closed = False

    async def gen(self):
        try:
            while True:
                yield Chunk()
                await asyncio.sleep(0.01)
        finally:
            self.closed = True
            self.closing.set()
            await asyncio.sleep(0.2)


def test_a_cancel_while_one_choice_closes_closes_them_all_and_is_raised():
    async def scenario() -> None:
        choices = [Choice() for _ in range(3)]
        fan = FanIn([c.gen() for c in choices])
        await fan.next()

        async def reader() -> None:
            await fan.close(0)  # a stop string ended choice 0
            while True:  # ... and the reader would go on with the others
                await fan.next()

        task = asyncio.ensure_future(reader())
        await choices[0].closing.wait()
        task.cancel()  # the client disconnects while choice 0 closes
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 2)
        assert choices[0].closed
        await fan.close()  # what the request's end does next: the others close too
        assert all(c.closed for c in choices)

    asyncio.run(scenario())


def test_a_close_of_all_choices_finishes_every_one_before_raising_the_cancel():
    async def scenario() -> None:
        choices = [Choice() for _ in range(3)]
        fan = FanIn([c.gen() for c in choices])
        await fan.next()
        task = asyncio.ensure_future(fan.close())
        await choices[0].closing.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 2)
        assert all(c.closed for c in choices)

    asyncio.run(scenario())


def test_single_raises_the_callers_cancel_too():
    async def scenario() -> None:
        choice = Choice()
        single = Single(choice.gen())
        await single.next()
        task = asyncio.ensure_future(single.close())
        await choice.closing.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 2)
        assert choice.closed

    asyncio.run(scenario())


def test_a_stream_too_far_behind_overflows_once():
    async def scenario() -> None:
        choices = [Choice() for _ in range(2)]
        fan = FanIn([c.gen() for c in choices], max_buffered=10)
        overflowed = []
        fan.on_overflow = lambda: overflowed.append(fan.buffered)
        while not overflowed:  # nobody reads: the chunks pile up
            await asyncio.sleep(0.01)
        assert overflowed == [11]
        while fan.next_nowait() is not None:
            pass
        assert fan.buffered == 0
        await fan.close()
        assert overflowed == [11] and all(c.closed for c in choices)

    asyncio.run(scenario())
