"""What one router process knows of the router's other processes: the load view.

Admission and the worker pool read the router as a whole through one `LoadView`, chosen once
at start-up (`load_view(settings)`), so neither asks which mode it runs in:

- `LocalLoad`: the router is one process; there are no others: their admissions are 0, each
  worker's load is this process's own, nothing is published.
- `SharedLoad` (`--processes N`, N > 1): the processes' counts in one mapped file
  (services/router/shared_state.py): admission under its lock across the processes, every
  worker's in-flight count and ejections published and read every `SHARE_INTERVAL`, a heartbeat
  for the supervisor (services/router/processes.py), and one `/metrics` merged from every
  process's (services/router/sibling_metrics.py).

Pure of asyncio but for `run`, the exchange loop the pool starts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Protocol

from services.common.config import RouterSettings
from services.common.logging_setup import get_logger
from services.router.shared_state import MAX_WORKERS, PeerView, SharedState, state_path
from services.router.sibling_metrics import OwnMetrics, SiblingMetrics

log = get_logger("router.load")

SHARE_INTERVAL = 0.02  # seconds between exchanges with the router's other processes


class Counted(Protocol):
    """A worker as the view publishes it (pool.WorkerHandle)."""

    key: int
    inflight: int
    ejections: int


class MetricsView(Protocol):
    """The router's `/metrics`: this process's alone, or merged from every process's."""

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def exposition(self) -> bytes: ...


class LoadView(Protocol):
    label: str  # what the process adds to its metrics label ("" for the only one)

    # --- admission (services/router/admission.py) --------------------------------------------
    def others_active(self) -> int:
        """Choices the other processes have admitted and not finished."""
    def try_admit(self, own: int, cost: int, limit: int) -> bool:
        """Whether `cost` more choices fit the router's `limit` beside our `own`; when they do,
        they are counted for the other processes at once."""
    def set_active(self, own: int) -> None:
        """Our admitted choices changed (a lease taken or released)."""

    # --- workers (services/router/pool.py) ----------------------------------------------------
    async def run(self, exchange: Callable[[], None]) -> None:
        """Call `exchange` (the pool's `share`) as often as the view needs it; returns at once
        when there is nothing to exchange."""
    def exchange(self, workers: Iterable[Counted]) -> dict[int, PeerView]:
        """Publish our counts of `workers`; the other processes' per worker key."""
    def retire(self, worker: Counted) -> None:
        """`worker` left the pool and holds nothing of ours: leave its entry at rest."""

    def metrics(self, own: Callable[[], bytes]) -> MetricsView:
        """The router's `/metrics`, `own` being this process's exposition."""


class LocalLoad:
    """One router process: the whole router is this process."""

    label = ""

    def others_active(self) -> int:
        return 0

    def try_admit(self, own: int, cost: int, limit: int) -> bool:
        return own + cost <= limit

    def set_active(self, own: int) -> None:
        pass  # nobody else reads it

    async def run(self, exchange: Callable[[], None]) -> None:
        return  # no other process to exchange with: each worker's load is ours

    def exchange(self, workers: Iterable[Counted]) -> dict[int, PeerView]:
        return {}

    def retire(self, worker: Counted) -> None:
        pass

    def metrics(self, own: Callable[[], bytes]) -> MetricsView:
        return OwnMetrics(own)


class SharedLoad:
    """One of `--processes N`: the counts of all of them in the mapped file they share."""

    def __init__(self, state: SharedState, folder: str = ""):
        self.state = state
        self.folder = folder  # the shared folder: the state file and the metrics sockets
        self.label = f"-p{state.index}"
        self._full_logged = False

    def others_active(self) -> int:
        return self.state.peers_active()

    def try_admit(self, own: int, cost: int, limit: int) -> bool:
        # counted there at once, under the shared lock (`own` is the row's own count already)
        return self.state.try_admit(limit, cost)

    def set_active(self, own: int) -> None:
        self.state.set_active(own)  # the other processes' admission sees it at once

    async def run(self, exchange: Callable[[], None]) -> None:
        while True:  # shares at once, then every SHARE_INTERVAL: the first heartbeat says "started"
            try:
                exchange()
            except Exception as e:  # noqa: BLE001 - like the health loop, it must never die
                log.error("sharing with the router's other processes failed", error=repr(e))
            await asyncio.sleep(SHARE_INTERVAL)

    def exchange(self, workers: Iterable[Counted]) -> dict[int, PeerView]:
        state = self.state
        state.beat()  # the supervisor replaces a process whose heartbeat stops
        for w in workers:
            if not state.publish(w.key, w.inflight, w.ejections) and not self._full_logged:
                self._full_logged = True
                log.warning("too many workers to share between the router's processes", limit=MAX_WORKERS)
        return state.peers()

    def retire(self, worker: Counted) -> None:
        self.state.publish(worker.key, 0, worker.ejections)

    def metrics(self, own: Callable[[], bytes]) -> MetricsView:
        return SiblingMetrics(self.folder, self.state.processes, self.state.index, own)


LOCAL = LocalLoad()


def load_view(settings: RouterSettings) -> LoadView:
    """The view of this process: shared when a supervisor started it as one of several."""
    if settings.processes > 1 and settings.shared_dir:
        state = SharedState(state_path(settings.shared_dir), settings.processes, settings.process_index)
        state.claim()  # a replacement process starts from zero whatever its predecessor left
        return SharedLoad(state, settings.shared_dir)
    return LOCAL


