"""Prefill worker process: engine, NIXL sender, gRPC (Prefill, KVBootstrap, Health), HTTP, timers."""

from __future__ import annotations

import asyncio
import math

from services.common.config import PrefillSettings, service_settings
from services.common.generated.pdmesh.v1 import worker_pb2_grpc as wpb_grpc
from services.common.worker_lifecycle import WorkerParts, load_engine, run_worker, start_worker
from services.engine.worker_engine import WorkerEngine
from services.prefill import watchdog
from services.prefill.servicer import PrefillServicer
from services.prefill.worker import PrefillWorker
from services.transfer.bootstrap import add_bootstrap_servicer
from services.transfer.nixl_agent import NixlAgent
from services.transfer.poller import ProgressPoller
from services.transfer.sender import KVSender


async def serve(argv=None) -> None:
    args = service_settings("prefill", PrefillSettings, argv)
    start = await start_worker("prefill", args)  # /health answers while the model loads
    faults, metrics = start.faults, start.status.metrics
    engine = await load_engine("prefill", lambda: WorkerEngine.from_settings(args, faults))
    agent = NixlAgent.for_pool("prefill", engine.pool)
    sender = KVSender(
        agent,
        engine.pool,
        pending_attach_ttl=args.bootstrap_timeout,
        stall_before_post=math.inf if faults.stall_transfer else 0.0,
        drop_notification=faults.drop_notification,
        refuse_attach=faults.fail_attach,
        refuse_attach_from=faults.fail_attach_from,
        kv_checksum=args.kv_checksum,
        misroute_kv=faults.misroute_kv,
        fault_seed=faults.fault_seed,
        read_timeout=args.kv_read_timeout,
        stall_read=faults.stall_kv_read,
    )
    worker = PrefillWorker(engine, sender, metrics, faults, args.chunked_prefill_size,
                           read_held_prefix=args.kv_read_held_prefix)

    def add_servicers(server):
        wpb_grpc.add_PrefillServicer_to_server(PrefillServicer(worker, args.log_requests), server)
        add_bootstrap_servicer(server, sender, forward_age=engine.forward_age)

    await run_worker(
        WorkerParts(
            start=start,
            engine=engine,
            agent=agent,
            rooms=lambda: len(worker.jobs),
            poller=ProgressPoller.attach(sender),
            add_servicers=add_servicers,
            grpc_services=("pdmesh.v1.Prefill", "pdmesh.v1.KVBootstrap"),
            loops={"prefill-scheduler": worker.schedule_loop},
            sweep=lambda: watchdog.sweep(worker, args.bootstrap_timeout, args.inflight_timeout),
            health_extra=lambda: {
                "pending_attaches": sender.num_pending_attach,
                "nixl_deferred_handles": sender.num_deferred_handles,
            },
            on_stuck_forward=worker.fail_stuck_forward,
        )
    )


def main(argv=None) -> None:
    asyncio.run(serve(argv))
