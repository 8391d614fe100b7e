"""A timer that runs a function every `interval` seconds, traffic or not (the watchdogs' clock)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from services.common.logging_setup import get_logger

log = get_logger("periodic")


async def run_every(interval: float, fn: Callable[[], None], name: str) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            fn()
        except Exception:  # noqa: BLE001 - a failing sweep must not stop the timer
            log.exception("periodic task failed", task=name)
