"""Which running request gives up its KV pages when the decode pool runs out (pure, no torch).

Decode grows a request's pages one at a time while it generates. When a request needs a page
and none is free, the request last in order among those not yet scheduled in this step is
retracted (as vLLM and SGLang do): its pages return to the pool, it leaves the batch, and it
resumes later by recomputing its KV (prompt + tokens generated so far) on decode itself. The
order is vLLM's priority, then arrival (arrival alone under the router's default fcfs policy),
so the first requests in it always make progress.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Decision(Generic[T]):
    victim: T | None  # the request to retract; None: nothing may be retracted
    fail: bool = False  # the needing request can never fit: fail it instead


def choose_victim(needing: T, later: Sequence[T], batch_empty: bool, others_hold_pages: bool) -> Decision[T]:
    """Decide who gives up pages so that `needing` can grow by one page.

    needing: the running request that needs a page (scheduled in order: priority, arrival).
    later: running requests that arrived after it and are not in this step's batch yet
        (in order); the last of them is retracted first.
    batch_empty: no earlier request was scheduled in this step (none holds pages we could
        wait for in the running batch).
    others_hold_pages: requests outside the running batch (waiting for their KV, quarantined)
        hold pages that will come back.
    """
    if later:
        return Decision(later[-1])
    if not batch_empty or others_hold_pages:
        # pages will free up when the earlier requests finish (or the waiting ones do):
        # step aside and recompute later
        return Decision(needing)
    # alone, holding every page that will ever come back: it cannot grow, now or later
    return Decision(None, fail=True)
