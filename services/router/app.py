"""The router's HTTP surface: the OpenAI API on FastAPI + uvicorn.

POST /v1/completions, POST /v1/chat/completions (JSON or SSE; POST /v1/responses is translated
into chat, services/router/responses_route.py), GET /v1/models[/{id}],
GET /health (200 while a healthy prefill+decode pair exists, else 503), GET /metrics.

Order of checks for a generation request: API key (401) → the router's admission budget
spent already (429, before the body is read or tokenized: an overloaded router must not spend
work on requests it will refuse) → bodies being read at once (429, --max-body-reads) → body
size, from Content-Length and while reading (413, before any parsing) → body in time (408,
--body-timeout) → JSON (400; nested too deeply for the parser: 400) → fields and model
(400/404) → tokenization and context length (400) → admission of its n choices (400 for more
than the whole budget, 429 for more than is left: the slots are taken only once the body is in,
so a client slow to send holds none) → workers (503 none healthy / worker failure, 504
deadline). A refusal before the body is in closes the connection (the rest of the body would
otherwise arrive as its next bytes).

A streaming response starts (status 200, first SSE byte) only once decode's first token is
in hand, so every failure before it is a proper HTTP status and is failed over to another
pair; after it, a decode fault migrates the request (services/router/orchestrator.py), and only
a failure that cannot be migrated ends the stream with `data: {"error": ...}` and
`data: [DONE]`; the keep-alive connection stays usable.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from services.common.config import RouterSettings
from services.common.logging_setup import bound_contextvars, bound_room, get_logger
from services.common.metrics import CONTENT_TYPE, Metrics
from services.common.model_name import served_name
from services.common.tokenizer import (
    BUILTIN_NAMES,
    BUILTIN_RANDOM,
    Tokenizer,
    load_tokenizer,
    resolve_model_path,
)
from services.router import errors, extra_routes, model_controls, openapi, responses_route
from services.router.cache_reset import reset_prefix_caches
from services.router.canary import Canary
from services.router.errors import APIError
from services.router.fanout import FanIn, PrefillShare, Single
from services.router.fastpath import RouterApp
from services.router.grammar_cost import GrammarCost
from services.router.leases import Lease, Ledger
from services.router.limits import RequestLimits
from services.router.orchestrator import Orchestrator, new_room
from services.router.output import TokenStrings
from services.router.policy import CacheThresholds
from services.router.pool import WorkerPool
from services.router.protocol import GenerateSpec, ModelInfo, parse_chat, parse_completion, valid_request_id
from services.router.render import ResponseState
from services.router.shared_state import SharedState, state_path
from services.router.sibling_metrics import SiblingMetrics
from services.router.sse import DONE, ClientDisconnected, SSEResponse, run_until_disconnect, sse_event
from services.router.tool_parsers import FORMATS, detect_tool_parser

log = get_logger("router")

# services/engine/builtin_model.py's values (the router must not import torch, so they are repeated)
BUILTIN_CONTEXT_LENGTH = 8192
DEFAULT_CONTEXT_LENGTH = 4096  # what the engine assumes when config.json does not say
PARSE_IN_THREAD_BYTES = 64 * 1024  # tokenize bigger bodies off the event loop
CLIENT_CLOSED = 499  # nginx's "client closed request", for metrics and logs only


def error_json(error: APIError, request_id: int | str | None = None) -> JSONResponse:
    headers = dict(error.headers)
    if request_id is not None:
        headers["X-Request-Id"] = request_id if isinstance(request_id, str) else f"{request_id:016x}"
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def context_length(model: str) -> int:
    """max_position_embeddings of the model folder's config.json (8192 for the built-in model)."""
    if model in BUILTIN_NAMES:
        return BUILTIN_CONTEXT_LENGTH
    path = Path(model) / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return DEFAULT_CONTEXT_LENGTH
    for source in (cfg, cfg.get("text_config") or {}):
        value = source.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_CONTEXT_LENGTH


def tool_parser(flag: str, tokenizer: Tokenizer) -> str | None:
    """The tool-call format replies are parsed in: the flag's, or (auto) the one the chat template
    shows (its tool_use template first); None: tools are refused unless tool_choice is none."""
    if flag == "none":
        return None
    if flag in FORMATS:
        return flag
    if flag != "auto":
        raise ValueError(f"unknown tool-call parser {flag!r}")
    return detect_tool_parser([tokenizer.tool_chat_template])


