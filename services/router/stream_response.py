"""A request's SSE response: its first byte waits for every choice's first chunk (so a failure
before it is still an HTTP status, failed over by the orchestrator), then one event per token,
coalesced into one write while chunks are already in hand; an error after the first byte is an
error event and `[DONE]`; a stream silent for --stream-keepalive-interval gets a comment
(stream_keepalive.py). A client that falls too far behind is cut off as a stalled reader.

The wait for the first chunks is bounded by the same interval: a long prompt's prefill (minutes
at 512K tokens) or a wait for a free pair would otherwise leave the connection silent, without
even a status, past a proxy's read timeout. When the interval passes first, the status (200) and
headers go out with a keep-alive comment, and the stream goes on as one already begun: fail-over
before the first token still happens unseen, and a failure the router cannot recover from is an
error event, as vLLM reports every failure of a stream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from services.common.logging_setup import bound_room, get_logger
from services.router.errors import APIError
from services.router.fanout import IDLE
from services.router.http_errors import CLIENT_CLOSED, error_json
from services.router.sse import DONE, ClientDisconnected, SSEResponse, run_until_disconnect, sse_event
from services.router.stream_interval import IntervalBatch
from services.router.stream_keepalive import KEEPALIVE, IdleTimer

log = get_logger("router")


async def _first_of_each(driver, quiet: float) -> tuple[list[tuple[int, object]], bool]:
    """Chunks until every choice has sent one (failures before that are still an HTTP status),
    or until `quiet` seconds passed first (> 0): then (what came so far, True)."""
    got: list[tuple[int, object]] = []
    idle = IdleTimer(quiet, driver.fan.wake_idle) if quiet > 0 else None
    try:
        while len({i for i, _ in got}) < len(driver.choices):
            index, chunk = await driver.next()
            if index == IDLE:
                return got, True
            got.append((index, chunk))
    finally:
        if idle is not None:
            idle.close()
    return got, False


async def stream_response(driver, request: Request) -> Response:
    """`driver`: the RequestDriver (services/router/request_driver.py) of an admitted request."""
    quiet = driver.router.settings.stream_keepalive_interval
    try:
        first, early = await run_until_disconnect(_first_of_each(driver, quiet), request.receive, request.scope)
    except APIError as e:
        await driver.end(e.status, e.message)
        return error_json(e, driver.public_id)
    except ClientDisconnected:
        await driver.end(CLIENT_CLOSED, "client disconnected")
        return Response(status_code=CLIENT_CLOSED)
    except BaseException:
        await driver.end(500, "internal error before the first token")
        raise
    outcome: dict[str, Any] = {"status": 200, "error": None}

    async def on_close(disconnected: bool) -> None:
        # Close the orchestrator's generator here, explicitly: when the client left before the
        # event generator ever ran, nothing else would (its finally never starts), and the
        # Decode RPC would live on until garbage collection found the generator.
        try:
            await driver.fan.close()
        finally:
            if disconnected:
                driver.finish(CLIENT_CLOSED, "client disconnected mid-stream")
            else:
                driver.finish(outcome["status"], outcome["error"])

    response = SSEResponse(
        _events(driver, first, outcome, quiet, lead=KEEPALIVE if early else b""),
        on_close,
        bind=lambda: bound_room(driver.request_id),
        headers={"X-Request-Id": driver.public_id},
    )

    def too_far_behind() -> None:
        # its client reads slower than decode writes: cut it off, as one that stopped reading
        log.warning("client too far behind the stream; cut off", buffered_tokens=driver.fan.buffered)
        driver.router.metrics.inc(driver.router.metrics.router_client_cutoffs, reason="buffer")
        response.cut_off()

    driver.fan.on_overflow = too_far_behind  # type: ignore[union-attr]
    return response


async def _events(driver, first: list[tuple[int, object]], outcome: dict[str, Any], quiet: float,
                  lead: bytes = b"") -> AsyncIterator[bytes]:
    # Events of every chunk already in hand go out in one write: when decode (or its many
    # streams) gets ahead of the router, tokens are coalesced instead of costing a send each;
    # a chunk that is not there yet is never waited for before writing what is. `lead`: a
    # keep-alive comment when the stream begins before its first token; `quiet`: the seconds of
    # silence after which one is written (--stream-keepalive-interval, 0: never).
    buf: list[bytes] = [lead] if lead else []
    interval = driver.spec.stream_interval
    batches = [IntervalBatch(interval) for _ in driver.states] if interval > 1 else None
    idle = IdleTimer(quiet, driver.fan.wake_idle) if quiet > 0 else None
    try:
        if driver.spec.kind == "chat":
            for state in driver.states:
                buf.append(sse_event(state.role_chunk()))
        pending = list(first)
        while True:
            got = pending.pop(0) if pending else driver.next_nowait()
            if got is None:
                if buf:
                    yield b"".join(buf)
                    buf.clear()
                    if idle is not None:
                        idle.wrote()
                got = await driver.next()
            index, chunk = got
            if index == IDLE:  # silent for --stream-keepalive-interval: a comment the client skips
                buf.append(KEEPALIVE)
                continue
            state = driver.states[index]
            if state.finished:
                # read before the stream began (while waiting for every choice's first chunk),
                # after a stop string this choice's earlier chunk held: dropped, as next() would
                continue
            # one event per token (or per stream_interval tokens), whatever decode's chunking; the
            # last one carries the finish reason
            batch = batches[index] if batches else None
            for step in driver.feed(index, chunk, each=True):
                if batch is not None and (step := batch.add(*step)) is None:
                    continue
                event = state.delta_event(*step)
                if event is not None:
                    buf.append(event)
            if state.finished:
                # a stop string: cancel its Decode RPC before the last bytes go out
                await driver.fan.close(index)
                if driver.all_finished:
                    break
        if driver.spec.include_usage:
            buf.append(sse_event(driver.state.usage_chunk(driver.states)))
    except APIError as e:
        outcome.update(status=e.status, error=e.message)
        _flush_held(driver, batches, buf)
        buf.append(sse_event(e.body()))
    except Exception as e:  # a bug must still end the stream properly (error event, [DONE])
        log.exception("stream error")
        error = APIError(500, "Internal server error.", code="internal_error")
        outcome.update(status=500, error=repr(e))
        buf.append(sse_event(error.body()))
    finally:
        if idle is not None:
            idle.close()
        await driver.fan.close()
    buf.append(DONE)
    yield b"".join(buf)


def _flush_held(driver, batches: list[IntervalBatch] | None, buf: list[bytes]) -> None:
    """Tokens a stream_interval batch still held when a choice failed: the client gets every token
    it would have got with interval 1 before the error event."""
    if batches is None:
        return
    for state, batch in zip(driver.states, batches, strict=True):
        step = batch.flush()
        if step is not None and (event := state.delta_event(*step)) is not None:
            buf.append(event)
