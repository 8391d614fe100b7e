"""What both workers do around their own logic: identity and logging at start, serving gRPC,
HTTP and the timers, supervision of every long-lived task, the stuck-forward watch, and a
graceful stop. The role-specific parts come in as arguments, so this module imports neither
torch nor nixl.

The HTTP side (/metrics, /health) starts first, before the model loads (`start_worker`):
/health answers "loading" (503) and /metrics answers with `pdmesh:up` 0, so a rollout's long
load looks like a worker loading, not like a worker down. A stop (SIGTERM) drains: the worker
reports NOT_SERVING and refuses new calls, waits up to --drain-timeout for its rooms to finish
or move (the router ejects a NOT_SERVING worker and migrates its decode streams), and keeps
/metrics and /health answering to the end.

Every long-lived task runs under services/common/supervision.py: if one ends while the worker
runs, the worker turns NOT_SERVING and exits non-zero (EXIT_TASK_ENDED) for a restart. Task
names (what `--faults crash_task=NAME` takes): the role's loops by their key in
`WorkerParts.loops`, `watchdog`, `forward-watch`, `loop-lag`, `poller`, `http`."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import grpc

from services.common.bind_guard import EXIT_CONFIG, refuse_insecure_bind
from services.common.config import DecodeSettings, PrefillSettings, ignored_env_twins
from services.common.faults import Faults
from services.common.forward_watch import watch_forwards
from services.common.grpc_server import bind, configure_internal_token, new_server
from services.common.lane_server import refuse_new_calls
from services.common.listening import port_taken
from services.common.logging_setup import configure_logging, get_logger
from services.common.metrics import Metrics
from services.common.model_name import served_name
from services.common.open_files import WORKER_OPEN_FILES, WORKER_OPEN_FILES_LOW, raise_soft_limit
from services.common.periodic import run_every
from services.common.process import default_worker_id, install_stop_signals
from services.common.status_server import StatusServer
from services.common.supervision import ServingState, Supervisor
from services.common.worker_http import probe_loop_lag, serve_worker_http
from services.transfer.network import Transport, configure_transport

T = TypeVar("T")

DRAIN_POLL = 0.05  # seconds between looks at the rooms a stopping worker still holds


def start_worker_process(role: str, args: PrefillSettings | DecodeSettings) -> tuple[str, Faults]:
    """Worker id, logging (JSON, or readable lines in a terminal), and the fault spec (logged
    loudly when any fault is on)."""
    worker_id = args.worker_id or default_worker_id(role, args.grpc_port)
    configure_logging(args.log_level, args.log_format, service=role, worker=worker_id)
    for notice in ignored_env_twins():
        get_logger(role).warning(notice)
    soft, hard = raise_soft_limit(WORKER_OPEN_FILES)
    if 0 <= soft < WORKER_OPEN_FILES_LOW:  # RLIM_INFINITY is -1
        get_logger(role).warning("open-files limit low for a large mesh; raise the hard limit (ulimit -Hn, "
                                 "the container's nofile)", open_files=soft, open_files_hard=hard,
                                 wanted=WORKER_OPEN_FILES)
    faults = Faults.parse(args.faults)
    if faults.active():
        get_logger(role).warning("FAULT INJECTION ACTIVE: this worker misbehaves on purpose", faults=faults.active())
    return worker_id, faults


def refuse_taken_ports(role: str, args: PrefillSettings | DecodeSettings) -> None:
    """Exit (EXIT_CONFIG, one log line naming the port) when the gRPC or HTTP port is already
    taken, before anything is served or loaded (services/common/listening.py says why)."""
    for kind, flag, port in (("gRPC", "--grpc-port", args.grpc_port), ("HTTP", "--http-port", args.http_port)):
        why = port_taken(args.host, port)
        if why:
            get_logger(role).error(f"cannot listen on the {kind} port: another process holds it; stop it or "
                                   f"choose another {flag}", host=args.host, port=port, error=why)
            sys.exit(EXIT_CONFIG)


async def load_engine(role: str, load: Callable[[], T]) -> T:
    """`load()` (the engine: model, KV pool) on a thread, while /health answers "loading". What
    the settings or the checkpoint cannot give (a missing folder or file, an unsupported
    architecture, a KV budget under one page, a device this machine lacks: ValueError, OSError)
    ends the worker with one log line naming it (EXIT_CONFIG), not a traceback."""
    try:
        return await asyncio.to_thread(load)
    except (ValueError, OSError) as e:
        get_logger(role).error(f"cannot load the model: {e}", error=type(e).__name__)
        sys.exit(EXIT_CONFIG)


class EarlyStatus:
    """A worker's /metrics and /health from its first second: "loading" until run_worker
    hands /health the serving body."""

    def __init__(self, role: str, worker_id: str, metrics: Metrics):
        self.metrics = metrics
        self.since = time.monotonic()
        model = metrics.labels["model_name"]
        self.body: Callable[[], dict[str, Any]] = lambda: {
            "status": "loading", "problems": {}, "role": role, "worker": worker_id, "model": model,
            "loading_seconds": round(time.monotonic() - self.since, 1),
        }
        self.http: StatusServer | None = None


async def start_status(role: str, args: PrefillSettings | DecodeSettings, worker_id: str) -> EarlyStatus:
    """The worker's Metrics (model_name: the served name) and its HTTP side, serving before the
    model loads."""
    metrics = Metrics(role, served_name(args.model, args.served_model_name), worker_id)
    status = EarlyStatus(role, worker_id, metrics)
    status.http = await serve_worker_http(args.host, args.http_port, metrics, lambda: status.body())
    get_logger(role).info(f"{role} worker loading", http=f"{args.host}:{args.http_port}", model=args.model)
    return status


class WorkerStart(NamedTuple):
    role: str
    args: PrefillSettings | DecodeSettings  # frozen, typed, from the flag table
    worker_id: str
    faults: Faults
    status: EarlyStatus
    transport: Transport


async def start_worker(role: str, args: PrefillSettings | DecodeSettings) -> WorkerStart:
    """What a worker does before it loads its model: identity, logging and faults, /metrics and
    /health (answering "loading"), the internal token and the bind guard (a worker that must not
    start exits here), and the KV transfer's network settings (before any NIXL agent exists)."""
    worker_id, faults = start_worker_process(role, args)
    refuse_taken_ports(role, args)
    status = await start_status(role, args, worker_id)
    has_token = configure_internal_token(args.internal_token_file, args.internal_token)
    refuse_insecure_bind(role, args.host, has_token, args.allow_insecure_bind)
    transport = configure_transport(args.advertise_host, args.host, args.transfer_tls,
                                    args.transfer_net_devices, args.transfer_tcp_user_timeout)
    return WorkerStart(role, args, worker_id, faults, status, transport)


