"""What both workers do around their own logic: identity and logging at start, serving gRPC,
HTTP and the timers, and a graceful stop. The role-specific parts come in as arguments, so
this module imports neither torch nor nixl."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.common.faults import Faults
from services.common.grpc_server import bind, new_server, set_not_serving, set_serving
from services.common.logging_setup import configure_logging, get_logger
from services.common.metrics import Metrics
from services.common.periodic import run_every
from services.common.process import default_worker_id, install_stop_signals
from services.common.worker_http import probe_loop_lag, serve_worker_http


def start_worker_process(role: str, args) -> tuple[str, Faults]:
    """Worker id, JSON logging, and the fault spec (logged loudly when any fault is on)."""
    worker_id = args.worker_id or default_worker_id(role, args.grpc_port)
    configure_logging(args.log_level, service=role, worker=worker_id)
    faults = Faults.parse(args.faults)
    if faults.active():
        get_logger(role).warning("FAULT INJECTION ACTIVE: this worker misbehaves on purpose", faults=faults.active())
    return worker_id, faults


@dataclass
class WorkerParts:
    role: str
    args: Any  # parsed flags: host, grpc_port, http_port, watchdog_interval
    worker_id: str
    engine: Any  # services.engine.worker_engine.WorkerEngine
    agent: Any  # services.transfer.nixl_agent.NixlAgent
    metrics: Metrics
    poller: Any  # services.transfer.poller.ProgressPoller
    add_servicers: Callable[[grpc.aio.Server], None]
    grpc_services: tuple[str, ...]  # names reported by grpc.health.v1
    loops: dict[str, Callable[[], Awaitable[None]]]  # the role's scheduler loops, by task name
    sweep: Callable[[], None]  # the watchdog's sweep, run every --watchdog-interval
    health_extra: Callable[[], dict[str, Any]] = dict
    on_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)


async def run_worker(w: WorkerParts) -> None:
    log = get_logger(w.role)
    server, health = new_server()
    w.add_servicers(server)
    bind(server, w.args.host, w.args.grpc_port)
    await server.start()

    def health_body() -> dict[str, Any]:
        return {
            "status": "ok",
            "role": w.role,
            "worker": w.worker_id,
            "model": w.engine.model_name,
            "agent": w.agent.name,
            "epoch": w.agent.epoch,
            "nixl_live_handles": w.agent.num_live_handles,
            **w.health_extra(),
            **w.engine.pool_health(),
        }

    http = await serve_worker_http(w.args.host, w.args.http_port, w.metrics, health_body)
    w.poller.start()
    tasks = [asyncio.create_task(loop(), name=name) for name, loop in w.loops.items()]
    tasks.append(
        asyncio.create_task(run_every(w.args.watchdog_interval, w.sweep, f"{w.role}-watchdog"), name="watchdog")
    )
    tasks.append(asyncio.create_task(probe_loop_lag(w.metrics), name="loop-lag"))
    await set_serving(health, *w.grpc_services)
    log.info(
        f"{w.role} worker ready",
        grpc=f"{w.args.host}:{w.args.grpc_port}",
        http=f"{w.args.host}:{w.args.http_port}",
        model=w.engine.model_name,
        device=str(w.engine.loaded.device),
        agent=w.agent.name,
    )
    await install_stop_signals().wait()
    log.info(f"{w.role} worker stopping")
    await set_not_serving(health, *w.grpc_services)
    await server.stop(grace=2)
    for t in tasks:
        t.cancel()
    for hook in w.on_stop:
        await hook()
    await w.poller.stop()
    http.close()
    w.agent.close()
    w.engine.shutdown()
