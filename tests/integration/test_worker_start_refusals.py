"""A worker that cannot start says why in one log line and exits EXIT_CONFIG (78), with no
traceback: a gRPC or HTTP port another process holds (at once, before the model loads, instead of
sharing the port or failing minutes later), and a model it cannot load (a missing folder, an
architecture it does not serve)."""

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
    lines = json_lines(out)
    errors = [e for e in lines if e.get("level") == "error"]
    assert out.returncode == EXIT_CONFIG, out.stdout[-2000:] + out.stderr[-2000:]
    assert len(errors) == 1 and errors[0]["port"] == ports[taken] and taken in errors[0]["event"], errors
    # refused before anything loaded or served
    assert not any("loading" in e.get("event", "") or "kv cache" in e.get("event", "") for e in lines), lines


def json_lines(out) -> list[dict]:
    return [json.loads(line) for line in out.stdout.splitlines() + out.stderr.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("role,folder,says", [
    ("prefill", "missing", "does not exist"),
    ("decode", "gpt2", "unsupported architecture"),
])
def test_a_worker_that_cannot_load_its_model_says_why_in_one_line(tmp_path, role, folder, says):
    model = tmp_path / folder
    if folder == "gpt2":
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    out = run_service(role, ["--host", "127.0.0.1", "--device", "cpu", "--log-format", "json", "--model", str(model),
                             "--grpc-port", str(free_port()), "--http-port", str(free_port())], timeout=60)
    errors = [e for e in json_lines(out) if e.get("level") == "error"]
    assert out.returncode == EXIT_CONFIG, out.stdout[-2000:] + out.stderr[-2000:]
    assert len(errors) == 1 and says in errors[0]["event"] and str(model) in errors[0]["event"], errors
    assert "Traceback" not in out.stdout + out.stderr
