"""SIGTERM ends a launching process as Ctrl-C does, so the processes it started are stopped.

The launcher starts every child in a session of its own (services/launch/proc.py), so a signal
meant for the launcher never reaches them, and nothing stops them but the launcher's own
`stop()`. Ctrl-C raises KeyboardInterrupt, and the `finally` or `with` around a launcher runs
it; SIGTERM (`timeout`, a CI job ending, `kill`) would by default end the process on the spot
and leave the children running, holding their ports. This turns SIGTERM into the same
KeyboardInterrupt, once: a second SIGTERM while stopping is ignored, so the stop runs to its
end (bounded by each process's grace; SIGKILL still ends everything at once).
"""

from __future__ import annotations

import signal
import threading


def interrupt_on_sigterm() -> None:
    """From the main thread, where SIGTERM still has its default action: make it raise
    KeyboardInterrupt. A process that handles SIGTERM itself (the mesh, a server) keeps its own."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum, frame) -> None:
    # the stop that follows must not be cut short; a handler of our own, not SIG_IGN, which
    # the processes started after it would inherit
    signal.signal(signal.SIGTERM, _ignore)
    raise KeyboardInterrupt(f"signal {signum}")


def _ignore(signum, frame) -> None:
    pass
