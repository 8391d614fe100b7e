"""SSEResponse's ASGI messages: the start, one body message per batch of events, and the body's end
in the same message as the events that end with [DONE] (one write less per stream); a stream that
ends otherwise still ends its body; on_close runs once either way."""

from __future__ import annotations

import asyncio

from services.router.sse import DONE, SSEResponse, sse_event


def _serve(events: list[bytes]) -> tuple[list[dict], list[bool]]:
    sent: list[dict] = []
    closed: list[bool] = []

    async def gen():
        for e in events:
            yield e

    async def on_close(disconnected: bool) -> None:
        closed.append(disconnected)

    async def receive():
        await asyncio.Event().wait()  # the client never leaves

    async def send(message):
        sent.append(message)

    async def main():
        await SSEResponse(gen(), on_close)({"type": "http", "extensions": {}}, receive, send)

    asyncio.run(main())
    return sent, closed


def test_the_last_events_carry_the_end_of_the_body():
    first, last = sse_event({"text": "a"}), sse_event({"text": "b"}) + DONE
    sent, closed = _serve([first, last])
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert (sent[1]["body"], sent[1]["more_body"]) == (first, True)
    assert (sent[2]["body"], sent[2]["more_body"]) == (last, False)
    assert closed == [False]


def test_a_stream_without_done_still_ends_its_body():
    # text that mentions [DONE] is JSON inside an event, never the raw DONE line at its end
    event = sse_event({"text": "data: [DONE]\n\n"})
    assert not event.endswith(DONE)
    sent, closed = _serve([event])
    assert [(m.get("body"), m.get("more_body")) for m in sent[1:]] == [(event, True), (b"", False)]
    assert closed == [False]
