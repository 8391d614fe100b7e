"""`--processes N`: several router processes on one port under a supervisor, as a user runs it
(`python -m services.router ... --processes 2`), in front of fake gRPC workers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.bind_guard import EXIT_CONFIG
from services.common.listening import listening_socket
from services.fakes.workers import Behaviour, FakeDecode, FakePrefill
from services.launch.ports import free_port
from services.launch.proc import run_service, service_command, spawn
from services.router.processes import ENV_INDEX, FOLDER_PREFIX
from services.router.shared_state import SharedState, state_path
from tests.unit.test_router_app import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

BODY = {"model": "pdmesh-tiny", "prompt": "hi", "max_tokens": 3}


class Fakes:
    """A fake prefill and decode on an event loop in a background thread."""

    def __init__(self) -> None:
        self.prefill, self.decode = FakePrefill(), FakeDecode()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        for w in (self.prefill, self.decode):
            asyncio.run_coroutine_threadsafe(w.start(), self.loop).result(10)

    def close(self) -> None:
        for w in (self.prefill, self.decode):
            asyncio.run_coroutine_threadsafe(w.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Router:
    def __init__(self, fakes: Fakes, *extra: str, processes: int = 2, wait: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"pdmesh-router-processes-{self.port}.log"
        self.proc = spawn(
            service_command("router", ["--port", str(self.port), "--prefill", fakes.prefill.addr,
                                       "--decode", fakes.decode.addr, "--processes", str(processes),
                                       "--log-format", "json", "--health-check-interval", "0.2", *extra]),
            self.log_path,
        )
        self.processes = processes
        if wait:
            wait_for(self.all_serving, 60, "every router process to serve")

    def children(self) -> list[int]:
        try:
            text = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        except FileNotFoundError:
            return []
        return [int(p) for p in text.split()]

    def heartbeats(self) -> list[float | None]:
        """Each process's heartbeat age from the supervisor's shared folder (None: not beating yet)."""
        for folder in Path("/dev/shm").glob(FOLDER_PREFIX + "*"):
            with contextlib.suppress(OSError, ValueError):
                if int((folder / "supervisor.pid").read_text()) == self.proc.pid:
                    state = SharedState(state_path(str(folder)), self.processes, 0)
                    try:
                        return [state.heartbeat_age(i) for i in range(self.processes)]
                    finally:
                        state.close()
        return [None] * self.processes

    def metrics(self) -> dict:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        return {f.name: f for f in text_string_to_metric_families(text)}

    def all_serving(self) -> bool:
        assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
        try:
            if httpx.get(self.url + "/health", timeout=2).status_code != 200:
                return False
            if self.metrics()["pdmesh:router_processes_scraped"].samples[0].value != self.processes:
                return False
            return None not in self.heartbeats()  # and each one's loop is running
        except (httpx.HTTPError, KeyError):
            return False

    def per_process(self, family: str, suffix: str = "_total") -> dict[str, float]:
        f = self.metrics()[family]
        return {s.labels["worker"]: s.value for s in f.samples if s.name.endswith(suffix)}

    def assert_settled(self, fakes: Fakes) -> None:
        """Nothing left in flight: every process's running gauge at 0, every fake's RPCs ended."""
        def settled() -> bool:
            running = self.per_process("pdmesh:router_num_running_reqs", suffix="reqs")
            return (len(running) == self.processes and all(v == 0 for v in running.values())
                    and fakes.prefill.seen.active == 0 and fakes.decode.seen.active == 0)

        wait_for(settled, 10, "the router and the fake workers to hold nothing in flight")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def assert_serving_again(r: Router, fakes: Fakes, logged: str) -> None:
    """After a process was replaced: every process serves, the supervisor logged why, 16 requests
    on connections of their own all succeed, and nothing is left in flight."""
    try:
        wait_for(r.all_serving, 30, "every router process to serve again")
    except AssertionError as e:
        raise AssertionError(f"{e}; the supervisor's log ends:\n{r.log_path.read_text()[-3000:]}") from None
    assert logged in r.log_path.read_text()
    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda _: post_new_connection(r.url), range(16)))
    assert codes == [200] * 16
    r.assert_settled(fakes)


def started_child(r: Router) -> int:
    """The first router process, as soon as it has exec'd (its environment is the one the supervisor
    gave it). Not before: stopped between fork and exec, a child holds up the supervisor's Popen,
    which waits for the exec, and before exec its death signal may not be armed yet."""
    first = wait_for(lambda: r.children()[:1], 10, "the supervisor to start its processes")[0]
    wait_for(lambda: f"{ENV_INDEX}=".encode() in Path(f"/proc/{first}/environ").read_bytes(), 10,
             "the first process to exec")
    return first


def process_gone(pid: int) -> bool:
    """Exited: no such process, or a zombie (it holds no port; with its parent gone, init reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


@pytest.fixture
def fakes():
    f = Fakes()
    yield f
    f.close()


@pytest.fixture
def routers():
    made: list[Router] = []
    yield made
    for r in made:
        r.stop()


def post_new_connection(url: str, body: dict = BODY) -> int:
    """One request on a connection of its own, so the kernel picks a process for it."""
    with httpx.Client(timeout=30) as client:
        return client.post(url + "/v1/completions", json=body).status_code


def test_the_processes_share_the_port_and_one_metrics(fakes, routers):
    r = Router(fakes)
    routers.append(r)
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda _: post_new_connection(r.url), range(48)))
    assert codes == [200] * 48
    served = r.per_process("pdmesh:router_num_requests")
    assert len(served) == 2 and all(n > 0 for n in served.values()), served  # both processes served
    assert sum(served.values()) == 48
    assert httpx.get(r.url + "/v1/models", timeout=5).status_code == 200
    r.assert_settled(fakes)


