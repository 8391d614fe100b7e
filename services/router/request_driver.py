"""One admitted generation request, driven to its end: the orchestrator's runs of its choices
(router fan-out for n > 1 and batched prompts), their chunks fed to the response state, the
response itself (a JSON body here; SSE in stream_response.py), metrics, and one log line.

`finish` is the one end of every path (success, failure, client gone, a cut-off stream): it
releases the request's admission slots once and records the outcome.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from services.common.logging_setup import get_logger
from services.common.metrics import observe_many
from services.router import errors
from services.router.beam_run import BeamRun
from services.router.errors import APIError
from services.router.fanout import IDLE, FanIn, PrefillShare, Single
from services.router.http_errors import CLIENT_CLOSED, error_json
from services.router.json_codec import dumps
from services.router.leases import Lease
from services.router.orchestrator import new_room
from services.router.protocol import GenerateSpec
from services.router.render import ResponseState
from services.router.sse import ClientDisconnected, run_until_disconnect
from services.router.stream_response import stream_response

Reshape = Callable[[dict[str, Any]], dict[str, Any]]

log = get_logger("router")


class RequestDriver:
    """One admitted generation request: drives the orchestrator, records metrics, logs its end.

    With n > 1 every choice is its own orchestrator run (router fan-out, services/router/fanout.py)
    with seed + index, sharing one prefill that computes the prompt once; with beam search each
    prompt's choices come from one search (services/router/beam_run.py). The response is
    assembled from one ResponseState per choice.

    `router` is the Router (services/router/service.py): its tokenizer, settings, orchestrator
    and metrics."""

    def __init__(self, router, spec: GenerateSpec, request_id: int, t0: float, deadline: float,
                 public_id: str, slots: Lease, reshape: Reshape | None = None):
        self.router = router
        self.reshape = reshape  # another API's body from the chat/completion body dict (responses_route.py)
        self.slots = slots  # its admission slots, released by finish()
        self.spec = spec
        self.request_id = request_id
        self.public_id = public_id  # the client's X-Request-Id / request_id, else the room in hex
        self.t0 = t0
        self.deadline = deadline
        # choice k = prompt i x n + j (OpenAI's order for a batch); j samples with seed + j, so it
        # equals choice j of the same prompt sent alone
        self.choices = [(p, j) for p in spec.prompts for j in range(spec.n)]
        self.states = [ResponseState(p, router.tokenizer, router.token_strings, public_id, index=k,
                                     counts_prompt=j == 0)
                       for k, (p, j) in enumerate(self.choices)]
        self.state = self.states[0]
        timeout = router.settings.request_timeout
        buffered = router.settings.max_buffered_tokens * len(self.choices)  # the flag is per choice
        orchestrator = router.orchestrator
        if spec.beam_search:
            # each prompt's n choices are its n best beams, searched once (services/router/beam_run.py);
            # `requests` collects every step's request object
            self.requests = []
            runs = [BeamRun(orchestrator, p, deadline, timeout, self.requests, request_id if i == 0 else None)
                    for i, p in enumerate(spec.prompts)]
            # no bound on what waits for a slow client: the beams are whole in the router already
            self.fan = FanIn([gen for run in runs for gen in run.choices()])
        elif len(self.choices) == 1:
            # each choice's request object (services/router/request_state.py): its status, progress, budget
            self.requests = [orchestrator.new_request(self._choice_spec(spec, 0), first_room=request_id)]
            gen = orchestrator.generate(self.requests[0], deadline, timeout)
            self.fan: FanIn | Single = FanIn([gen], buffered) if spec.stream else Single(gen)
        else:
            # one prefill share per prompt: its n choices compute that prompt once
            shares = {id(p): PrefillShare(new_room()) for p in spec.prompts}
            self.requests = [orchestrator.new_request(self._choice_spec(p, j), request_id if k == 0 else None,
                                                      shares[id(p)])
                             for k, (p, j) in enumerate(self.choices)]
            self.fan = FanIn([orchestrator.generate(req, deadline, timeout) for req in self.requests], buffered)
        self.last_token_at: list[float | None] = [None] * len(self.choices)
        self.ttft: float | None = None
        self._ended: set[int] = set()  # choices whose last chunk (with a finish reason) was read
        self._finished = False

    @staticmethod
    def _choice_spec(spec: GenerateSpec, index: int) -> GenerateSpec:
        """The spec of choice `index` of one prompt: its own seed (choice 0 keeps the request's; no
        copy then — dataclasses.replace of a GenerateSpec is a measurable part of a request)."""
        seed = spec.choice_seed(index)
        return spec if seed == spec.seed else replace(spec, seed=seed)

    @property
    def all_finished(self) -> bool:
        return all(s.finished for s in self.states)

    @property
    def completion_tokens(self) -> int:
        return sum(s.completion_tokens for s in self.states)

    def feed(self, index: int, chunk, each: bool = False) -> Iterable[tuple[str, list, str | None]]:
        """Feed a chunk to its choice's state; returns (text, logprob entries, finish reason): one
        for the chunk, or with `each` one per token (a stream's events, ResponseState.feed_each,
        whose tokens are fed as their steps are taken)."""
        now = time.monotonic()
        n = len(chunk.token_ids)
        r = self.router
        if self.ttft is None:
            self.ttft = now - self.t0
            r.ttft_metric.observe(self.ttft)
        last = self.last_token_at[index]
        if last is not None and n:
            observe_many(r.itl_metric, (now - last) / n, n)  # one gap per token
        self.last_token_at[index] = now
        state = self.states[index]
        if each:
            return self._feed_each(state, chunk)
        before = state.completion_tokens
        out = [(*state.feed(chunk), state.finish_reason)]
        r.generation_tokens_metric.inc(state.completion_tokens - before)
        return out

    def _feed_each(self, state: ResponseState, chunk) -> Iterator[tuple[str, list, str | None]]:
        # the tokens are fed as the caller takes their steps (ResponseState.feed_each): counted after
        before = state.completion_tokens
        try:
            yield from state.feed_each(chunk)
        finally:
            self.router.generation_tokens_metric.inc(state.completion_tokens - before)

    def _take(self, index: int, chunk) -> bool:
        """Whether a chunk read from the fan-in is for the caller (a stream that ended early is an error)."""
        if self.states[index].finished:
            return False  # a stop string ended it: what its stream still had is dropped
        if chunk is None:
            if index in self._ended:
                return False  # its generator's end, after the chunk with the finish reason
            raise errors.upstream_failed("the decode stream ended early")
        if chunk.finish_reason:
            self._ended.add(index)
        return True

    async def next(self) -> tuple[int, object]:
        """The next chunk of a choice still running, or (fanout.IDLE, None) when the fan-in was
        woken by its idle timer (FanIn.wake_idle) with nothing to hand."""
        while True:
            index, chunk = await self.fan.next()
            if index == IDLE or self._take(index, chunk):
                return index, chunk

    def next_nowait(self) -> tuple[int, object] | None:
        """As next(), for a chunk already in hand; None when none is."""
        while True:
            got = self.fan.next_nowait()
            if got is None:
                return None
            if self._take(*got):
                return got

    def finish(self, status: int, error: str | None = None) -> None:
        """Record the outcome once: metrics, the concurrency slot, one log line."""
        if self._finished:
            return
        self._finished = True
        r = self.router
        self.slots.release()
        r.count(status)
        e2e = time.monotonic() - self.t0
        if self.ttft is not None:
            r.metrics.observe(r.metrics.e2e_request_latency, e2e)
        if status == CLIENT_CLOSED:
            r.metrics.inc(r.metrics.num_aborted_requests)
        if not (error or r.settings.log_requests):
            return
        fields = dict(
            status=status, stream=self.spec.stream, prompt_tokens=self.state.usage(self.states)["prompt_tokens"],
            n=self.spec.n, prompts=len(self.spec.prompts),
            completion_tokens=self.completion_tokens, finish_reason=self.state.finish_reason,
            ttft_s=None if self.ttft is None else round(self.ttft, 4), e2e_s=round(e2e, 4),
            client_request_id=self.public_id,
            # from the choices' request objects: how many pairs served them, and moves mid-stream
            attempts=sum(req.attempts for req in self.requests),
            migrations=sum(req.budget.migrations for req in self.requests),
        )
        if self.spec.session_id is not None:
            fields["session_id"] = self.spec.session_id
        if error:
            log.warning("request failed", error=error[:500], **fields)
        else:
            log.info("request done", **fields)

    async def end(self, status: int, error: str | None = None) -> None:
        """Close every choice, then finish: also when the closing is cancelled (the task's own
        cancellation comes out of the close, and the slots must be freed all the same)."""
        try:
            await self.fan.close()
        finally:
            self.finish(status, error)

    async def _collect(self) -> None:
        while not self.all_finished:
            index, chunk = await self.next()
            self.feed(index, chunk)
            if self.states[index].finished:
                await self.fan.close(index)  # a stop string ends it early: cancel its Decode RPC now

    async def complete(self, request: Request) -> Response:
        status, error = 500, "internal error"
        try:
            await run_until_disconnect(self._collect(), request.receive, request.scope)
            status, error = 200, None
            if self.reshape is not None:  # built from the dict: no JSON encoded only to be parsed again
                body = dumps(self.reshape(self.state.body(self.states)))
            else:
                body = await self.state.body_json(self.states)
            return Response(body, media_type="application/json", headers={"X-Request-Id": self.public_id})
        except APIError as e:
            status, error = e.status, e.message
            return error_json(e, self.public_id)
        except ClientDisconnected:
            status, error = CLIENT_CLOSED, "client disconnected"
            return Response(status_code=CLIENT_CLOSED)
        finally:
            await self.end(status, error)

    async def stream(self, request: Request) -> Response:
        """The SSE response (services/router/stream_response.py)."""
        return await stream_response(self, request)
