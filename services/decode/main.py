"""Decode worker process: engine, NIXL receiver, gRPC (Decode, Health), HTTP, timers."""

from __future__ import annotations

import asyncio

from services.common.config import DECODE_FLAGS, parse_args
from services.common.faults import Faults
from services.common.generated.pdmesh.v1 import worker_pb2_grpc as wpb_grpc
from services.common.grpc_server import bind, new_server, set_not_serving, set_serving
from services.common.logging_setup import configure_logging, get_logger
from services.common.metrics import Metrics
from services.common.periodic import run_every
from services.common.process import default_worker_id, install_stop_signals
from services.common.worker_http import probe_loop_lag, serve_worker_http
from services.decode import watchdog
from services.decode.servicer import DecodeServicer
from services.decode.worker import DecodeWorker
from services.engine.worker_engine import WorkerEngine
from services.transfer.bootstrap import KVReceiveCoordinator
from services.transfer.nixl_agent import NixlAgent
from services.transfer.poller import ProgressPoller
from services.transfer.receiver import KVReceiver

DESCRIPTION = "pdmesh decode worker: receives prompts' KV from prefill over NIXL and generates tokens."


async def serve(argv=None) -> None:
    args = parse_args("python -m services.decode", DESCRIPTION, DECODE_FLAGS, argv)
    worker_id = args.worker_id or default_worker_id("decode", args.grpc_port)
    configure_logging(args.log_level, service="decode", worker=worker_id)
    log = get_logger("decode")
    faults = Faults.parse(args.faults)
    if faults.active():
        log.warning("FAULT INJECTION ACTIVE: this worker misbehaves on purpose", faults=faults.active())

    engine = WorkerEngine(args.model, args.device, args.dtype, args.num_pages, args.page_size)
    agent = NixlAgent.for_pool("decode", engine.pool)
    receiver = KVReceiver(agent, engine.pool)
    coordinator = KVReceiveCoordinator(
        receiver,
        worker_id,
        heartbeat_interval=args.heartbeat_interval,
        heartbeat_max_failures=args.heartbeat_max_failures,
    )
    metrics = Metrics("decode", engine.model_name, worker_id)
    worker = DecodeWorker(
        engine, receiver, coordinator, metrics, faults, args.max_running_requests,
        quarantine_max=args.transfer_timeout, quarantine_retry=min(args.heartbeat_interval, 1.0),
    )

    server, health = new_server()
    wpb_grpc.add_DecodeServicer_to_server(DecodeServicer(worker), server)
    bind(server, args.host, args.grpc_port)
    await server.start()

    def health_body():
        return {
            "status": "ok",
            "role": "decode",
            "worker": worker_id,
            "model": engine.model_name,
            "agent": agent.name,
            "epoch": agent.epoch,
            "nixl_live_handles": agent.num_live_handles,
            "rooms": len(worker.jobs),
            "kv_pages_quarantined": sum(len(p) for p in worker.quarantined.values()),
            **engine.pool_health(),
        }

    http = await serve_worker_http(args.host, args.http_port, metrics, health_body)
    poller = ProgressPoller.attach(receiver)
    poller.start()
    coordinator.start_heartbeats()
    tasks = [
        asyncio.create_task(worker.prealloc_loop(), name="decode-prealloc"),
        asyncio.create_task(worker.decode_loop(), name="decode-loop"),
        asyncio.create_task(
            run_every(
                args.watchdog_interval,
                lambda: watchdog.sweep(worker, args.prealloc_timeout, args.transfer_timeout),
                "decode-watchdog",
            ),
            name="decode-watchdog",
        ),
        asyncio.create_task(probe_loop_lag(metrics), name="loop-lag"),
    ]
    await set_serving(health, "pdmesh.v1.Decode")
    log.info(
        "decode worker ready",
        grpc=f"{args.host}:{args.grpc_port}",
        http=f"{args.host}:{args.http_port}",
        model=engine.model_name,
        device=str(engine.loaded.device),
        agent=agent.name,
    )
    stop = install_stop_signals()
    await stop.wait()
    log.info("decode worker stopping")
    await set_not_serving(health, "pdmesh.v1.Decode")
    await server.stop(grace=2)
    for t in tasks:
        t.cancel()
    await coordinator.close()
    await poller.stop()
    http.close()
    agent.close()
    engine.shutdown()


def main(argv=None) -> None:
    asyncio.run(serve(argv))
