"""The router as one object: its settings, the served model, the worker pool and orchestrator,
admission, body reading, metrics and the canary, built from RouterSettings; started and closed
with the app (services/router/app.py). The routes (generation_routes.py, model_routes.py,
service_routes.py, extra_routes.py) serve requests through it."""

from __future__ import annotations

import time

from fastapi.responses import JSONResponse
from starlette.requests import Request

from services.common.config import RouterSettings
from services.common.logging_setup import get_logger
from services.common.metrics import Metrics
from services.common.tokenizer import Tokenizer, load_tokenizer
from services.router import model_controls
from services.router.admission import Admission
from services.router.auth import api_keys, check_api_key
from services.router.canary import Canary
from services.router.errors import APIError
from services.router.http_errors import error_json
from services.router.load_view import load_view
from services.router.lora_updates import LoraUpdates
from services.router.model_info import grammar_cost, served_model
from services.router.orchestrator import Orchestrator, new_room
from services.router.output import TokenStrings
from services.router.policy import CacheThresholds
from services.router.pool import WorkerPool
from services.router.request_body import BodyReader

log = get_logger("router")


class Router:
    def __init__(self, settings: RouterSettings, tokenizer: Tokenizer | None = None):
        self.settings = settings
        self.api_keys = api_keys(settings.api_key)  # parsed once: checked on every request
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(settings.model, settings.tokenizer)
        template = model_controls.chat_template(settings.chat_template)
        if template is not None:
            self.tokenizer.override_chat_template(template)
        self.names, self.info = served_model(settings, self.tokenizer, lambda: self.pool.decode_capacity())
        name = self.info.name
        self.token_strings = TokenStrings(self.tokenizer)
        self.tokenizer.byte_tables()  # built now, not on the first stream (tens of ms for a large vocabulary)
        self.grammar_cost = grammar_cost(settings, self.tokenizer)
        # the router's other processes (--processes N): their admissions, loads, ejections and
        # /metrics, or nobody's with one process; chosen once (services/router/load_view.py)
        self.load = load_view(settings)
        self.admission = Admission(settings.max_concurrent_requests, self.load)
        self.metrics = Metrics("router", name, f"router-{settings.host}-{settings.port}{self.load.label}")
        self.metrics.gauge_from("num_running_reqs", lambda: self.active)
        self.bodies = BodyReader(settings.max_body_bytes, settings.body_timeout, settings.max_body_reads,
                                 self.metrics)
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
            lane_client=settings.worker_lane_client,
            keepalive=(settings.worker_keepalive_time, settings.worker_keepalive_timeout),
            load=self.load,
            pair_hold=settings.pair_hold,
            cache_thresholds=CacheThresholds(settings.cache_threshold, settings.balance_abs_threshold,
                                             settings.balance_rel_threshold),
            prefix_index_max_pages=settings.prefix_index_max_pages,
            local_prefill_max_tokens=settings.local_prefill_max_tokens,
        )
        self.exposition = self.load.metrics(self.metrics.exposition)  # one /metrics for all processes
        self.orchestrator = Orchestrator(self.pool, self.tokenizer.eos_token_ids,
                                         max_migrations=settings.max_migrations,
                                         stall_timeout=settings.stream_stall_timeout, metrics=self.metrics,
                                         log_requests=settings.log_requests)
        self.metrics.pairs_from(lambda: [(p.addr, d.addr) for p, d in self.pool.pairs.marks()])
        self.lora_updates = LoraUpdates(self.pool, self.info, {*self.names, *self.info.aliases},
                                        settings.allow_runtime_lora_updating)
        self.canary = Canary(self.pool, self.orchestrator.reap, self.tokenizer.encode("pdmesh canary"),
                             settings.canary_interval if settings.mode == "pd" else 0.0, settings.canary_timeout,
                             self.metrics, new_room)
        self.created = int(time.time())

    @property
    def active(self) -> int:
        """Choices admitted by this process and not yet finished (a request with n = 4 holds 4)."""
        return self.admission.active

    @property
    def draining(self) -> bool:
        return self.admission.draining

    def begin_drain(self) -> None:
        """A graceful stop began: new generation requests get 503 (a client or load balancer
        retries on another replica) and /health says draining, while the requests admitted so
        far run to their end (uvicorn waits for them up to --shutdown-timeout)."""
        if not self.admission.draining:
            self.admission.draining = True
            log.info("router draining", running_requests=self.active,
                     shutdown_timeout=self.settings.shutdown_timeout)

    async def start(self) -> None:
        await self.exposition.start()
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
        await self.lora_updates.close()
        await self.orchestrator.close()
        await self.pool.close()
        await self.exposition.close()

    async def metrics_exposition(self) -> bytes:
        return await self.exposition.exposition()

    # --- what every route uses ----------------------------------------------------------------

    def count(self, status: int) -> None:
        self.metrics.inc(self.metrics.router_requests, status=str(status))

    def error_response(self, error: APIError, request_id: int | str | None = None) -> JSONResponse:
        self.count(error.status)
        return error_json(error, request_id)

    def check_auth(self, request: Request) -> None:
        check_api_key(self.api_keys, request)

    async def read_json(self, request: Request):
        """The parsed body and its size in bytes (services/router/request_body.py's bounds)."""
        return await self.bodies.read_json(request)