@dataclass
class WorkerParts:
    start: WorkerStart  # role, settings, identity, faults (crash_task applies here), the HTTP side already serving
    engine: Any  # services.engine.worker_engine.WorkerEngine
    agent: Any  # services.transfer.nixl_agent.NixlAgent
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
    rooms: Callable[[], int] = lambda: 0  # rooms this worker holds: a stop waits for 0 (or --drain-timeout)

    @property
    def role(self) -> str:
        return self.start.role

    @property
    def args(self) -> PrefillSettings | DecodeSettings:
        return self.start.args


async def run_worker(w: WorkerParts) -> None:
    log = get_logger(w.role)
    server, health = new_server()
    state = ServingState(health, w.grpc_services)
    sup = Supervisor(w.role, state, crash_task=w.start.faults.crash_task)
    w.add_servicers(server)
    bind(server, w.args.host, w.args.grpc_port)
    await server.start()

    def health_body() -> dict[str, Any]:
        return {
            "status": "ok" if state.serving else "not_serving",
            "problems": dict(state.problems),
            "role": w.role,
            "worker": w.start.worker_id,
            "model": w.engine.model_name,
            "agent": w.agent.name,
            "epoch": w.agent.epoch,
            "nixl_live_handles": w.agent.num_live_handles,
            "forward_age_seconds": round(w.engine.forward_age(), 3),
            "transport": w.start.transport.as_dict(),
            "rooms": w.rooms(),
            **w.health_extra(),
            **w.engine.pool_health(),
        }

    interval = w.args.watchdog_interval
    forward_timeout = w.args.forward_timeout
    w.start.status.body = health_body
    sup.watch(w.start.status.http.task, "http")
    w.poller.start(sup.spawn)
    for name, loop in w.loops.items():
        sup.start(name, loop)
    sup.spawn(run_every(interval, w.sweep, f"{w.role}-watchdog"), "watchdog")
    sup.spawn(watch_forwards(w.engine, forward_timeout, interval, state, w.on_stuck_forward, w.role), "forward-watch")
    sup.spawn(probe_loop_lag(w.start.status.metrics), "loop-lag")
    await state.start()
    w.start.status.metrics.set_serving(True)
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
    refuse_new_calls(f"{w.role} worker stopping")  # new calls, on open lanes and as RPCs (the servicers ask)
    await state.problem("stopping", "graceful stop")
    w.start.status.metrics.set_serving(False)
    log.info(f"{w.role} worker stopping: draining", rooms=w.rooms(), drain_timeout=w.args.drain_timeout)
    left = await drain(w.rooms, w.args.drain_timeout)
    log.info(f"{w.role} worker drained" if left == 0 else f"{w.role} worker stopping with rooms left", rooms=left)
    await server.stop(grace=1)  # what is left (the lanes themselves, rooms past the drain) is cancelled
    sup.stopping = True  # tasks ending from here on is the plan, not a failure
    await sup.stop()
    for hook in w.on_stop:
        await hook()
    await w.poller.stop()
    w.agent.close()
    w.engine.shutdown()
    await w.start.status.http.stop()  # last: scrapes and probes see the drain to its end


async def drain(rooms: Callable[[], int], timeout: float) -> int:
    """Wait until no room is held or `timeout` passed; returns the rooms still held."""
    deadline = time.monotonic() + timeout
    while (left := rooms()) and time.monotonic() < deadline:
        await asyncio.sleep(DRAIN_POLL)
    return left
