"""Worker selection policies, pure logic: given the healthy candidates and their load, pick one.

The load of a worker (services/router/pool.py `load_of`) is the number of requests this
router has in flight on it — exact and current — plus the queue depth the worker reported on
its last `Load` RPC that is not ours (other routers, other clients). See docs/router.md.

One policy object per role (prefill, decode), so round-robin keeps a cursor per role.

`cache_aware` also reads what each worker should hold of the request's prefix (a `PrefixView`,
from the router's index, services/router/prefix_index.py). The routing rule:

1. If the load is imbalanced — the busiest candidate's load exceeds the idlest's by more than
   `balance_abs` AND is more than `balance_rel` times it — the least loaded candidate wins: a
   hot conversation must not pin one worker while the others idle.
2. Otherwise, if the best-matching candidate holds at least `cache` (the threshold) of the prompt's
   tokens, it wins (the least loaded among equal matches).
3. Otherwise (no worthwhile match: a new conversation) the least loaded wins, ties round-robin,
   which spreads new conversations evenly.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

W = TypeVar("W")

POLICIES = ("cache_aware", "round_robin", "least_loaded", "power_of_two")


class PrefixView(Protocol):
    """What the router expects each worker to hold of one request's prompt."""

    total: int  # the prompt's tokens

    def matched(self, worker) -> int:
        """Leading prompt tokens the worker should find in its prefix cache."""


class Policy(ABC):
    @abstractmethod
    def choose(self, candidates: Sequence[W], load: Callable[[W], int], prefix: PrefixView | None = None) -> W:
        """One of `candidates` (never empty). Only cache_aware reads `prefix`."""


class RoundRobin(Policy):
    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates, load, prefix=None):
        pick = candidates[self._next % len(candidates)]
        self._next += 1
        return pick


class LeastLoaded(Policy):
    """Fewest in-flight requests; ties go round-robin so equal workers share the work."""

    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates, load, prefix=None):
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

    def choose(self, candidates, load, prefix=None):
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(list(candidates), 2)
        return b if load(b) < load(a) else a


@dataclass(frozen=True)
class CacheThresholds:
    cache: float = 0.3  # matched fraction of the prompt at which the cache decides (--cache-threshold)
    balance_abs: int = 32  # load gap beyond which balance decides... (--balance-abs-threshold)
    balance_rel: float = 1.5  # ...when the busiest also carries this many times the idlest's load (--balance-rel-threshold)

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache <= 1.0:
            raise ValueError(f"cache threshold must be within [0, 1], got {self.cache}")
        if self.balance_abs < 0 or self.balance_rel < 1.0:
            raise ValueError(f"balance thresholds must be abs >= 0 and rel >= 1, got {self.balance_abs}, "
                             f"{self.balance_rel}")


class CacheAware(Policy):
    """The worker holding the longest prefix of the request, unless load says otherwise (the
    routing rule in the module docstring)."""

    def __init__(self, thresholds: CacheThresholds | None = None) -> None:
        self.thresholds = thresholds or CacheThresholds()
        self._least_loaded = LeastLoaded()  # its own tie cursor: new conversations alternate,
        self._among_holders = LeastLoaded()  # undisturbed by ties between equal matches

    def imbalanced(self, loads: Sequence[int]) -> bool:
        hi, lo = max(loads), min(loads)
        return hi - lo > self.thresholds.balance_abs and hi > lo * self.thresholds.balance_rel

    def choose(self, candidates, load, prefix=None):
        if len(candidates) == 1:
            return candidates[0]  # without moving the tie cursor that spreads new conversations
        if prefix is None or prefix.total <= 0:
            return self._least_loaded.choose(candidates, load)
        loads = [load(c) for c in candidates]
        if self.imbalanced(loads):
            return self._least_loaded.choose(candidates, load)
        matched = [prefix.matched(c) for c in candidates]
        best = max(matched)
        if best == 0 or best < self.thresholds.cache * prefix.total:
            return self._least_loaded.choose(candidates, load)
        holders = [c for c, m in zip(candidates, matched, strict=True) if m == best]
        return holders[0] if len(holders) == 1 else self._among_holders.choose(holders, load)


def make_policy(name: str, rng: random.Random | None = None, thresholds: CacheThresholds | None = None) -> Policy:
    if name == "cache_aware":
        return CacheAware(thresholds)
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "power_of_two":
        return PowerOfTwo(rng)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
