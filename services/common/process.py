"""Process plumbing shared by the services: stop signals and the worker identity."""

from __future__ import annotations

import asyncio
import signal
import socket


def install_stop_signals() -> asyncio.Event:
    """An event set on SIGTERM/SIGINT, so the service shuts down gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def default_worker_id(role: str, port: int) -> str:
    return f"{role}-{socket.gethostname()}-{port}"