def test_max_concurrent_requests_bounds_the_whole_router(fakes, routers):
    fakes.decode.behaviour = Behaviour(delay=4.0)  # each admitted request holds its slot for 4 s
    r = Router(fakes, "--max-concurrent-requests", "3")
    routers.append(r)
    with ThreadPoolExecutor(9) as pool:
        codes = sorted(pool.map(lambda _: post_new_connection(r.url), range(9)))
    assert codes == [200] * 3 + [429] * 6, codes
    assert sum(r.per_process("pdmesh:router_num_requests").values()) == 3
    r.assert_settled(fakes)

@pytest.mark.long

def test_the_shared_budget_counts_choices(fakes, routers):
    fakes.decode.behaviour = Behaviour(delay=4.0)  # each admitted choice holds its slot for 4 s
    r = Router(fakes, "--max-concurrent-requests", "6")
    routers.append(r)
    assert post_new_connection(r.url, {**BODY, "n": 7}) == 400  # more than the whole router ever serves
    with ThreadPoolExecutor(6) as pool:  # 6 requests of 2 choices on both processes: 3 fit in the budget
        codes = sorted(pool.map(lambda _: post_new_connection(r.url, {**BODY, "n": 2}), range(6)))
    assert codes == [200] * 3 + [429] * 3, codes
    r.assert_settled(fakes)


def test_a_dead_process_is_replaced_and_the_router_keeps_serving(fakes, routers):
    r = Router(fakes)
    routers.append(r)
    before = r.children()
    assert len(before) == 2
    os.kill(before[0], signal.SIGKILL)
    wait_for(lambda: len(set(r.children()) - set(before)) == 1, 30, "the dead process to be replaced")
    assert_serving_again(r, fakes, "router process died; replacing it")


def test_a_frozen_process_is_killed_and_replaced(fakes, routers):
    """SIGSTOP: the process keeps its socket, so the kernel would keep handing it connections
    nobody answers; its heartbeat stops and the supervisor replaces it within the stall timeout."""
    r = Router(fakes, "--process-stall-timeout", "1.5")
    routers.append(r)
    before = r.children()
    os.kill(before[0], signal.SIGSTOP)
    t0 = time.monotonic()
    wait_for(lambda: before[0] not in r.children() and len(r.children()) == 2, 15,
             "the frozen process to be replaced")
    assert time.monotonic() - t0 < 8
    assert_serving_again(r, fakes, "router process stopped beating; killing it")

