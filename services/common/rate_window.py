"""Events per second over a sliding window, for gauges like SGLang's gen_throughput that a
scrape reads at any moment (no state kept per scraper, so two Prometheus servers agree)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class RateWindow:
    """Counts in one-second buckets; rate() is the count of the last `window` seconds (the
    current, partial second included) divided by `window`."""

    def __init__(self, window: float, clock: Callable[[], float] = time.monotonic):
        self.window = window
        self._clock = clock
        self._buckets: deque[list] = deque()  # [second, count], oldest first

    def add(self, n: float = 1) -> None:
        second = int(self._clock())
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += n
        else:
            self._buckets.append([second, n])
            self._trim(second)

    def rate(self) -> float:
        now = self._clock()
        self._trim(int(now))
        return sum(count for _, count in self._buckets) / self.window

    def _trim(self, second: int) -> None:
        oldest = second - int(self.window) + 1
        while self._buckets and self._buckets[0][0] < oldest:
            self._buckets.popleft()
