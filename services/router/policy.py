"""Worker selection policies, pure logic: given the healthy candidates and their load, pick one.

The load of a worker (services/router/pool.py `load_of`) is the number of requests this
router has in flight on it — exact and current — plus the queue depth the worker reported on
its last `Load` RPC that is not ours (other routers, other clients). See docs/router.md.

One policy object per role (prefill, decode), so round-robin keeps a cursor per role.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TypeVar

W = TypeVar("W")

POLICIES = ("round_robin", "least_loaded", "power_of_two")


class Policy(ABC):
    @abstractmethod
    def choose(self, candidates: Sequence[W], load: Callable[[W], int]) -> W:
        """One of `candidates` (never empty)."""


class RoundRobin(Policy):
    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates, load):
        pick = candidates[self._next % len(candidates)]
        self._next += 1
        return pick


class LeastLoaded(Policy):
    """Fewest in-flight requests; ties go round-robin so equal workers share the work."""

    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates, load):
        loads = [load(c) for c in candidates]
        low = min(loads)
        tied = [c for c, n in zip(candidates, loads, strict=True) if n == low]
        pick = tied[self._next % len(tied)]
        self._next += 1
        return pick


class PowerOfTwo(Policy):
    """Two distinct random candidates, the less loaded one wins (the first on a tie)."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates, load):
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(list(candidates), 2)
        return b if load(b) < load(a) else a


def make_policy(name: str, rng: random.Random | None = None) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "power_of_two":
        return PowerOfTwo(rng)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