@pytest.mark.long

def test_a_process_frozen_while_starting_is_killed_and_replaced(fakes, routers):
    """SIGSTOP before its first heartbeat (it may already hold its socket): the supervisor counts
    from its start and replaces it after --process-start-timeout. The bound leaves a loaded machine
    room to import a healthy process (a replacement that is itself slower than the bound is killed
    too, and the mesh never settles)."""
    r = Router(fakes, "--process-start-timeout", "8", "--process-stall-timeout", "60", wait=False)
    routers.append(r)
    first = started_child(r)
    os.kill(first, signal.SIGSTOP)  # within ms of its exec: it is still importing
    try:
        wait_for(lambda: first not in r.children() and len(r.children()) == 2, 30,
                 "the process frozen while starting to be replaced")
        assert_serving_again(r, fakes, "router process never began beating; killing it")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(first, signal.SIGKILL)  # whatever the outcome, no stopped process is left behind

@pytest.mark.long

def test_a_process_frozen_while_starting_dies_with_a_killed_supervisor(fakes, routers):
    """The death signal is armed before the child execs Python: a child frozen while importing
    (before it could arm it itself) still dies when the supervisor is SIGKILLed."""
    r = Router(fakes, wait=False)
    routers.append(r)
    first = started_child(r)
    os.kill(first, signal.SIGSTOP)
    try:
        r.proc.kill()
        r.proc.wait(10)
        wait_for(lambda: process_gone(first), 10, "the frozen process to die with its supervisor")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(first, signal.SIGKILL)


def test_sigterm_stops_every_process_and_removes_the_shared_folder(fakes, routers):
    r = Router(fakes)
    routers.append(r)
    children = r.children()
    folders = {f for f in Path("/dev/shm").glob("pdmesh-router-*")
               if (f / "supervisor.pid").read_text() == str(r.proc.pid)}
    r.proc.send_signal(signal.SIGTERM)
    assert r.proc.wait(30) == 0
    assert not any(Path(f"/proc/{pid}").exists() for pid in children)
    assert not any(f.exists() for f in folders)


def test_a_killed_supervisor_takes_its_processes_with_it(fakes, routers):
    r = Router(fakes)
    routers.append(r)
    children = r.children()
    r.proc.kill()
    r.proc.wait(10)

    wait_for(lambda: all(process_gone(pid) for pid in children), 10,
             "the router processes to die with their supervisor")
    # nothing answers on the port: refused, or (rarely, once a parallel test has taken the freed
    # port number for a socket of its own) reset
    with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
        httpx.get(r.url + "/health", timeout=2)


@pytest.mark.parametrize("reuse_port", [False, True], ids=["plain", "another-router-s-processes"])
def test_a_taken_port_fails_at_start(fakes, routers, reuse_port):
    # also a port held by another router's processes, which would take a process of ours into their share
    with listening_socket("127.0.0.1", free_port(), reuse_port=reuse_port) as s:
        s.listen()
        port = s.getsockname()[1]
        out = run_service("router", ["--port", str(port), "--prefill", fakes.prefill.addr, "--decode",
                                     fakes.decode.addr, "--processes", "2", "--log-format", "json"])
    assert out.returncode == 1 and "cannot bind the router's port" in out.stderr + out.stdout


@pytest.mark.parametrize("processes", ["1", "2"])
def test_a_tokenizer_that_cannot_load_stops_the_router_with_one_line(fakes, tmp_path, processes):
    # a replacement process would refuse the same settings: the supervisor stops instead of
    # restarting processes forever
    out = run_service("router", ["--port", str(free_port()), "--prefill", fakes.prefill.addr, "--decode",
                                 fakes.decode.addr, "--processes", processes, "--model", str(tmp_path / "gone"),
                                 "--log-format", "json"], timeout=60)
    text = out.stdout + out.stderr
    assert out.returncode == EXIT_CONFIG and "Traceback" not in text, text[-3000:]
    assert "cannot set up the served model" in text and str(tmp_path / "gone") in text
    if processes == "2":
        assert "refused its settings; stopping the router" in text and "replacing it" not in text


