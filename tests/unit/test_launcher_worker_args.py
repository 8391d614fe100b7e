"""The command line the launcher gives a worker: the spec's --device unless the worker's own flags
name one, so the printed command says each flag once."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services import mesh
from services.common.listening import listening_socket
from services.launch.launcher import Launcher
from services.launch.ports import free_port
from services.launch.proc import serves_https
from services.launch.spec import MeshSpec


def worker_args(launcher: Launcher, *flags: str) -> list[str]:
    seen = []
    launcher.spawn = lambda role, args, *rest, **kw: seen.append(args)  # no process: only its command line
    launcher.start_worker("prefill", *flags, wait=False, grpc_port=50000, http_port=50001)
    return seen[0]


def test_the_spec_device_is_given_when_the_worker_names_none():
    args = worker_args(Launcher(MeshSpec((), device="cuda:3")))
    assert args.count("--device") == 1 and args[args.index("--device") + 1] == "cuda:3"


def test_a_worker_s_own_device_is_the_only_one_on_its_command_line():
    args = worker_args(Launcher(MeshSpec(())), "--device", "cuda:1")
    assert args.count("--device") == 1 and args[args.index("--device") + 1] == "cuda:1"


def test_make_run_s_mesh_names_each_worker_s_device_once():
    for service in mesh.spec("cuda:0", "cuda:1").services:
        if service.role != "router":
            args = worker_args(Launcher(mesh.spec("cuda:0", "cuda:1")), *service.flags)
            assert args.count("--device") == 1



def test_make_run_s_mesh_answers_help_and_refuses_unknown_flags_without_starting(monkeypatch, capsys):
    # the mesh has no flags (its settings are PDMESH_*): --help says so, and a flag it does not
    # know stops it before it looks for devices or starts anything
    def no_start(*_):
        raise AssertionError("the mesh went on to start")

    monkeypatch.setattr(mesh, "_devices", no_start)
    for argv, code in ((["--help"], 0), (["--port", "9000"], 2)):
        monkeypatch.setattr(sys, "argv", ["python -m services.mesh", *argv])
        with pytest.raises(SystemExit) as stopped:
            mesh.main()
        assert stopped.value.code == code
    out = capsys.readouterr()
    assert "PDMESH_ROUTER_PORT" in out.out and "unrecognized arguments: --port 9000" in out.err


def test_make_run_s_mesh_refuses_ports_already_taken_before_starting_anything(monkeypatch):
    # a second `make run` beside a first one: started anyway, its health checks would be answered
    # by the first mesh's services and it would say "ready"
    def no_start(*_):
        raise AssertionError("the mesh went on to start")

    monkeypatch.setattr(mesh, "_devices", no_start)
    monkeypatch.setattr(sys, "argv", ["python -m services.mesh"])
    free = [free_port() for _ in range(5)]
    for name, port in zip(("PREFILL_GRPC", "PREFILL_HTTP", "DECODE_GRPC", "DECODE_HTTP", "ROUTER_PORT"), free, strict=True):
        monkeypatch.setattr(mesh, name, port)
    with listening_socket("127.0.0.1", free[4], reuse_port=False) as held:
        held.listen()
        with pytest.raises(SystemExit) as stopped:
            mesh.main()
    message = str(stopped.value.code)
    assert f"127.0.0.1:{free[4]} (PDMESH_ROUTER_PORT)" in message and "Address already in use" in message
    assert all(str(port) not in message for port in free[:4])


def test_make_run_s_printed_curl_names_the_served_model_and_the_key_when_set(monkeypatch, tmp_path):
    for name in ("PDMESH_MODEL", "PDMESH_SERVED_MODEL_NAME", "PDMESH_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert '"model": "pdmesh-tiny"' in mesh.example_curl() and "Authorization" not in mesh.example_curl()
    monkeypatch.setenv("PDMESH_MODEL", str(tmp_path / "qwen-tiny"))
    assert '"model": "qwen-tiny"' in mesh.example_curl()
    monkeypatch.setenv("PDMESH_SERVED_MODEL_NAME", "chat-model,alias")
    monkeypatch.setenv("PDMESH_API_KEY", "secret")
    curl = mesh.example_curl()
    assert '"model": "chat-model"' in curl and "secret" not in curl
    assert '-H "Authorization: Bearer ${PDMESH_API_KEY%%,*}"' in curl
    # the shell makes it the first of several keys, and the key itself where there is one
    for keys, first in (("secret", "secret"), ("new-key,old-key", "new-key")):
        out = subprocess.run(["sh", "-c", 'printf %s "${PDMESH_API_KEY%%,*}"'], env={"PDMESH_API_KEY": keys},
                             capture_output=True, text=True, check=True)
        assert out.stdout == first


def test_make_run_s_mesh_names_https_when_the_router_has_a_certificate(monkeypatch):
    monkeypatch.delenv("PDMESH_SSL_CERTFILE", raising=False)
    assert mesh.router_url().startswith("http://") and "curl http://" in mesh.example_curl()
    monkeypatch.setenv("PDMESH_SSL_CERTFILE", "/certs/router.pem")
    assert mesh.router_url().startswith("https://") and "curl https://" in mesh.example_curl()


def test_the_launcher_probes_a_router_over_https_only_when_it_has_a_certificate():
    assert serves_https("router", ["--ssl-certfile", "/c.pem"], {})
    assert serves_https("router", ["--ssl-certfile=/c.pem"], {})
    assert serves_https("router", [], {"PDMESH_SSL_CERTFILE": "/c.pem"})
    assert not serves_https("router", ["--ssl-certfile", ""], {"PDMESH_SSL_CERTFILE": "/c.pem"})  # the flag wins
    assert not serves_https("router", ["--port", "8000"], {})
    assert not serves_https("prefill", [], {"PDMESH_SSL_CERTFILE": "/c.pem"})  # a worker's twin is not its own
