"""Health of each (prefill, decode) pair, beside each worker's own: pure logic, no I/O.

A worker's health probe says whether the worker serves; it cannot say whether that prefill can
move KV to that decode. A partial partition, a bad NIC or a transport mismatch between one
prefill and one decode leaves both workers healthy while every request on the pair fails. So
the router also keeps a mark per pair:

- **marked** when a request's KV path fails on the pair while both workers stay in the pool
  (`pair_failure`: the failure is not the client's, not a capacity refusal, not the request's
  own deadline), or when a canary on it fails (services/router/canary.py);
- **cleared** when a canary on it passes, or when a request on it succeeds (the pair was used as
  the last resort and worked);
- **forgotten** when either worker leaves the pool or is ejected: the worker's own health then
  rules, and a restarted worker (a new epoch) starts with clean pairs;
- **expired** `hold` seconds after its latest failure when nothing cleared it (no canary runs):
  the pair is tried again by the next request rather than avoided forever. A canary that keeps
  failing keeps renewing the mark.

Routing (WorkerPool.choose_pair) avoids marked pairs while an unmarked healthy pair exists and
keeps using each worker with its other peers; when every healthy pair is marked it still routes,
so a mark never turns a working mesh into 503s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import grpc

# Codes a failed KV move between two live workers shows up as: the peer is unreachable or the
# transfer timed out (UNAVAILABLE, DEADLINE_EXCEEDED before the request's own deadline), their
# layouts or protocol versions disagree (FAILED_PRECONDITION), or the KV that arrived is wrong
# (DATA_LOSS). Anything else — a refusal, a cancel, a local failure — says nothing about the pair.
PAIR_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.DATA_LOSS,
})


def pair_failure(code: grpc.StatusCode | None, kind: str, produced: bool, at_deadline: bool) -> bool:
    """Whether an attempt's failure counts against its (prefill, decode) pair.

    Only failures before decode's first token: after it decode holds the whole KV cache, so a
    later failure is decode's alone. A silent or ejected worker is the worker's problem (the pool
    handles it), and a failure at the request's own deadline is the request's.
    """
    return not produced and not at_deadline and kind == "error" and code in PAIR_CODES


@dataclass
class Mark:
    reason: str
    since: float  # clock time of the first failure of this mark
    last: float  # clock time of its latest failure: `hold` counts from here
    failures: int = 1


class PairHealth:
    """Marks keyed by (prefill key, decode key); keys are any hashable worker identity."""

    def __init__(self, hold: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.hold = hold
        self.clock = clock
        self._marks: dict[tuple[Hashable, Hashable], Mark] = {}
        self._used: dict[tuple[Hashable, Hashable], float] = {}

    def mark(self, prefill: Hashable, decode: Hashable, reason: str) -> bool:
        """Mark the pair; True when it was not marked before (a new mark, worth a log line)."""
        key = (prefill, decode)
        now = self.clock()
        found = self._live(key, now)
        if found is None:
            self._marks[key] = Mark(reason, now, now)
            return True
        found.failures += 1
        found.reason, found.last = reason, now
        return False

    def clear(self, prefill: Hashable, decode: Hashable) -> bool:
        """Clear the pair's mark; True when there was one."""
        return self._marks.pop((prefill, decode), None) is not None

    def forget(self, worker: Hashable) -> None:
        """Drop every mark naming `worker` (it left the pool, was ejected, or restarted)."""
        for table in (self._marks, self._used):
            for key in [k for k in table if worker in k]:
                del table[key]

    def any_marked(self) -> bool:
        """Whether some pair may be marked (an expired mark still counts until it is read)."""
        return bool(self._marks)

    def is_marked(self, prefill: Hashable, decode: Hashable) -> bool:
        return self._live((prefill, decode), self.clock()) is not None

    def marks(self) -> dict[tuple[Hashable, Hashable], Mark]:
        now = self.clock()
        return {k: m for k in list(self._marks) if (m := self._live(k, now)) is not None}

    def touch(self, prefill: Hashable, decode: Hashable) -> None:
        """A request used the pair now (the canary tests pairs left idle)."""
        self._used[(prefill, decode)] = self.clock()

    def idle_for(self, prefill: Hashable, decode: Hashable, since: float) -> float:
        """Seconds since the pair was last used, or since `since` (e.g. start) if never."""
        return self.clock() - self._used.get((prefill, decode), since)

    def _live(self, key: tuple[Hashable, Hashable], now: float) -> Mark | None:
        found = self._marks.get(key)
        if found is not None and self.hold > 0 and now - found.last >= self.hold:
            del self._marks[key]  # expired: the next request may try the pair again
            return None
        return found
