"""What both workers do around their own logic: identity and logging at start, serving gRPC,
HTTP and the timers, supervision of every long-lived task, the stuck-forward watch, and a
graceful stop. The role-specific parts come in as arguments, so this module imports neither
torch nor nixl.

Every long-lived task runs under services/common/supervision.py: if one ends while the worker
runs, the worker turns NOT_SERVING and exits non-zero (EXIT_TASK_ENDED) for a restart. Task
names (what `--faults crash_task=NAME` takes): the role's loops by their key in
`WorkerParts.loops`, `watchdog`, `forward-watch`, `loop-lag`, `poller`, `http`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.common.config import DecodeSettings, PrefillSettings, ignored_env_twins
from services.common.faults import Faults
from services.common.forward_watch import watch_forwards
from services.common.grpc_server import bind, new_server
from services.common.lane_server import refuse_new_calls
from services.common.logging_setup import configure_logging, get_logger
from services.common.metrics import Metrics
from services.common.periodic import run_every
from services.common.process import default_worker_id, install_stop_signals
from services.common.supervision import ServingState, Supervisor
from services.common.worker_http import probe_loop_lag, serve_worker_http


def start_worker_process(role: str, args: PrefillSettings | DecodeSettings) -> tuple[str, Faults]:
    """Worker id, logging (JSON, or readable lines in a terminal), and the fault spec (logged
    loudly when any fault is on)."""
    worker_id = args.worker_id or default_worker_id(role, args.grpc_port)
    configure_logging(args.log_level, args.log_format, service=role, worker=worker_id)
    for notice in ignored_env_twins():
        get_logger(role).warning(notice)
    faults = Faults.parse(args.faults)
    if faults.active():
        get_logger(role).warning("FAULT INJECTION ACTIVE: this worker misbehaves on purpose", faults=faults.active())
    return worker_id, faults


@dataclass
class WorkerParts:
    role: str
    args: PrefillSettings | DecodeSettings  # frozen, typed, from the flag table
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
    # a forward ran past --forward-timeout: fail the rooms in it (UNAVAILABLE, reason names
    # the timeout). Runs on the loop while the forward is still stuck on the engine thread.
    on_stuck_forward: Callable[[str], None] = lambda reason: None
    faults: Faults = field(default_factory=Faults)  # crash_task applies here


async def run_worker(w: WorkerParts) -> None:
    log = get_logger(w.role)
    server, health = new_server()
    state = ServingState(health, w.grpc_services)
    sup = Supervisor(w.role, state, crash_task=w.faults.crash_task)
    w.add_servicers(server)
    bind(server, w.args.host, w.args.grpc_port)
    await server.start()

    def health_body() -> dict[str, Any]:
        return {
            "status": "ok" if state.serving else "not_serving",
            "problems": dict(state.problems),
            "role": w.role,
            "worker": w.worker_id,
            "model": w.engine.model_name,
            "agent": w.agent.name,
            "epoch": w.agent.epoch,
            "nixl_live_handles": w.agent.num_live_handles,
            "forward_age_seconds": round(w.engine.forward_age(), 3),
            **w.health_extra(),
            **w.engine.pool_health(),
        }

    interval = w.args.watchdog_interval
    forward_timeout = w.args.forward_timeout
    http = await serve_worker_http(w.args.host, w.args.http_port, w.metrics, health_body, sup)
    w.poller.start(sup.spawn)
    for name, loop in w.loops.items():
        sup.start(name, loop)
    sup.spawn(run_every(interval, w.sweep, f"{w.role}-watchdog"), "watchdog")
    sup.spawn(watch_forwards(w.engine, forward_timeout, interval, state, w.on_stuck_forward, w.role), "forward-watch")
    sup.spawn(probe_loop_lag(w.metrics), "loop-lag")
    await state.start()
    log.info(
        f"{w.role} worker ready",
        grpc=f"{w.args.host}:{w.args.grpc_port}",
        http=f"{w.args.host}:{w.args.http_port}",
        model=w.engine.model_name,
        device=str(w.engine.loaded.device),
        agent=w.agent.name,
        forward_timeout=forward_timeout,
    )
    await install_stop_signals().wait()
    refuse_new_calls(f"{w.role} worker stopping")  # calls on open lanes, as the server does new RPCs
    log.info(f"{w.role} worker stopping")
    await state.problem("stopping", "graceful stop")
    await server.stop(grace=2)
    sup.stopping = True  # tasks ending from here on is the plan, not a failure
    await http.stop()
    await sup.stop()
    for hook in w.on_stop:
        await hook()
    await w.poller.stop()
    w.agent.close()
    w.engine.shutdown()