@pytest.mark.parametrize("flags, why", [
    (("--override-generation-config", '{"temperature": 3}'),
     "--override-generation-config: temperature must be a number from 0.0 to 2.0, got 3"),
    (("--max-logprobs", "21"), "--max-logprobs must be between 0 and 20"),
    # the stored responses are one process's memory: a follow-up on another would not find them
    (("--responses-store-size", "8", "--processes", "2"), "--responses-store-size needs --processes 1"),
])
def test_a_bad_served_model_control_stops_the_router_with_one_line(fakes, flags, why):
    out = run_service("router", ["--port", str(free_port()), "--prefill", fakes.prefill.addr, "--decode",
                                 fakes.decode.addr, *flags, "--log-format", "json"], timeout=60)
    text = out.stdout + out.stderr
    assert out.returncode == EXIT_CONFIG and "Traceback" not in text, text[-3000:]
    assert why in text


@pytest.mark.parametrize("flags", [("--processes", "0"), ("--processes", "2", "--port", "0"),
                                   ("--processes", "2", "--process-start-timeout", "0"),
                                   ("--processes", "2", "--process-stall-timeout", "-1")])
def test_impossible_process_counts_are_refused(flags):
    out = run_service("router", ["--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2", "--log-format", "json",
                                 *flags])
    assert out.returncode == 2 and "--processes" in out.stderr, out.stderr[-2000:]


def test_a_frozen_decode_costs_clients_nothing_with_two_router_processes(mesh):
    """Real workers behind --processes 2: SIGSTOP a decode under load. Each process stops using it
    (its own probes and stall rule, and the other's ejection, shared), every request succeeds,
    both processes show it ejected, and after SIGCONT the queues and pages end whole."""
    from tests.integration.test_router_mesh import DECODE_FLAGS, PREFILL_FLAGS, ROUTER_FLAGS, ClientLoad

    p = mesh.start_prefill(*PREFILL_FLAGS, wait=False)
    ds = [mesh.start_decode(*DECODE_FLAGS, wait=False) for _ in range(2)]
    for w in (p, *ds):
        mesh.wait_healthy(w)
    r = mesh.start_router([p], ds, *ROUTER_FLAGS, "--processes", "2", "--stream-stall-timeout", "2",
                          "--request-timeout", "30")

    def healthy_in_each_process(addr: str) -> list[float]:
        text = httpx.get(r.http_url + "/metrics", timeout=5).text
        fam = {f.name: f for f in text_string_to_metric_families(text)}["pdmesh:worker_healthy"]
        return [s.value for s in fam.samples if s.labels["target"] == addr]

    wait_for(lambda: healthy_in_each_process(ds[0].grpc_addr) == [1.0, 1.0], 30, "both processes to admit both decodes")
    load = ClientLoad(r.http_url, max_tokens=24, http_timeout=40, clients=6)
    try:
        wait_for(lambda: load.successes_since(0) >= 8, 60, "load to flow")
        t_stop = time.monotonic()
        ds[0].stop()  # SIGSTOP
        wait_for(lambda: healthy_in_each_process(ds[0].grpc_addr) == [0.0, 0.0], 15,
                 "both router processes to eject the frozen decode")
        wait_for(lambda: load.successes_since(t_stop + 3) >= 12, 60, "requests to keep succeeding on the other decode")
    finally:
        ds[0].cont()
        load.stop(60)
    failed = [detail for _, _, ok, detail in load.results if not ok]
    assert not failed, f"requests failed across the freeze: {failed[:3]}"
    wait_for(lambda: healthy_in_each_process(ds[0].grpc_addr) == [1.0, 1.0], 30, "the thawed decode to be re-admitted")
    mesh.assert_invariants()
