"""The router's admission budget: --max-concurrent-requests, counted in choices (what the
workers hold: a request with n = 4 takes 4), for the router as a whole: its processes' admissions
are read through the load view (services/router/load_view.py), which has none with one process
and counts every process's under one lock with --processes.

Two checks, at two moments of a generation request: `check_capacity` before its body is read
(an overloaded router refuses without spending work), `admit` once the body is in and parsed
(so a client slow to send holds no slot). The slots are a `Lease` (services/router/leases.py):
released once, by whoever ends the request.
"""

from __future__ import annotations

from services.router import errors
from services.router.leases import Lease, Ledger
from services.router.load_view import LOCAL, LoadView


class Admission:
    def __init__(self, limit: int, view: LoadView = LOCAL):
        self.limit = limit
        self.view = view  # the router's other processes' admissions (services/router/load_view.py)
        self._active = 0  # choices admitted and not finished: changed only by admission leases
        self.ledger = Ledger()  # the admission leases' amounts taken and released
        self.draining = False  # a graceful stop began: admit nothing new, finish what is held

    @property
    def active(self) -> int:
        """Choices admitted by this process and not yet finished."""
        return self._active

    def _count(self, delta: int) -> None:
        # the one place the count changes: an admission Lease takes and gives it back
        self._active += delta
        self.view.set_active(self._active)

    def check_capacity(self) -> None:
        """429 while the budget is spent, before any of the body is read."""
        if self.draining:
            raise errors.shutting_down()
        if self._active + self.view.others_active() >= self.limit:
            raise errors.too_many_requests(self.limit)

    def admit(self, cost: int) -> Lease:
        """Take `cost` slots: 400 for more than the whole budget, 429 for more than is left."""
        if self.draining:
            raise errors.shutting_down()
        if cost > self.limit:
            raise errors.choices_over_budget(cost, self.limit)
        if not self.view.try_admit(self._active, cost, self.limit):
            raise errors.too_many_requests(self.limit)
        return Lease(self._count, cost, self.ledger)
