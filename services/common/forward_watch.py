"""Liveness is not progress: notice a forward that runs longer than --forward-timeout.

One forward is one chunk (a 512K-token prompt is many forwards), so a forward older than the
timeout means the engine thread is stuck, not that the prompt is long. The watch runs every
watchdog interval, traffic or not. When it trips: the worker turns NOT_SERVING (the router
stops sending it work) and `on_stuck(reason)` fails the rooms of that forward. When that very
forward returns after all, the worker serves again: the engine thread is free, its pages came
back through the normal finish path, and a restart would only cost the requests that are fine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from services.common.logging_setup import get_logger
from services.common.supervision import ServingState

PROBLEM = "forward"


async def watch_forwards(
    engine, timeout: float, interval: float, state: ServingState, on_stuck: Callable[[str], None], role: str
) -> None:
    log = get_logger(role)
    stuck_seq: int | None = None  # engine.forward_seq of the forward that tripped
    while True:
        await asyncio.sleep(interval)
        seq, age = engine.forward_seq, engine.forward_age()
        if stuck_seq is not None and (age == 0 or seq != stuck_seq):
            log.warning("stuck forward returned: serving again", forward=stuck_seq)
            stuck_seq = None
            await state.clear(PROBLEM)
        if stuck_seq is None and age > timeout:
            stuck_seq = seq
            reason = f"forward running for {age:.1f}s exceeds --forward-timeout {timeout:g}s"
            log.error("stuck forward: NOT_SERVING, failing its rooms", forward=seq, age=round(age, 3), timeout=timeout)
            await state.problem(PROBLEM, reason)
            try:
                on_stuck(reason)
            except Exception:  # noqa: BLE001 - health already says NOT_SERVING; keep watching
                log.exception("on_stuck_forward failed")
