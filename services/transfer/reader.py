"""Prefill's NIXL READ of the prompt pages decode holds: the previous round's prompt *and reply*.

Decode keeps a conversation's earlier rounds in its prefix cache, reply included; prefill never
saw the reply (decode generated it), so its own cache misses from the end of the previous
prompt. Decode's Attach names the ids of the prompt pages it holds (`held_pages`, complete and
read-only while its room lives) with a KV checksum per page; for a job whose own hit is shorter,
prefill READs the rest of them into pages of its own — one bounded READ per room — verifies each
page's checksum, caches them, and computes only the suffix. Any failure (NIXL error, our own
deadline, a checksum mismatch) only means prefill computes those tokens after all.

Life of one READ (one per room at most):

    reader.start(room, ...)      posted: PROC, or ended at once (DONE and verified, or an error)
    reader.poll()                DONE -> checksums -> on_end(ok); ERR -> on_end(error);
                                 past `timeout` from its start -> released -> on_end(timeout)
    reader.cancel(room)          the room ended first: release the handle, no callback

`on_end` is called only once NIXL has released the handle: until then it may still write into
the local pages, so the job does not compute into them. A handle NIXL refuses to release is
retried on every poll (a live READ) or handed to the caller (`cancel` returns it: the sender's
deferred handles keep the room's pages until a sweep releases it). A frozen decode leaves a READ
in progress forever; only the deadline ends it.

No torch and no nixl import: the agent is passed in (services/transfer/nixl_agent.NixlAgent, or a
fake in unit tests); the pool is read only through `page_run_bytes` (the checksum's bytes).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.logging_setup import get_logger
from services.transfer.descriptors import page_descs
from services.transfer.kv_checksum import kv_checksum
from services.transfer.state import Clock
from services.transfer.wire_format import MemoryLayout, NixlError

log = get_logger("transfer.reader")

# why a READ did not give its pages (kv_read_failures_total's `reason` label)
ERROR, TIMEOUT, CHECKSUM = "error", "timeout", "checksum"
REASONS = (ERROR, TIMEOUT, CHECKSUM)


def page_checksum(read_run: Callable[[int, int], object], page: int) -> int:
    """The KV checksum of one page's bytes alone: what decode sends per held page and prefill
    compares after its READ (the same XXH3-64 as the transfer's, services/transfer/kv_checksum.py)."""
    return kv_checksum(read_run, [page], ())


@dataclass(frozen=True)
class ReadOutcome:
    ok: bool
    pages: int  # pages the READ was to bring
    nbytes: int
    seconds: float  # from its start to its end (the handle released)
    reason: str = ""  # one of REASONS when not ok
    detail: str = ""


# a READ NIXL reported DONE: its checksums are verified once the handle is released
_DONE = ReadOutcome(True, 0, 0, 0.0, "done")


@dataclass(eq=False)
class _Read:
    room: int
    peer: str  # the decode agent's name
    local_pages: list[int]
    checksums: list[int]  # per local page; empty: none to verify
    started: float
    on_end: Callable[[ReadOutcome], None]
    xfer: Any = None
    nbytes: int = 0
    ending: ReadOutcome | None = None  # decided, waiting for NIXL to release the handle


class KVReader:
    def __init__(self, agent, pool, *, clock: Clock = time.monotonic, timeout: float = 5.0,
                 stall: bool = False):
        """timeout: seconds from a READ's start until it is given up. stall: TEST-ONLY fault
        knob (`stall_kv_read`): posted READs are never checked, so each one runs into the
        deadline (as a READ from a frozen decode does)."""
        self.agent = agent
        self.pool = pool
        self.clock = clock
        self.timeout = timeout
        self.stall = stall
        if stall:
            log.warning("FAULT INJECTION ON: every held-prefix READ stalls until its deadline")
        self._reads: dict[int, _Read] = {}

    def __contains__(self, room: int) -> bool:
        return room in self._reads

    def __len__(self) -> int:
        return len(self._reads)

    def start(self, room: int, peer: str, peer_layout: MemoryLayout, local_layout: MemoryLayout,
              local_pages: Sequence[int], remote_pages: Sequence[int], checksums: Sequence[int],
              on_end: Callable[[ReadOutcome], None]) -> ReadOutcome | None:
        """Post one READ of `remote_pages` (the peer's) into `local_pages` (ours, in the same
        order). None: posted, `on_end` follows from poll(). Else the READ already ended (an error
        posting it, or DONE at once): its outcome, and `on_end` is not called."""
        if room in self._reads:
            raise ValueError(f"room {room} already has a READ")
        if len(local_pages) != len(remote_pages) or not local_pages:
            raise ValueError(f"READ of {len(remote_pages)} pages into {len(local_pages)}")
        if checksums and len(checksums) != len(local_pages):
            raise ValueError(f"{len(checksums)} checksums for {len(local_pages)} pages")
        rd = _Read(room, peer, list(local_pages), list(checksums), self.clock(), on_end)
        descs = page_descs(local_pages, remote_pages, local_layout.kv_base_addr, peer_layout.kv_base_addr,
                           local_layout.page_nbytes)
        rd.nbytes = sum(d.nbytes for d in descs)
        try:
            rd.xfer, status = self.agent.post_read(peer, descs, local_layout.kv_memory_kind,
                                                   local_layout.kv_device_id, peer_layout.kv_device_id)
        except NixlError as e:
            return self._outcome(rd, ERROR, f"NIXL: {e}")
        if status == "DONE" and not self.stall:
            self._release(rd)  # a DONE handle is released at once
            if rd.xfer is None:
                return self._verified(rd)
            rd.ending = _DONE  # NIXL would not let go yet: poll() ends it like the rest
        self._reads[room] = rd
        return None

    def poll(self) -> int:
        """Check every READ; end those DONE, failed or past their deadline. Returns how many
        are still live (the poller keeps polling while there are)."""
        now = self.clock()
        for rd in list(self._reads.values()):
            if rd.ending is None:
                rd.ending = self._check(rd, now)
                if rd.ending is None:
                    continue
            self._release(rd)
            if rd.xfer is not None:
                continue  # NIXL may still write into the pages: not ended yet
            del self._reads[rd.room]
            outcome = self._verified(rd) if rd.ending is _DONE else rd.ending
            try:
                rd.on_end(outcome)
            except Exception:
                log.exception("READ on_end callback failed", room=rd.room)
        return len(self._reads)

    def cancel(self, room: int) -> Any:
        """The room ended before its READ did: release the handle, forget the READ (no
        callback). Returns the handle when NIXL refused to release it (it may still write into
        the room's pages: the caller holds them until it is released), else None."""
        rd = self._reads.pop(room, None)
        if rd is None:
            return None
        self._release(rd)
        return rd.xfer

    def _check(self, rd: _Read, now: float) -> ReadOutcome | None:
        if not self.stall:
            try:
                if self.agent.check(rd.xfer) == "DONE":
                    return _DONE
            except NixlError as e:
                return self._outcome(rd, ERROR, f"NIXL: {e}")
        if now - rd.started >= self.timeout:
            return self._outcome(rd, TIMEOUT, f"no answer within --kv-read-timeout {self.timeout:g}s")
        return None

    def _release(self, rd: _Read) -> None:
        x = rd.xfer
        if x is not None and (getattr(x, "released", False) or self.agent.release(x) is not False):
            rd.xfer = None

    def _verified(self, rd: _Read) -> ReadOutcome:
        for i, page in enumerate(rd.local_pages if rd.checksums else ()):
            if page_checksum(self.pool.page_run_bytes, page) != rd.checksums[i]:
                return self._outcome(rd, CHECKSUM, f"page {i} of {len(rd.local_pages)} (local page {page}) "
                                                   "differs from decode's checksum")
        return ReadOutcome(True, len(rd.local_pages), rd.nbytes, self.clock() - rd.started)

    def _outcome(self, rd: _Read, reason: str, detail: str) -> ReadOutcome:
        return ReadOutcome(False, len(rd.local_pages), rd.nbytes, self.clock() - rd.started, reason, detail)