def grammar_cost(settings: RouterSettings, tokenizer: Tokenizer) -> GrammarCost | None:
    """The bounded compile of requests' grammars, over the served model's tokenizer; None (grammars
    then go to the workers unmeasured, which still bound each step) when llguidance cannot read it."""
    folder = Path(resolve_model_path(settings.model)) if settings.model != BUILTIN_RANDOM else None
    try:
        return GrammarCost(tokenizer, folder if folder is not None and folder.is_dir() else None,
                           settings.grammar_compile_budget, settings.grammar_mask_budget)
    except Exception:  # noqa: BLE001 - logged; the workers' per-step budget still holds
        log.exception("grammar cost checks disabled: llguidance could not read the tokenizer")
        return None


class Router:
    def __init__(self, settings: RouterSettings, tokenizer: Tokenizer | None = None):
        self.settings = settings
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(settings.model)
        template = model_controls.chat_template(settings.chat_template)
        if template is not None:
            self.tokenizer.override_chat_template(template)
        self.names = model_controls.served_names(settings.model, settings.served_model_name,
                                                 served_name(settings.model))
        name = self.names[0]
        aliases = frozenset({settings.model, *self.names[1:],
                             *(BUILTIN_NAMES[1:] if settings.model in BUILTIN_NAMES else ())}) - {""}
        self.info = ModelInfo(name=name, tokenizer=self.tokenizer,
                              context_length=model_controls.max_model_len(settings.max_model_len,
                                                                          context_length(settings.model)),
                              aliases=aliases, tool_parser=tool_parser(settings.tool_call_parser, self.tokenizer),
                              defaults=model_controls.generation_defaults(settings.model, settings.generation_config),
                              capacity=lambda: self.pool.decode_capacity(),
                              limits=RequestLimits(settings.max_grammar_bytes, settings.max_request_worker_bytes))
        self.token_strings = TokenStrings(self.tokenizer)
        self.grammar_cost = grammar_cost(settings, self.tokenizer)
        self.shared: SharedState | None = None  # the other router processes' admissions and loads
        self.siblings: SiblingMetrics | None = None  # their /metrics
        label = f"router-{settings.host}-{settings.port}"
        if settings.processes > 1 and settings.shared_dir:
            self.shared = SharedState(state_path(settings.shared_dir), settings.processes, settings.process_index)
            self.shared.claim()
            label += f"-p{settings.process_index}"
        self._active = 0  # choices admitted and not finished: changed only by admission leases
        self.admissions = Ledger()  # the admission leases' amounts taken and released
        self._body_reads = 0  # request bodies being read (--max-body-reads), by leases too
        self.draining = False  # set on SIGTERM (begin_drain): admit nothing new, finish what is held
        self.metrics = Metrics("router", name, label)
        self.metrics.gauge_from("num_running_reqs", lambda: self.active)
        # the per-token metrics' labelled children, looked up once (labels() costs a lock and a dict per call)
        m = self.metrics
        self.ttft_metric = m.time_to_first_token.labels(**m.labels)
        self.itl_metric = m.inter_token_latency.labels(**m.labels)
        self.generation_tokens_metric = m.generation_tokens.labels(**m.labels)
        self.pool = WorkerPool(
            settings.prefill if settings.mode == "pd" else [],
            settings.decode,
            colocated=settings.mode == "colocated",
            policy=settings.policy,
            metrics=self.metrics,
            interval=settings.health_check_interval,
            timeout=settings.health_check_timeout,
            failure_threshold=settings.health_failure_threshold,
            dns_refresh_interval=settings.dns_refresh_interval,
            lane=settings.worker_lane,
            shared=self.shared,
            pair_hold=settings.pair_hold,
            cache_thresholds=CacheThresholds(settings.cache_threshold, settings.balance_abs_threshold,
                                             settings.balance_rel_threshold),
            prefix_index_max_pages=settings.prefix_index_max_pages,
            local_prefill_max_tokens=settings.local_prefill_max_tokens,
        )
        if self.shared is not None:
            self.siblings = SiblingMetrics(settings.shared_dir, settings.processes, settings.process_index,
                                           self.metrics.exposition)
        self.orchestrator = Orchestrator(self.pool, self.tokenizer.eos_token_ids,
                                         max_migrations=settings.max_migrations,
                                         stall_timeout=settings.stream_stall_timeout, metrics=self.metrics)
        self.metrics.pairs_from(lambda: [(p.addr, d.addr) for p, d in self.pool.pairs.marks()])
        self.canary = Canary(self.pool, self.orchestrator.reap, self.tokenizer.encode("pdmesh canary"),
                             settings.canary_interval if settings.mode == "pd" else 0.0, settings.canary_timeout,
                             self.metrics, new_room)
        self.created = int(time.time())

    @property
    def active(self) -> int:
        """Choices admitted by this process and not yet finished (a request with n = 4 holds 4)."""
        return self._active

    def _count_active(self, delta: int) -> None:
        # the one place the count changes: an admission Lease takes and gives it back
        self._active += delta
        if self.shared is not None:
            self.shared.set_active(self._active)  # the other processes' admission sees it at once

    def _count_body_reads(self, delta: int) -> None:
        self._body_reads += delta

    def check_capacity(self) -> None:
        """429 while the budget is spent, before any of the body is read: an overloaded router
        refuses without spending work on the request."""
        if self.draining:
            raise errors.shutting_down()
        limit = self.settings.max_concurrent_requests
        taken = self._active if self.shared is None else self._active + self.shared.peers_active()
        if taken >= limit:
            raise errors.too_many_requests(limit)

    def admit(self, cost: int) -> Lease:
        """Take `cost` slots (a request's choices: what the workers will hold) of
        --max-concurrent-requests, which bounds the whole router: with --processes, every
        process's admitted choices count (shared_state.py). 400 for more than the whole budget,
        429 for more than is left. The slots are a Lease: released once, by whoever ends the request."""
        if self.draining:
            raise errors.shutting_down()
        limit = self.settings.max_concurrent_requests
        if cost > limit:
            raise errors.choices_over_budget(cost, limit)
        if self.shared is None:
            if self._active + cost > limit:
                raise errors.too_many_requests(limit)
        elif not self.shared.try_admit(limit, cost):  # counted there at once, under the shared lock
            raise errors.too_many_requests(limit)
        return Lease(self._count_active, cost, self.admissions)

    def begin_drain(self) -> None:
        """A graceful stop began: new generation requests get 503 (a client or load balancer
        retries on another replica) and /health says draining, while the requests admitted so
        far run to their end (uvicorn waits for them up to --shutdown-timeout)."""
        if not self.draining:
            self.draining = True
            log.info("router draining", running_requests=self.active,
                     shutdown_timeout=self.settings.shutdown_timeout)

    async def start(self) -> None:
        if self.siblings is not None:
            await self.siblings.start()
        await self.pool.start()
        self.canary.start()
        log.info("worker pool probed", model=self.info.name, served_model_names=self.names,
                 max_model_len=self.info.context_length, sampling_defaults=dict(self.info.defaults),
                 decode_capacity_tokens=self.pool.decode_capacity(),
                 prefill=self.settings.prefill, decode=self.settings.decode, policy=self.settings.policy,
                 pool=self.pool.status())

    async def close(self) -> None:
        if self.grammar_cost is not None:
            self.grammar_cost.close()
        await self.canary.close()
        await self.orchestrator.close()
        await self.pool.close()
        if self.siblings is not None:
            await self.siblings.close()

    async def metrics_exposition(self) -> bytes:
        return self.metrics.exposition() if self.siblings is None else await self.siblings.exposition()

    # --- helpers ------------------------------------------------------------------------------

    def count(self, status: int) -> None:
        self.metrics.inc(self.metrics.router_requests, status=str(status))

    def error_response(self, error: APIError, request_id: int | str | None = None) -> JSONResponse:
        self.count(error.status)
        return error_json(error, request_id)

    def check_auth(self, request: Request) -> None:
        key = self.settings.api_key
        if not key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise errors.unauthorized()

    async def read_json(self, request: Request) -> tuple[Any, int]:
        """The parsed body and its size in bytes: 413 as soon as the size limit is crossed, 408
        when it is not in within --body-timeout, 429 when --max-body-reads are already under way."""
        if self._body_reads >= self.settings.max_body_reads:
            raise errors.too_many_body_reads(self.settings.max_body_reads)
        try:
            with Lease(self._count_body_reads):
                async with asyncio.timeout(self.settings.body_timeout):
                    raw = await self._read_body(request)
        except TimeoutError:
            self.metrics.inc(self.metrics.router_client_cutoffs, reason="body_timeout")
            raise errors.body_timeout(self.settings.body_timeout) from None
        try:
            return json.loads(raw), len(raw)
        except RecursionError:
            raise errors.nested_too_deeply() from None
        except (ValueError, UnicodeDecodeError) as e:
            raise errors.bad_request(
                f"We could not parse the JSON body of your request ({e}). Send valid JSON.", code="invalid_json"
            ) from None

    async def _read_body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                raise errors.bad_request("Invalid Content-Length header.") from None
            if size > limit:
                raise errors.body_too_large(limit)
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise errors.body_too_large(limit)
            parts.append(part)
        return b"".join(parts)

    async def parse(self, kind: str, body: Any, size_hint: int) -> GenerateSpec:
        parse = parse_completion if kind == "completion" else parse_chat
        # a request's own chat template may take up to its render bound: not on the event loop
        in_thread = size_hint > PARSE_IN_THREAD_BYTES or (isinstance(body, dict) and body.get("chat_template") is not None)
        try:
            spec = await asyncio.to_thread(parse, body, self.info) if in_thread else parse(body, self.info)
        except RecursionError:  # a body deep enough to parse, walked by code that recurses
            raise errors.nested_too_deeply() from None
        if self.grammar_cost is not None:
            await self.grammar_cost.check(spec.grammar, spec.grammar_param)
        return spec

    # --- generation -----------------------------------------------------------------------------

    async def generate(self, request: Request, kind: str,
                       translate: Callable[[Any], Any] | None = None) -> Response:
        """Serve one generation request; `translate` turns another API's body into this kind's
        (the Responses API into chat: services/router/responses_route.py), its 400s answered alike."""
        t0 = time.monotonic()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.request_timeout
        request_id = new_room()
        public_id = client_request_id(request)
        with bound_room(request_id), bound_contextvars(**({"client_request_id": public_id} if public_id else {})):
            body_in = False
            try:
                if public_id is not None and not valid_request_id(public_id):
                    public_id = None
                    raise errors.bad_request(
                        "The X-Request-Id header must be 1 to 128 visible ASCII characters.", code="invalid_value")
                self.check_auth(request)
                self.check_capacity()
                body, size = await self.read_json(request)
                body_in = True
                if translate is not None:
                    body = translate(body)
                spec = await self.parse(kind, body, size)
                # the slots are taken once the body is in and parsed: a client slow to send holds none
                slots = self.admit(len(spec.prompts) * spec.n)
            except APIError as e:
                log.info("request rejected", status=e.status, error=e.message[:300])
                if not body_in:
                    # what is left of the body would arrive as the connection's next bytes: close it
                    e.headers = {**e.headers, "Connection": "close"}
                return self.error_response(e, public_id or request_id)
            except ClientDisconnect:
                self.count(CLIENT_CLOSED)
                return Response(status_code=CLIENT_CLOSED)
            try:
                self.metrics.inc(self.metrics.num_requests)
                self.metrics.inc(self.metrics.prompt_tokens, sum(len(p.prompt_ids) for p in spec.prompts))
                public_id = public_id or spec.request_id or f"{request_id:016x}"
                run = _Run(self, spec, request_id, t0, deadline, public_id, slots)
            except BaseException:
                slots.release()
                raise
            if spec.stream:
                return await run.stream(request)
            return await run.complete(request)


