"""A worker whose gRPC or HTTP port another process holds exits at once (EXIT_CONFIG) with the
port named, before it loads its model, instead of sharing the port or failing minutes later."""

from __future__ import annotations

import json

import pytest

from services.common.bind_guard import EXIT_CONFIG
from services.common.listening import listening_socket
from services.launch.ports import free_port
from services.launch.proc import run_service

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("role,taken", [("prefill", "--grpc-port"), ("decode", "--http-port")])
def test_a_worker_refuses_a_port_another_process_holds(role, taken):
    ports = {"--grpc-port": free_port(), "--http-port": free_port()}
    with listening_socket("127.0.0.1", ports[taken], reuse_port=False) as held:
        held.listen()
        out = run_service(role, ["--host", "127.0.0.1", "--device", "cpu", "--log-format", "json",
                                 *(str(x) for kv in ports.items() for x in kv)], timeout=60)
    lines = [json.loads(line) for line in out.stdout.splitlines() + out.stderr.splitlines() if line.startswith("{")]
    errors = [e for e in lines if e.get("level") == "error"]
    assert out.returncode == EXIT_CONFIG, out.stdout[-2000:] + out.stderr[-2000:]
    assert len(errors) == 1 and errors[0]["port"] == ports[taken] and taken in errors[0]["event"], errors
    # refused before anything loaded or served
    assert not any("loading" in e.get("event", "") or "kv cache" in e.get("event", "") for e in lines), lines
