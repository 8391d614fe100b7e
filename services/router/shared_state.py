"""What the router's processes share (`--processes N`, N > 1): one small file mapped into each.

Every process owns one row and is the only one writing it; every process reads all rows. A row
holds the process's admitted choices (a request with n = 4 counts 4; so `--max-concurrent-requests` bounds the router as a
whole, not each process: an admission reads every row and counts itself under a lock on the
file, so two processes admitting at the same moment cannot both take the last slot; the lock is
held for a few loads and one store, and an admission waits for it ADMIT_LOCK_WAIT at most — a
process frozen while holding it cannot stop the others admitting) and, per worker, its requests in flight on that worker and how often it
ejected it. Each value is one aligned 8-byte word, written with a single store, so a reader sees
the old value or the new one and no lock is needed. The supervisor zeroes a dead process's row
before it starts the replacement, so what a killed process had in flight stops counting at once.
Each process also stamps a heartbeat in its row; the supervisor replaces one whose heartbeat
stops (a frozen process would otherwise keep its share of new connections unanswered).

Pure logic on a buffer: no asyncio, no gRPC; tests map the same file twice.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import time
from dataclasses import dataclass

MAX_WORKERS = 256  # worker entries per row; addresses past this are not shared (logged by the pool)
_PID, _ACTIVE, _USED, _BEAT = 0, 1, 2, 3  # a row's head: pid, admitted requests, worker entries in use,
_ROW_HEAD = 4  # and the last heartbeat (CLOCK_MONOTONIC in ms: the same clock in every process)
ADMIT_LOCK_WAIT = 0.02  # seconds an admission waits for the lock before admitting on an unlocked count
_ENTRY = 3  # worker key, requests in flight on it, times this process ejected it
ROW_WORDS = _ROW_HEAD + MAX_WORKERS * _ENTRY
_WORD = 8


def state_path(folder: str) -> str:
    return os.path.join(folder, "state")


def worker_key(role: str, addr: str) -> int:
    """A stable non-zero 63-bit key for a worker, the same in every process (0 marks an empty entry)."""
    digest = hashlib.blake2b(f"{role}|{addr}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") & ((1 << 63) - 1)) or 1


@dataclass
class PeerView:
    """What the other processes report for one worker."""

    inflight: int = 0
    ejections: int = 0


class SharedState:
    def __init__(self, path: str, processes: int, index: int):
        if not 0 <= index < processes:
            raise ValueError(f"process index {index} outside 0..{processes - 1}")
        self.path, self.processes, self.index = path, processes, index
        self._fd = os.open(path, os.O_RDWR)  # also what admission locks (flock: per open, so per process)
        self._map = mmap.mmap(self._fd, processes * ROW_WORDS * _WORD)
        self._words = memoryview(self._map).cast("q")
        self._base = index * ROW_WORDS
        self._peer_active_at = [r * ROW_WORDS + _ACTIVE for r in range(processes) if r != index]
        self._slots: dict[int, int] = {}  # worker key → its entry's word offset in our row

    @staticmethod
    def create(path: str, processes: int) -> None:
        """The zeroed file for `processes` rows (the supervisor, before it starts any process)."""
        with open(path, "wb") as f:
            f.truncate(processes * ROW_WORDS * _WORD)

    def close(self) -> None:
        self._words.release()
        self._map.close()
        os.close(self._fd)

    # --- this process's row -------------------------------------------------------------------

    def claim(self) -> None:
        """Take the row over: a replacement process starts from zero whatever its predecessor left."""
        self.clear_row(self.index)
        self._words[self._base + _PID] = os.getpid()

    def beat(self) -> None:
        """This process's event loop is running (the pool's exchange, every 20 ms)."""
        self._words[self._base + _BEAT] = int(time.monotonic() * 1000)

    def heartbeat_age(self, row: int) -> float | None:
        """Seconds since that process's last heartbeat; None before its first."""
        beat = self._words[row * ROW_WORDS + _BEAT]
        return None if beat == 0 else time.monotonic() - beat / 1000

    def set_active(self, n: int) -> None:
        self._words[self._base + _ACTIVE] = n

    def try_admit(self, limit: int, cost: int = 1) -> bool:
        """Count `cost` more admitted choices of ours if the router as a whole stays within `limit`."""
        locked = self._lock()
        try:
            at = self._base + _ACTIVE
            own = self._words[at]
            if own + self.peers_active() + cost > limit:
                return False
            self._words[at] = own + cost
            return True
        finally:
            if locked:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _lock(self) -> bool:
        """The admission lock, waited for ADMIT_LOCK_WAIT at most (False: not taken). Its holders
        keep it for microseconds, so only a holder frozen mid-admission makes this run out; then
        admitting on an unlocked count is better than the event loop blocking on it."""
        give_up = time.monotonic() + ADMIT_LOCK_WAIT
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= give_up:
                    return False
                time.sleep(0.0001)

    def publish(self, key: int, inflight: int, ejections: int) -> bool:
        """Our counts for one worker; False when the row has no room for another worker."""
        at = self._slots.get(key)
        if at is None:
            used = self._words[self._base + _USED]
            if used >= MAX_WORKERS:
                return False
            at = self._base + _ROW_HEAD + used * _ENTRY
            self._words[at] = key
            self._slots[key] = at
            self._words[self._base + _USED] = used + 1
        self._words[at + 1] = inflight
        self._words[at + 2] = ejections
        return True

    # --- the other processes' rows ------------------------------------------------------------

    def peers_active(self) -> int:
        words = self._words
        return sum(words[at] for at in self._peer_active_at)

    def peers(self) -> dict[int, PeerView]:
        """Per worker key, the other processes' in-flight requests and ejections, summed."""
        words, seen = self._words, {}
        for row in range(self.processes):
            if row == self.index:
                continue
            base = row * ROW_WORDS
            for i in range(min(words[base + _USED], MAX_WORKERS)):
                at = base + _ROW_HEAD + i * _ENTRY
                view = seen.get(words[at])
                if view is None:
                    view = seen[words[at]] = PeerView()
                view.inflight += words[at + 1]
                view.ejections += words[at + 2]
        return seen

    def clear_row(self, row: int) -> None:
        base = row * ROW_WORDS
        # the entry count first, so a reader never walks entries being zeroed as if they were live
        self._words[base + _USED] = 0
        for at in range(base, base + ROW_WORDS):
            self._words[at] = 0