def client_request_id(request: Request) -> str | None:
    """The caller's X-Request-Id header (vLLM's rule: it names the response and is echoed back)."""
    return request.headers.get("x-request-id")


class _Run:
    """One admitted generation request: drives the orchestrator, records metrics, logs its end.

    With n > 1 every choice is its own orchestrator run (router fan-out, services/router/fanout.py)
    with seed + index, sharing one prefill that computes the prompt once; the response is
    assembled from one ResponseState per choice."""

    def __init__(self, router: Router, spec: GenerateSpec, request_id: int, t0: float, deadline: float,
                 public_id: str, slots: Lease):
        self.router = router
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
        if len(self.choices) == 1:
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

    def feed(self, index: int, chunk, each: bool = False) -> list[tuple[str, list, str | None]]:
        """Feed a chunk to its choice's state; returns (text, logprob entries, finish reason): one
        for the chunk, or with `each` one per token (a stream's events, ResponseState.feed_each)."""
        now = time.monotonic()
        n = len(chunk.token_ids)
        r = self.router
        if self.ttft is None:
            self.ttft = now - self.t0
            r.ttft_metric.observe(self.ttft)
        last = self.last_token_at[index]
        if last is not None and n:
            gap = (now - last) / n
            for _ in range(n):
                r.itl_metric.observe(gap)
        self.last_token_at[index] = now
        state = self.states[index]
        before = state.completion_tokens
        out = state.feed_each(chunk) if each else [(*state.feed(chunk), state.finish_reason)]
        r.generation_tokens_metric.inc(state.completion_tokens - before)
        return out

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
        """The next chunk of a choice still running."""
        while True:
            index, chunk = await self.fan.next()
            if self._take(index, chunk):
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
            await run_until_disconnect(self._collect(), request.receive)
            status, error = 200, None
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

    async def _first_of_each(self) -> list[tuple[int, object]]:
        """Chunks until every choice has sent one: failures before that are still an HTTP status."""
        got: list[tuple[int, object]] = []
        while len({i for i, _ in got}) < len(self.choices):
            got.append(await self.next())
        return got

    async def stream(self, request: Request) -> Response:
        try:
            first = await run_until_disconnect(self._first_of_each(), request.receive)
        except APIError as e:
            await self.end(e.status, e.message)
            return error_json(e, self.public_id)
        except ClientDisconnected:
            await self.end(CLIENT_CLOSED, "client disconnected")
            return Response(status_code=CLIENT_CLOSED)
        except BaseException:
            await self.end(500, "internal error before the first token")
            raise
        outcome: dict[str, Any] = {"status": 200, "error": None}

        async def on_close(disconnected: bool) -> None:
            # Close the orchestrator's generator here, explicitly: when the client left before the
            # event generator ever ran, nothing else would (its finally never starts), and the
            # Decode RPC would live on until garbage collection found the generator.
            try:
                await self.fan.close()
            finally:
                if disconnected:
                    self.finish(CLIENT_CLOSED, "client disconnected mid-stream")
                else:
                    self.finish(outcome["status"], outcome["error"])

        response = SSEResponse(
            self._events(first, outcome),
            on_close,
            bind=lambda: bound_room(self.request_id),
            headers={"X-Request-Id": self.public_id},
        )

        def too_far_behind() -> None:
            # its client reads slower than decode writes: cut it off, as one that stopped reading
            log.warning("client too far behind the stream; cut off", buffered_tokens=self.fan.buffered)
            self.router.metrics.inc(self.router.metrics.router_client_cutoffs, reason="buffer")
            response.cut_off()

        self.fan.on_overflow = too_far_behind  # type: ignore[union-attr]
        return response

    async def _events(self, first: list[tuple[int, object]], outcome: dict[str, Any]) -> AsyncIterator[bytes]:
        # Events of every chunk already in hand go out in one write: when decode (or its many
        # streams) gets ahead of the router, tokens are coalesced instead of costing a send each;
        # a chunk that is not there yet is never waited for before writing what is.
        buf: list[bytes] = []
        try:
            if self.spec.kind == "chat":
                for state in self.states:
                    buf.append(sse_event(state.role_chunk()))
            pending = list(first)
            while True:
                got = pending.pop(0) if pending else self.next_nowait()
                if got is None:
                    if buf:
                        yield b"".join(buf)
                        buf.clear()
                    got = await self.next()
                index, chunk = got
                state = self.states[index]
                if state.finished:
                    # read before the stream began (while waiting for every choice's first chunk),
                    # after a stop string this choice's earlier chunk held: dropped, as next() would
                    continue
                # one event per token, whatever decode's chunking; the last one carries the finish reason
                for text, entries, finish_reason in self.feed(index, chunk, each=True):
                    event = state.delta_event(text, entries, finish_reason)
                    if event is not None:
                        buf.append(event)
                if state.finished:
                    # a stop string: cancel its Decode RPC before the last bytes go out
                    await self.fan.close(index)
                    if self.all_finished:
                        break
            if self.spec.include_usage:
                buf.append(sse_event(self.state.usage_chunk(self.states)))
        except APIError as e:
            outcome.update(status=e.status, error=e.message)
            buf.append(sse_event(e.body()))
        except Exception as e:  # a bug must still end the stream properly (error event, [DONE])
            log.exception("stream error")
            error = APIError(500, "Internal server error.", code="internal_error")
            outcome.update(status=500, error=repr(e))
            buf.append(sse_event(error.body()))
        finally:
            await self.fan.close()
        buf.append(DONE)
        yield b"".join(buf)


