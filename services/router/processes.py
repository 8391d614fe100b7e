"""Several router processes on one port (`--processes N`, N > 1), and the supervisor that runs them.

One Python process serves a request in ~0.3 ms of one core (docs/router.md, Performance), so a
router that must go past that uses more processes. Each one is a whole router — its own event
loop, worker pool, lanes and health probes — listening on the same port with SO_REUSEPORT, so the
kernel spreads new connections over them. What must be one router's and not each process's is
shared (services/router/shared_state.py, services/router/sibling_metrics.py): admission under
`--max-concurrent-requests`, each worker's in-flight load, ejections, and `/metrics`.

The supervisor serves nothing itself. It starts the processes, restarts one that dies (its row of
shared state zeroed first, with a backoff that grows while replacements keep dying young), passes
SIGTERM / SIGINT on for a graceful stop, and removes the shared folder at the end. The processes
run in their own session, so a terminal's Ctrl-C reaches them once (through the supervisor), and
the kernel kills them when the supervisor dies (a death signal set before they exec), so a
SIGKILLed router leaves no process holding the port. It also kills (then replaces) a process whose heartbeat in the shared
state has stopped for `--process-stall-timeout`, or never began within `--process-start-timeout`:
a frozen or wedged process keeps its listening socket, and the kernel would go on handing it new
connections that nobody answers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from services.common.bind_guard import EXIT_CONFIG
from services.common.listening import port_taken
from services.common.parent_death import arm_in_child
from services.router.shared_state import SharedState, state_path

ENV_INDEX = "PDMESH_ROUTER_PROCESS_INDEX"  # set by the supervisor for its processes, never by users
ENV_FOLDER = "PDMESH_ROUTER_SHARED_DIR"
ENV_SUPERVISOR = "PDMESH_ROUTER_SUPERVISOR_PID"

RESTART_MIN, RESTART_MAX = 0.5, 10.0  # seconds before a dead process is replaced (doubling)
LIVED_LONG = 10.0  # a process that served this long resets the backoff
STOP_MARGIN = 5.0  # seconds a process gets past its --shutdown-timeout before the supervisor kills it
FOLDER_PREFIX = "pdmesh-router-"
_REPO = str(Path(__file__).resolve().parents[2])


def remove_abandoned(parent: str) -> None:
    """Shared folders of supervisors that were killed (SIGKILL leaves them behind)."""
    for folder in Path(parent).glob(FOLDER_PREFIX + "*"):
        try:
            pid = int((folder / "supervisor.pid").read_text())
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except (OSError, ValueError):
            continue  # being created, or not ours to judge


def child_identity() -> tuple[int, str, int] | None:
    """(index, shared folder, supervisor pid) when this process was started by a supervisor."""
    if ENV_INDEX not in os.environ:
        return None
    return int(os.environ[ENV_INDEX]), os.environ[ENV_FOLDER], int(os.environ[ENV_SUPERVISOR])


class Supervisor:
    def __init__(self, argv: list[str], processes: int, host: str, port: int, log, stall_timeout: float = 10.0,
                 start_timeout: float = 60.0, stop_grace: float = 60.0 + STOP_MARGIN):
        self.argv, self.processes, self.host, self.port, self.log = argv, processes, host, port, log
        self.stall_timeout, self.start_timeout = stall_timeout, start_timeout
        self.stop_grace = stop_grace  # after SIGTERM: the processes' --shutdown-timeout and a margin
        self.children: list[subprocess.Popen | None] = [None] * processes
        self.started = [0.0] * processes
        self.backoff = [RESTART_MIN] * processes
        self.due: list[float | None] = [None] * processes  # when a dead process is replaced
        self.stop_signal: int | None = None
        self.refused: int | None = None  # a process exited EXIT_CONFIG: its settings are every process's
        self._arm = arm_in_child(os.getpid())  # the supervisor has no threads: preexec_fn is safe

    def run(self) -> int:
        # the port must be free before any start: the processes share it with SO_REUSEPORT, and a
        # check that set it too would let another router's processes (same user) share it with ours
        why = port_taken(self.host, self.port)
        if why:
            self.log.error("cannot bind the router's port", host=self.host, port=self.port, error=why)
            return 1
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        remove_abandoned(shm)
        self.folder = tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir=shm)
        try:
            Path(self.folder, "supervisor.pid").write_text(str(os.getpid()))
            SharedState.create(state_path(self.folder), self.processes)
            self.state = SharedState(state_path(self.folder), self.processes, 0)
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
            for i in range(self.processes):
                self._spawn(i)
            self.log.info("router processes started", processes=self.processes, port=self.port,
                          pids=[c.pid for c in self.children if c is not None])
            while self.stop_signal is None and self.refused is None:
                self._tend()
                time.sleep(0.1)
            return self._stop()
        finally:
            for child in self.children:
                if child is not None and child.poll() is None:
                    child.kill()
                    child.wait()
            shutil.rmtree(self.folder, ignore_errors=True)

    def _on_signal(self, signum, _frame) -> None:
        self.stop_signal = signum

    def _spawn(self, i: int) -> None:
        env = {**os.environ, ENV_INDEX: str(i), ENV_FOLDER: self.folder, ENV_SUPERVISOR: str(os.getpid())}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, env.get("PYTHONPATH", "")) if p)
        self.children[i] = subprocess.Popen([sys.executable, "-m", "services.router", *self.argv], env=env,
                                            start_new_session=True, preexec_fn=self._arm)
        self.started[i] = time.monotonic()
        self.due[i] = None

    def _tend(self) -> None:
        now = time.monotonic()
        for i, child in enumerate(self.children):
            if self.due[i] is not None:
                if now >= self.due[i]:
                    self._spawn(i)
                    self.log.info("router process replaced", process=i, pid=self.children[i].pid)
                continue
            code = child.poll()
            if code is None:
                age = self.state.heartbeat_age(i)
                if age is not None and age > self.stall_timeout:
                    self.log.error("router process stopped beating; killing it", process=i, pid=child.pid,
                                   silent_s=round(age, 1))
                    child.kill()  # reaped and replaced at the next round, as any death
                elif age is None and now - self.started[i] > self.start_timeout:
                    # frozen or stuck before its loop ran: it may already hold its socket
                    self.log.error("router process never began beating; killing it", process=i, pid=child.pid,
                                   starting_s=round(now - self.started[i], 1))
                    child.kill()
                continue
            self.state.clear_row(i)  # what it had admitted and in flight no longer counts
            if code == EXIT_CONFIG:  # a replacement would refuse the same settings: stop, and say so
                self.log.error("router process refused its settings; stopping the router", process=i,
                               pid=child.pid, exit_code=code)
                self.refused = code
                return
            lived = now - self.started[i]
            self.backoff[i] = RESTART_MIN if lived >= LIVED_LONG else min(RESTART_MAX, self.backoff[i] * 2)
            self.due[i] = now + self.backoff[i]
            self.log.error("router process died; replacing it", process=i, pid=child.pid, exit_code=code,
                           lived_s=round(lived, 1), restart_in_s=self.backoff[i])

    def _stop(self) -> int:
        self.log.info("router stopping", signal=signal.Signals(self.stop_signal).name if self.stop_signal else None)
        live = [c for c in self.children if c is not None and c.poll() is None]
        for child in live:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace
        for child in live:
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.log.warning("router process did not stop in time; killing it", pid=child.pid)
                child.kill()
                child.wait()
        return self.refused or 0
