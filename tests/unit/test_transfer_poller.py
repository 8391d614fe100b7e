"""ProgressPoller: polls while work is in flight, sleeps on an event otherwise (no spinning)."""

import asyncio

import pytest

from services.transfer.poller import ProgressPoller

pytestmark = pytest.mark.timeout(10)


def test_polls_while_busy_then_idles_until_kicked():
    async def main():
        busy = {"n": 3}

        def poll():
            busy["n"] = max(0, busy["n"] - 1)
            return busy["n"]

        p = ProgressPoller(poll, interval=0.0005)
        p.start()
        for _ in range(200):
            if busy["n"] == 0:
                break
            await asyncio.sleep(0.001)
        await asyncio.sleep(0)  # let the task reach its wait
        idle_polls = p.polls
        assert idle_polls == 3
        await asyncio.sleep(0.05)
        assert p.polls == idle_polls  # idle: no polling at all
        busy["n"] = 2
        p.kick()
        for _ in range(200):
            if p.polls >= idle_polls + 2:
                break
            await asyncio.sleep(0.001)
        assert p.polls == idle_polls + 2
        await p.stop()

    asyncio.run(main())


def test_poll_errors_do_not_kill_the_task():
    async def main():
        calls = {"n": 0}

        def poll():
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("boom")
            return 0

        p = ProgressPoller(poll, interval=0.0005)
        p.start()
        for _ in range(200):
            if calls["n"] >= 2:
                break
            await asyncio.sleep(0.001)
        assert p.errors == 1 and calls["n"] == 2 and not p._task.done()
        await p.stop()

    asyncio.run(main())


def test_attach_wires_wakeup():
    class M:
        wakeup = None

        def poll(self):
            return 0

    async def main():
        m = M()
        p = ProgressPoller.attach(m)
        assert m.wakeup == p.kick

    asyncio.run(main())
