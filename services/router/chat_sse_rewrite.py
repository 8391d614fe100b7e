"""Another API's event stream made from the chat route's SSE byte stream (the Responses API's
and the Messages API's are both served by the chat route).

The chat stream's events are cut out of its byte chunks and handed, parsed, to a translator:
`feed(chunk)` gives the other API's events (bytes) for one chat chunk, `finish()` the closing
ones, at `[DONE]` or when the chat stream ends without it. Keep-alive comments pass through:
the client's connection needs them as much.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Protocol


class Translator(Protocol):
    def feed(self, chunk: dict[str, Any]) -> list[bytes]: ...

    def finish(self) -> list[bytes]: ...


async def rewrite(chat_events: AsyncIterator[bytes], translator: Translator) -> AsyncIterator[bytes]:
    """The translated stream; closing it closes the chat stream."""
    pending = b""
    try:
        async for data in chat_events:
            pending += data
            *whole, pending = pending.split(b"\n\n")
            events: list[bytes] = []
            for event in whole:
                if event.startswith(b":"):
                    events.append(event + b"\n\n")
                    continue
                if not event.startswith(b"data: "):
                    continue
                body = event[len(b"data: "):]
                if body == b"[DONE]":
                    events += translator.finish()
                else:
                    events += translator.feed(json.loads(body))
            if events:
                yield b"".join(events)
        tail = translator.finish()
        if tail:
            yield b"".join(tail)
    finally:
        await chat_events.aclose()  # type: ignore[attr-defined]
