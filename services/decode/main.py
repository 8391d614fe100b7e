"""Decode worker process: engine, NIXL receiver, gRPC (Decode, Health), HTTP, timers."""

from __future__ import annotations

import asyncio

from services.common.config import DecodeSettings, service_settings
from services.common.generated.pdmesh.v1 import worker_pb2_grpc as wpb_grpc
from services.common.worker_lifecycle import WorkerParts, load_engine, run_worker, start_worker
from services.decode import watchdog
from services.decode.servicer import DecodeServicer
from services.decode.worker import DecodeWorker
from services.engine.worker_engine import WorkerEngine
from services.transfer.bootstrap import KVReceiveCoordinator
from services.transfer.nixl_agent import NixlAgent
from services.transfer.poller import ProgressPoller
from services.transfer.receiver import KVReceiver


async def serve(argv=None) -> None:
    args = service_settings("decode", DecodeSettings, argv)
    start = await start_worker("decode", args)  # /health answers while the model loads
    faults, metrics = start.faults, start.status.metrics
    engine = await load_engine("decode", lambda: WorkerEngine.from_settings(args, faults))
    agent = NixlAgent.for_pool("decode", engine.pool)
    receiver = KVReceiver(agent, engine.pool, verify_checksum=args.kv_checksum, corrupt_kv=faults.corrupt_kv,
                          fault_seed=faults.fault_seed, corrupt_kv_read=faults.corrupt_kv_read)
    coordinator = KVReceiveCoordinator(
        receiver,
        start.worker_id,
        heartbeat_interval=args.heartbeat_interval,
        heartbeat_max_failures=args.heartbeat_max_failures,
        forward_timeout=args.forward_timeout,
    )
    worker = DecodeWorker(
        engine, receiver, coordinator, metrics, faults, args.max_running_requests, args.chunked_prefill_size,
        quarantine_max=args.transfer_timeout, quarantine_retry=min(args.heartbeat_interval, 1.0),
        quarantine_unreachable_hold=args.transfer_tcp_user_timeout + 1.0 if args.transfer_tcp_user_timeout > 0 else 0.0,
        offer_held_prefix=args.kv_read_held_prefix,
    )

    async def heartbeats():
        await coordinator.start_heartbeats()

    await run_worker(
        WorkerParts(
            start=start,
            engine=engine,
            agent=agent,
            rooms=lambda: len(worker.jobs),
            poller=ProgressPoller.attach(receiver),
            add_servicers=lambda server: wpb_grpc.add_DecodeServicer_to_server(
                DecodeServicer(worker, args.keepalive_interval, args.log_requests), server),
            grpc_services=("pdmesh.v1.Decode",),
            loops={
                "decode-prealloc": worker.admission.loop,
                "decode-loop": worker.scheduler.loop,
                "kv-heartbeat": heartbeats,
            },
            sweep=lambda: watchdog.sweep(worker, args.prealloc_timeout, args.transfer_timeout),
            health_extra=lambda: {"kv_pages_quarantined": worker.admission.pages_quarantined},
            on_stop=[worker.admission.close, coordinator.close],
            on_stuck_forward=worker.fail_stuck_forward,
        )
    )


def main(argv=None) -> None:
    asyncio.run(serve(argv))
