"""Prefill worker process: engine, NIXL sender, gRPC (Prefill, KVBootstrap, Health), HTTP, timers."""

from __future__ import annotations

import asyncio
import math

from services.common.config import PREFILL_FLAGS, parse_args
from services.common.faults import Faults
from services.common.generated.pdmesh.v1 import worker_pb2_grpc as wpb_grpc
from services.common.grpc_server import bind, new_server, set_not_serving, set_serving
from services.common.logging_setup import configure_logging, get_logger
from services.common.metrics import Metrics
from services.common.periodic import run_every
from services.common.process import default_worker_id, install_stop_signals
from services.common.worker_http import probe_loop_lag, serve_worker_http
from services.engine.worker_engine import WorkerEngine
from services.prefill import watchdog
from services.prefill.servicer import PrefillServicer
from services.prefill.worker import PrefillWorker
from services.transfer.bootstrap import add_bootstrap_servicer
from services.transfer.nixl_agent import NixlAgent
from services.transfer.poller import ProgressPoller
from services.transfer.sender import BootstrapRejected, KVSender

DESCRIPTION = "pdmesh prefill worker: computes prompts' KV cache and sends it to decode over NIXL."


def _apply_attach_fault(sender: KVSender) -> None:
    def refuse(*_args, **_kw):
        raise BootstrapRejected("fault", "UNAVAILABLE", "fault injection: fail_attach")

    sender.attach = refuse


async def serve(argv=None) -> None:
    args = parse_args("python -m services.prefill", DESCRIPTION, PREFILL_FLAGS, argv)
    worker_id = args.worker_id or default_worker_id("prefill", args.grpc_port)
    configure_logging(args.log_level, service="prefill", worker=worker_id)
    log = get_logger("prefill")
    faults = Faults.parse(args.faults)
    if faults.active():
        log.warning("FAULT INJECTION ACTIVE: this worker misbehaves on purpose", faults=faults.active())

    engine = WorkerEngine(args.model, args.device, args.dtype, args.num_pages, args.page_size)
    agent = NixlAgent.for_pool("prefill", engine.pool)
    sender = KVSender(
        agent,
        engine.pool,
        pending_attach_ttl=args.bootstrap_timeout,
        stall_before_post=math.inf if faults.stall_transfer else 0.0,
        drop_notification=faults.drop_notification,
    )
    if faults.fail_attach:
        _apply_attach_fault(sender)
    metrics = Metrics("prefill", engine.model_name, worker_id)
    worker = PrefillWorker(engine, sender, metrics, faults, args.chunked_prefill_size)

    server, health = new_server()
    wpb_grpc.add_PrefillServicer_to_server(PrefillServicer(worker), server)
    add_bootstrap_servicer(server, sender)
    bind(server, args.host, args.grpc_port)
    await server.start()

    def health_body():
        return {
            "status": "ok",
            "role": "prefill",
            "worker": worker_id,
            "model": engine.model_name,
            "agent": agent.name,
            "epoch": agent.epoch,
            "nixl_live_handles": agent.num_live_handles,
            "rooms": len(worker.jobs),
            **engine.pool_health(),
        }

    http = await serve_worker_http(args.host, args.http_port, metrics, health_body)
    poller = ProgressPoller.attach(sender)
    poller.start()
    tasks = [
        asyncio.create_task(worker.schedule_loop(), name="prefill-scheduler"),
        asyncio.create_task(
            run_every(
                args.watchdog_interval,
                lambda: watchdog.sweep(worker, args.bootstrap_timeout, args.inflight_timeout),
                "prefill-watchdog",
            ),
            name="prefill-watchdog",
        ),
        asyncio.create_task(probe_loop_lag(metrics), name="loop-lag"),
    ]
    await set_serving(health, "pdmesh.v1.Prefill", "pdmesh.v1.KVBootstrap")
    log.info(
        "prefill worker ready",
        grpc=f"{args.host}:{args.grpc_port}",
        http=f"{args.host}:{args.http_port}",
        model=engine.model_name,
        device=str(engine.loaded.device),
        agent=agent.name,
    )
    stop = install_stop_signals()
    await stop.wait()
    log.info("prefill worker stopping")
    await set_not_serving(health, "pdmesh.v1.Prefill", "pdmesh.v1.KVBootstrap")
    await server.stop(grace=2)
    for t in tasks:
        t.cancel()
    await poller.stop()
    http.close()
    agent.close()
    engine.shutdown()


def main(argv=None) -> None:
    asyncio.run(serve(argv))
