"""Fixtures for the KV transfer integration tests: real OS processes running
tests/integration/transfer_peer.py with the real NIXL agent.

Every wait is on a condition with a deadline (never a fixed sleep for synchronisation) and
every process started here is killed at teardown.
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


class PeerError(AssertionError):
    pass


class PeerProc:
    """One transfer_peer.py process, driven over stdin/stdout JSON lines."""

    _ids = itertools.count(1)

    def __init__(self, role: str, *args: str, name: str | None = None):
        self.role = role
        self.name = name or role
        self.log = tempfile.NamedTemporaryFile(prefix=f"pdmesh-{self.name}-", suffix=".log", delete=False)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.transfer_peer", "--role", role, *args],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            text=True,
            bufsize=1,
        )
        self.pid = self.proc.pid
        self._cv = threading.Condition()
        self._replies: dict[int, dict] = {}
        self.events: list[dict] = []
        self._eof = False
        threading.Thread(target=self._read, daemon=True).start()
        self.ready: dict = {}

    def _read(self) -> None:
        for line in self.proc.stdout:
            if not line.startswith("@@"):
                continue
            msg = json.loads(line[2:])
            with self._cv:
                if "id" in msg and "ev" not in msg:
                    self._replies[msg["id"]] = msg
                else:
                    self.events.append(msg)
                self._cv.notify_all()
        with self._cv:
            self._eof = True
            self._cv.notify_all()

    def _wait(self, pred: Callable[[], object], timeout: float, what: str):
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                got = pred()
                if got:
                    return got
                if self._eof:
                    raise PeerError(f"{self.name} exited while waiting for {what}; log: {self.tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerError(
                        f"{self.name}: timed out after {timeout}s waiting for {what}; log: {self.tail()}"
                    )
                self._cv.wait(left)

    def tail(self, n: int = 3000) -> str:
        try:
            return pathlib.Path(self.log.name).read_text()[-n:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 90) -> dict:
        self.ready = self._wait(
            lambda: next((e for e in self.events if e.get("ev") == "ready"), None), timeout, "ready"
        )
        return self.ready

    def send(self, cmd: str, **kw) -> int:
        i = next(self._ids)
        self.proc.stdin.write(json.dumps({"id": i, "cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()
        return i

    def reply(self, i: int, timeout: float = 30) -> dict:
        r = self._wait(lambda: self._replies.pop(i, None), timeout, f"reply {i}")
        if not r.get("ok"):
            raise PeerError(f"{self.name}: command failed: {r.get('error')}\n{r.get('tb')}")
        return r

    def call(self, cmd: str, timeout: float = 30, **kw) -> dict:
        return self.reply(self.send(cmd, **kw), timeout)

    def wait_event(self, pred: Callable[[dict], bool], timeout: float = 30, what: str = "event") -> dict:
        return self._wait(lambda: next((e for e in self.events if pred(e)), None), timeout, what)

    def terminal(self, room: int, timeout: float = 30) -> dict:
        return self.wait_event(
            lambda e: e.get("ev") == "terminal" and e["room"] == room,
            timeout,
            f"terminal event of room {room}",
        )

    def wait_status(self, pred: Callable[[dict], bool], timeout: float = 10, what: str = "status") -> dict:
        deadline = time.monotonic() + timeout
        while True:
            st = self.call("status")
            if pred(st):
                return st
            if time.monotonic() > deadline:
                raise PeerError(f"{self.name}: {what} not reached in {timeout}s; last status {st}")
            time.sleep(0.05)  # polling a condition, not synchronising on time

    def wait_room(self, room: int, state: str, timeout: float = 10) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            r = self.call("room", room=room)
            if r["state"] == state:
                return r
            if time.monotonic() > deadline:
                raise PeerError(f"{self.name}: room {room} is {r['state']}, not {state}, after {timeout}s")
            time.sleep(0.02)

    def assert_whole(self, timeout: float = 10) -> dict:
        """No pages, aux rows, NIXL handles, rooms or parked attaches left over."""

        def whole(st):
            return (
                st["pages_used"] == 0
                and st["aux_used"] == 0
                and st["live_handles"] == 0
                and st["rooms"] == 0
                and st.get("pending_attach", 0) == 0
            )

        return self.wait_status(whole, timeout, "whole pool (no leaked pages/aux/handles/rooms)")

    # --- signals ------------------------------------------------------------------------
    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, sig)

    def stop(self) -> None:
        self.signal(signal.SIGSTOP)

    def cont(self) -> None:
        self.signal(signal.SIGCONT)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass

    def close(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            try:
                self.send("quit")
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        if self.proc.poll() is None:
            self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        self.log.close()
        if os.environ.get("PDMESH_KEEP_TEST_LOGS") != "1":
            try:
                os.unlink(self.log.name)
            except OSError:
                pass


class Peers:
    """Starts peers and guarantees they are all killed (try/finally via the fixture)."""

    def __init__(self):
        self.procs: list[PeerProc] = []

    def start(self, role: str, *args: str, name: str | None = None, wait: bool = True) -> PeerProc:
        p = PeerProc(role, *args, name=name)
        self.procs.append(p)
        if wait:
            p.wait_ready()
        return p

    def start_receivers(self, worker_ids: dict[str, str]) -> list[PeerProc]:
        """Receivers (name -> --worker-id) started side by side, then waited for, in that order."""
        rxs = [self.start("receiver", "--worker-id", worker_id, name=name, wait=False)
               for name, worker_id in worker_ids.items()]
        for rx in rxs:
            rx.wait_ready()
        return rxs

    def close(self) -> None:
        for p in self.procs:
            try:
                p.close()
            except Exception:  # pragma: no cover - best effort teardown
                p.kill()


@pytest.fixture
def peers():
    ps = Peers()
    try:
        yield ps
    finally:
        ps.close()


@pytest.fixture(scope="module")
def module_peers():
    ps = Peers()
    try:
        yield ps
    finally:
        ps.close()


_room_ids = itertools.count(1000)


def next_room() -> int:
    return next(_room_ids)
