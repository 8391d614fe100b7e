"""vLLM's `stream_interval` for one streamed choice: its tokens go out N to an event instead of
one each. As vLLM does, the first output and the last (the one with a finish reason) go out at
once; in between, an event waits until N tokens are in hand, across decode's chunks. The text,
logprob entries and token ids of the tokens it holds come out joined in the event that carries
them, so the stream's concatenated text, logprobs and ids are what interval 1 gives.
"""

from __future__ import annotations

Step = tuple[str, list, "str | None"]  # (text, logprob entries, finish reason): one token's, from feed_each


class IntervalBatch:
    def __init__(self, interval: int):
        self.interval = interval
        self._texts: list[str] = []
        self._entries: list = []
        self._tokens = 0
        self._started = False  # the first output with anything in it has gone out

    def add(self, text: str, entries: list, finish_reason: str | None) -> Step | None:
        """One token's step; the joined step to send now, or None while the batch is held."""
        self._texts.append(text)
        self._entries.extend(entries)
        self._tokens += 1
        if self._started and finish_reason is None and self._tokens < self.interval:
            return None
        if text or entries or finish_reason is not None:
            self._started = True
        return self._take(finish_reason)

    def flush(self) -> Step | None:
        """What is held, to go out before the stream ends without a finish (an error)."""
        return self._take(None) if self._tokens else None

    def _take(self, finish_reason: str | None) -> Step:
        step = ("".join(self._texts), self._entries, finish_reason)
        self._texts, self._entries, self._tokens = [], [], 0
        return step
