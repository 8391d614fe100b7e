"""Reservations that release exactly once, whatever path ends the request.

A request holds two kinds of reservation: its admission slots (`--max-concurrent-requests`,
one per choice) and, per attempt, one in-flight count on each worker of its pair (what the
routing policies and the other router processes see as this router's load on the worker).
Each is a `Lease`: taking it adds to the count, `release()` takes it back — the first call
only, so every path that may end a request (success, client disconnect or cancel, fail-over,
migration, error) can release what it holds without knowing whether another path already did.
No count is adjusted anywhere else.

A `Ledger` counts the leases taken and released of one kind, so tests (and /health, in the
future) can tell that none is left outstanding after every request ended.
"""

from __future__ import annotations

from collections.abc import Callable


class Ledger:
    """How many leases of one kind were taken and released (in amounts, e.g. choices)."""

    __slots__ = ("taken", "released")

    def __init__(self) -> None:
        self.taken = 0
        self.released = 0

    @property
    def outstanding(self) -> int:
        return self.taken - self.released


class Lease:
    """`amount` units of a count, held until `release()` (idempotent; also a context manager).

    `adjust(+amount)` is called when the lease is taken, `adjust(-amount)` on its first release.
    """

    __slots__ = ("_adjust", "amount", "_ledger", "released")

    def __init__(self, adjust: Callable[[int], None], amount: int = 1, ledger: Ledger | None = None):
        adjust(amount)
        self._adjust, self.amount, self._ledger = adjust, amount, ledger
        self.released = False
        if ledger is not None:
            ledger.taken += amount

    def release(self) -> bool:
        """Give the units back; True the first time, False (and nothing happens) after that."""
        if self.released:
            return False
        self.released = True
        self._adjust(-self.amount)
        if self._ledger is not None:
            self._ledger.released += self.amount
        return True

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class PairLease:
    """The in-flight counts of one attempt's pair: `prefill` (None when colocated) and `decode`.

    The attempt releases the prefill's when its Prefill RPC ends (a reply awaited in the
    background still counts as load on the prefill) and the decode's when it closes; whoever
    ends the request releases the whole pair again, which then only frees what is still held.
    """

    __slots__ = ("prefill", "decode", "prefill_lease", "decode_lease")

    def __init__(self, prefill, decode, prefill_lease: Lease | None, decode_lease: Lease):
        self.prefill, self.decode = prefill, decode
        self.prefill_lease, self.decode_lease = prefill_lease, decode_lease

    def __iter__(self):  # `prefill, decode = pair`
        return iter((self.prefill, self.decode))

    def release_prefill(self) -> None:
        if self.prefill_lease is not None:
            self.prefill_lease.release()

    def release_decode(self) -> None:
        self.decode_lease.release()

    def release(self) -> None:
        self.release_prefill()
        self.release_decode()
