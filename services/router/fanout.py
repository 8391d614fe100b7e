"""n > 1: one orchestrator generator per choice, read concurrently (router fan-out).

Each choice is a full request on the workers (its own pair, room and seed), so it fails over and
migrates on its own exactly as a single request does; `FanIn.next()` hands back whichever choice
has a chunk first. A request with n = 1 goes through the same path with one generator.

The prompt is computed once, not n times: the first attempt of every choice goes to the same
prefill (`PrefillShare.prefill`, the one the first choice drew) with one `share_key`, and that
prefill computes the prompt for the first of them while the others wait to take its full pages
from its prefix cache (services/prefill/sharing.py). Decode workers may differ. A retry or
migration is an ordinary attempt, without the key.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Awaitable, Callable

from services.router.attempt import Chunk
from services.router.request_state import PrefillShare

__all__ = ["IDLE", "FanIn", "PrefillShare", "Single"]

# what FanIn.next() answers when woken by wake_idle() with nothing queued: (IDLE, None)
IDLE = -1
_IDLE_WAKE = object()


class FanIn:
    """The choices' chunks in arrival order. What is read from the workers but not yet by the
    caller is counted in tokens (`buffered`): past `max_buffered` (the caller is stuck writing to a
    client that does not keep up), `on_overflow` is called once and the caller is expected to cut
    that client off; the pumps go on reading meanwhile, so one slow client never backs up a
    worker's lane that other requests share."""

    def __init__(self, gens: list[AsyncIterator[Chunk]], max_buffered: int | None = None):
        self.gens = gens
        self.max_buffered = max_buffered
        self.on_overflow: Callable[[], None] | None = None
        self.buffered = 0  # tokens queued for the caller
        self._overflowed = False
        # (index, chunk, exception) for the one reader; asyncio.Queue's waiter list and
        # bookkeeping cost more per chunk than a deque and one waiter
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._tasks = [asyncio.ensure_future(self._pump(i, g)) for i, g in enumerate(gens)]

    def _put(self, item: tuple[int, Chunk | None, BaseException | None]) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _pump(self, index: int, gen: AsyncIterator[Chunk]) -> None:
        try:
            async for chunk in gen:
                self._put((index, chunk, None))
                self.buffered += len(chunk.token_ids)
                if self.max_buffered is not None and self.buffered > self.max_buffered:
                    self._overflow()
            self._put((index, None, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - APIError or a bug: the reader re-raises it
            self._put((index, None, e))

    def _overflow(self) -> None:
        if not self._overflowed and self.on_overflow is not None:
            self._overflowed = True
            self.on_overflow()

    def _got(self, index: int, chunk: Chunk | None, exc: BaseException | None) -> tuple[int, Chunk | None]:
        if exc is not None:
            raise exc
        if chunk is not None:
            self.buffered -= len(chunk.token_ids)
        return index, chunk

    async def next(self) -> tuple[int, Chunk | None]:
        """(choice index, its next chunk), or (index, None) when that choice's stream ended.
        Raises what a choice's generator raised (an APIError)."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                woken = await self._waiter
            finally:
                self._waiter = None
            if woken is _IDLE_WAKE and not self._items:
                return IDLE, None
        return self._got(*self._items.popleft())

    def wake_idle(self) -> None:
        """A caller waiting in next() gets (IDLE, None) now unless a chunk is already queued for it
        (a stream that has been silent too long writes a keep-alive, stream_response.py)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(_IDLE_WAKE)

    def next_nowait(self) -> tuple[int, Chunk | None] | None:
        """As next(), for a chunk already queued; None when nothing is (the caller then awaits next())."""
        return self._got(*self._items.popleft()) if self._items else None

    async def close(self, index: int | None = None) -> None:
        """Stop one choice (a stop string ended it: its Decode RPC is cancelled) or all of them.

        Every picked choice is closed even when the caller is cancelled meanwhile (its client left
        as a choice ended); that cancellation is raised afterwards, never swallowed, so the caller
        goes on to close the other choices too instead of reading them for nobody."""
        picked = range(len(self._tasks)) if index is None else [index]
        for i in picked:
            self._tasks[i].cancel()
        cancelled = False
        for i in picked:
            for step in (self._tasks[i], self.gens[i].aclose()):  # type: ignore[attr-defined]
                cancelled = await _settle(step) or cancelled
        if cancelled:
            raise asyncio.CancelledError()


async def _settle(step: Awaitable) -> bool:
    """Await a closing step whatever it raises; True when the awaiting task itself was cancelled."""
    try:
        await step
    except asyncio.CancelledError:
        # the step's own cancellation (a pump we cancelled) or ours: only ours counts
        return asyncio.current_task().cancelling() > 0
    except Exception:  # noqa: BLE001 - a choice's failure while closing it is no longer anyone's
        pass
    return False


class Single:
    """FanIn's interface over one generator, read in the caller's task: for a non-streamed request
    with n = 1, where nothing reads ahead of the caller anyway (a stream keeps FanIn, whose pump
    reads ahead so that chunks already in hand go out in one write), it saves a task and a queue
    per request. Closing, errors and cancellation reach the generator as they do through FanIn."""

    def __init__(self, gen: AsyncIterator[Chunk]):
        self.gen = gen
        self._ended = False

    async def next(self) -> tuple[int, Chunk | None]:
        """As FanIn.next() for choice 0."""
        if self._ended:
            await asyncio.get_running_loop().create_future()  # as FanIn: nothing more ever comes
        try:
            return 0, await self.gen.__anext__()
        except StopAsyncIteration:
            self._ended = True
            return 0, None

    def next_nowait(self) -> tuple[int, Chunk | None] | None:
        return None  # nothing is read ahead

    async def close(self, index: int | None = None) -> None:
        if await _settle(self.gen.aclose()):  # type: ignore[attr-defined]
            raise asyncio.CancelledError()
