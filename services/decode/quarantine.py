"""Decode's quarantine of KV pages that prefill may still WRITE into.

Once decode has sent a room's page ids in Attach, prefill may write into those pages until it
lets go of the room. A room that fails before its KV arrived therefore does not return its
pages at once: they are held here and released only when

  1. prefill answers the room's Abort with `quiesced` (no live or deferred NIXL transfer on
     prefill references the room any more), or
  2. prefill is really gone: the coordinator saw it restart (a new epoch) or declared it dead
     (heartbeat_max_failures heartbeats in a row), or this quarantine's own Abort retries failed
     that many times in a row — never on one UNAVAILABLE, which a prefill in graceful shutdown
     or a reconnecting channel returns too — and, unless its host refused the connection (the
     process is gone), at least `unreachable_hold` seconds (the transfer's TCP user timeout +
     1 s) have passed, since a prefill that does not answer at all may only be partitioned away
     with its WRITE still queued, or
  3. `max_wait` has passed (a frozen prefill that never answers): the pages are released with
     a warning, because holding them forever would shrink the pool for good. This is the only
     release that is not proven safe; it is logged as such.

Pure asyncio, no torch and no nixl: unit-tested with a fake coordinator and allocator.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.common.logging_setup import bound_room, get_logger
from services.transfer.bootstrap import BootstrapCallError
from services.transfer.wire_format import ProtocolMismatch

log = get_logger("decode.quarantine")

ABORT_REASON = "decode released the room"


@dataclass
class _Held:
    prefill_addr: str
    pages: list[int]
    since: float


class Quarantine:
    def __init__(
        self,
        coordinator,
        allocator,
        on_freed: Callable[[], None],
        max_wait: float,
        retry: float,
        clock: Callable[[], float] = time.monotonic,
        unreachable_hold: float = 0.0,
    ):
        """coordinator: KVReceiveCoordinator (client(addr).abort, prefill_generation(addr),
        heartbeat_max_failures, receiver.agent_name); allocator: the KV pool's PageAllocator
        (free(pages, owner=room)); on_freed(): pages came back (wake admission)."""
        self.coordinator = coordinator
        self.allocator = allocator
        self.on_freed = on_freed
        # A prefill we cannot reach may only be cut off (a partition), its WRITE still queued in
        # its kernel: UCX gives up on that connection after its TCP user timeout, so hold pages
        # at least that long before trusting "gone" (a restart is safe sooner, but looks alike).
        self.unreachable_hold = unreachable_hold
        self.max_wait = max(max_wait, unreachable_hold)
        self.retry = retry
        self.clock = clock
        self.held: dict[int, _Held] = {}
        self._tasks: set[asyncio.Task] = set()
        self.released: dict[str, int] = {}  # by reason kind, for tests and logs

    def hold(self, room: int, prefill_addr: str, pages: list[int]) -> None:
        """Take the room's pages; they go back to the allocator once prefill lets go."""
        self.held[room] = _Held(prefill_addr, list(pages), self.clock())
        task = asyncio.get_running_loop().create_task(self._release_when_safe(room), name=f"quarantine-{room}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def pages_held(self) -> int:
        return sum(len(h.pages) for h in self.held.values())

    def __bool__(self) -> bool:
        return bool(self.held)

    async def close(self) -> None:
        """Worker stopping: stop retrying (the pages die with the process)."""
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _release_when_safe(self, room: int) -> None:
        h = self.held[room]
        generation = self.coordinator.prefill_generation(h.prefill_addr)
        max_failures = max(1, self.coordinator.heartbeat_max_failures)
        timeout = max(0.1, min(self.coordinator.rpc_timeout, self.coordinator.heartbeat_interval))
        failures, refused = 0, False
        with bound_room(room):
            while True:
                why, kind = None, None
                try:
                    reply = await self.coordinator.client(h.prefill_addr).abort(
                        room, ABORT_REASON, self.coordinator.receiver.agent_name, timeout=timeout
                    )
                    failures, refused = 0, False
                    if reply.quiesced:
                        why, kind = "prefill quiesced the room", "quiesced"
                except ProtocolMismatch as e:  # another release answers: not the process that wrote
                    why, kind = f"prefill speaks another protocol: {e}", "gone"
                except BootstrapCallError as e:
                    failures += 1
                    # refused: prefill's host answered and nothing listens — the process is gone,
                    # not cut off by a partition, so no WRITE of it is still queued in the network
                    refused = "refused" in (e.details or "").lower()
                    log.info("abort to prefill not answered", prefill=h.prefill_addr, failures=failures, error=str(e))
                    if failures >= max_failures:
                        why, kind = f"prefill unreachable for {failures} tries in a row", "gone"
                if why is None and self.coordinator.prefill_generation(h.prefill_addr) != generation:
                    why, kind = "prefill restarted or declared dead by heartbeats", "gone"
                waited = self.clock() - h.since
                if kind == "gone" and not refused and waited < self.unreachable_hold:
                    why, kind = None, None  # not yet: its last WRITE may still be in flight
                if why is None and waited >= self.max_wait:
                    why, kind = f"prefill never let go within {self.max_wait:g}s", "bound"
                if why is not None:
                    break
                await asyncio.sleep(self.retry)
            (log.warning if kind == "bound" else log.info)(
                "quarantined pages released", prefill=h.prefill_addr, pages=len(h.pages),
                reason=why, held_seconds=round(waited, 3),
            )
        del self.held[room]
        self.released[kind] = self.released.get(kind, 0) + 1
        self.allocator.free(h.pages, owner=room)
        self.on_freed()