def create_app(settings: RouterSettings, tokenizer: Tokenizer | None = None) -> FastAPI:
    router = Router(settings, tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.close()

    app = RouterApp(title="pdmesh router", summary="OpenAI-compatible API of a prefill/decode-disaggregated mesh",
                    lifespan=lifespan, redoc_url=None)
    app.state.router = router

    @app.post("/v1/completions", openapi_extra=openapi.request_body(openapi.CompletionRequest),
              responses=openapi.error_responses())
    async def completions(request: Request) -> Response:
        """Text completion (JSON, or SSE with "stream": true)."""
        return await router.generate(request, "completion")

    @app.post("/v1/chat/completions", openapi_extra=openapi.request_body(openapi.ChatCompletionRequest),
              responses=openapi.error_responses())
    async def chat_completions(request: Request) -> Response:
        """Chat completion (JSON, or SSE with "stream": true)."""
        return await router.generate(request, "chat")

    # served without FastAPI's middleware and routing (services/router/fastpath.py); the routes
    # above stay for the OpenAPI schema and for what the fast path leaves to FastAPI
    app.fast_post = {"/v1/completions": completions, "/v1/chat/completions": chat_completions}

    def custom_openapi() -> dict[str, Any]:
        # FastAPI's own schema, plus the request models the routes parse by hand (services/router/openapi.py)
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            names = [router.info.name, *sorted(router.info.aliases - {router.info.name})]
            app.openapi_schema = openapi.add_components(schema, names)
        return app.openapi_schema

    app.openapi = custom_openapi  # type: ignore[method-assign]

    def model_card(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": router.created,
            "owned_by": "pdmesh",
            "max_model_len": router.info.context_length,
            # pdmesh extension: the format tool calls are parsed in (null: tools only with tool_choice none)
            "tool_call_parser": router.info.tool_parser,
        }

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            router.check_auth(request)
        except APIError as e:
            return router.error_response(e)
        router.count(200)
        return JSONResponse({"object": "list", "data": [model_card(n) for n in router.names]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        try:
            router.check_auth(request)
            if model_id != router.info.name and model_id not in router.info.aliases:
                raise errors.model_not_found(model_id, router.info.name)
        except APIError as e:
            return router.error_response(e)
        router.count(200)
        return JSONResponse(model_card(model_id if model_id in router.names else router.info.name))

    @app.post("/reset_prefix_cache")
    @app.post("/flush_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        """Empty every worker's prefix cache (services/router/cache_reset.py)."""
        try:
            router.check_auth(request)
            body = await reset_prefix_caches(router.pool)
        except APIError as e:
            return router.error_response(e)
        router.count(200)
        return JSONResponse(body)

    @app.get("/health")
    async def health() -> Response:
        ok = router.pool.has_healthy_pair() and not router.draining
        status = "draining" if router.draining else "ok" if ok else "unavailable"
        body = {"status": status, "running_requests": router.active, **router.pool.status()}
        if not ok and not router.draining:
            body["reason"] = router.pool.unavailable_reason()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await router.metrics_exposition(), media_type=CONTENT_TYPE)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            error = errors.route_not_found(request.method, request.url.path)
        elif exc.status_code == 405:
            error = errors.method_not_allowed(request.method, request.url.path)
        else:
            error = APIError(exc.status_code, str(exc.detail))
        return router.error_response(error)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        log.error("unhandled error", path=request.url.path, error=repr(exc))
        return router.error_response(APIError(500, "Internal server error.", code="internal_error"))

    app.fast_error = internal_error
    extra_routes.register(app, router)
    responses_route.register(app, router)
    return app
