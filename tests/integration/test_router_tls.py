"""The router serving HTTPS itself (--ssl-keyfile, --ssl-certfile; vLLM's flags), as a real
process in front of fake workers, with certificates made by the real openssl: the openai SDK
streams and completes over it, with one process and with several; a connection that never
finishes its handshake is dropped after --header-timeout, plain HTTP sent to it gets a 400 saying so, and 300 of them against a router with
192 descriptors' worth of connections leave room for new clients; a reader that stalls is cut off; client certificates are required when
asked; the containers' health check and a real Prometheus ask it over HTTPS; bad TLS settings end the router with
one line naming the flag."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from services.common.bind_guard import EXIT_CONFIG
from services.launch.launcher import Launcher
from services.launch.ports import free_port
from services.launch.probes import wait_for
from services.launch.proc import run_service
from tests.integration.test_deploy_prometheus_live import Prometheus, config_for
from tests.unit.test_deploy_compose import need_tool

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed (Debian package openssl)"),
]

MODEL = "pdmesh-tiny"
ROOT = Path(__file__).resolve().parents[2]


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1 it signed, and a client certificate it signed."""
    d = tmp_path_factory.mktemp("tls")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=pdmesh test CA", cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, ext in (("server", ["-extfile", "server.ext"]), ("client", [])):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN=pdmesh test {name}", cwd=d)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", *ext, cwd=d)
    return d


def trusting(certs: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(certs / "ca.pem"))


def https_router(mesh: Launcher, certs: Path, *extra: str, port: int = 0, verify: ssl.SSLContext | None = None,
                 prefix: tuple[str, ...] = ()):
    """The router over HTTPS, its URL and a client that trusts it (with `verify`: that client's
    TLS context), once it answers."""
    _, prefill, decode = mesh.start_fake_workers()
    router = mesh.start_router([prefill], [decode], "--ssl-keyfile", str(certs / "server.key"),
                               "--ssl-certfile", str(certs / "server.pem"), *extra, port=port, wait=False,
                               prefix=prefix)
    url = f"https://127.0.0.1:{router.http_port}"
    client = httpx.Client(verify=verify or trusting(certs), timeout=10)

    def healthy() -> bool:
        assert router.popen.poll() is None, router.log()[-2000:]
        try:
            return client.get(url + "/health").status_code == 200
        except httpx.TransportError:
            return False

    wait_for(healthy, 30, "the router to answer over HTTPS")
    return router, url, client


def completes_and_streams(url: str, client: httpx.Client) -> None:
    sdk = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, http_client=client)
    whole = sdk.completions.create(model=MODEL, prompt="hi", max_tokens=4).choices[0].text
    streamed = "".join(e.choices[0].text for e in sdk.completions.create(model=MODEL, prompt="hi", max_tokens=4,
                                                                          stream=True))
    assert whole and streamed == whole


def running(url: str, client: httpx.Client) -> float:
    text = client.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdmesh:router_num_running_reqs"))


def test_https_serves_the_api_and_drops_a_handshake_that_never_comes(tmp_path, certs):
    with Launcher(log_dir=tmp_path) as mesh:
        router, url, client = https_router(mesh, certs, "--header-timeout", "1")
        completes_and_streams(url, client)
        silent = socket.create_connection(("127.0.0.1", router.http_port), timeout=10)  # no ClientHello
        t0 = time.monotonic()
        assert silent.recv(1) == b"" and time.monotonic() - t0 < 5
        silent.close()
        # plain HTTP on the HTTPS port: a 400 that says so, as nginx answers there
        plain = httpx.post(f"http://127.0.0.1:{router.http_port}/v1/completions", timeout=5,
                           json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
        assert plain.status_code == 400 and plain.json()["error"]["code"] == "https_required", plain.text
        assert "https://" in plain.json()["error"]["message"]
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the certificate
            httpx.get(url + "/health", timeout=5)
        completes_and_streams(url, client)  # none of that hurt the next client
        # the containers' health check asks its own HTTPS router without checking the certificate
        check = subprocess.run([sys.executable, str(ROOT / "deploy" / "healthcheck.py")], capture_output=True,
                               text=True, timeout=30, env={**os.environ, "PDMESH_HEALTH_URL": url + "/health"})
        assert check.returncode == 0, check.stderr
        assert running(url, client) == 0
        assert "Traceback" not in router.log()


def test_handshakes_never_finished_do_not_keep_clients_out(tmp_path, certs):
    # 300 connections that never send a ClientHello, more than the router's descriptors (a hard
    # open-files limit of 256 leaves it 192 connections): each handshake counts as a connection,
    # so the longest-waiting ones make room for new clients instead of exhausting the descriptors
    with Launcher(log_dir=tmp_path) as mesh:
        router, url, client = https_router(mesh, certs, "--header-timeout", "60", prefix=("prlimit", "--nofile=256:256"))
        silent = [socket.create_connection(("127.0.0.1", router.http_port), timeout=10) for _ in range(300)]
        try:
            t0 = time.monotonic()
            for _ in range(3):
                with httpx.Client(verify=trusting(certs), timeout=10) as fresh:
                    completes_and_streams(url, fresh)
            assert time.monotonic() - t0 < 10
            assert router.metrics().get("pdmesh:router_client_cutoffs_total", 0) >= 100
        finally:
            for s in silent:
                s.close()
        assert running(url, client) == 0


def test_a_stopping_https_router_is_not_held_by_idle_clients(tmp_path, certs):
    # an idle keep-alive client reads nothing, so it never answers the router's close_notify, and a
    # handshake never finished never ends by itself: neither holds the stop for long
    with Launcher(log_dir=tmp_path) as mesh:
        router, url, client = https_router(mesh, certs, "--header-timeout", "60")
        completes_and_streams(url, client)
        assert client.get(url + "/health").status_code == 200  # its connection stays open, idle
        silent = socket.create_connection(("127.0.0.1", router.http_port), timeout=10)
        try:
            t0 = time.monotonic()
            router.popen.send_signal(signal.SIGTERM)
            router.popen.wait(timeout=20)
            assert time.monotonic() - t0 < 8, time.monotonic() - t0
        finally:
            silent.close()


def test_a_stalled_reader_over_https_is_cut_off(tmp_path, certs):
    # the front door's bounds act on the TLS transport as on a plain one
    with Launcher(log_dir=tmp_path) as mesh:
        router, url, client = https_router(mesh, certs, "--max-buffered-tokens", "8")
        raw = socket.socket()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: it sets the window
        raw.settimeout(10)
        raw.connect(("127.0.0.1", router.http_port))
        s = trusting(certs).wrap_socket(raw, server_hostname="127.0.0.1")
        try:
            body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 8000, "ignore_eos": True, "n": 4,
                               "stream": True}).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            assert s.recv(64).startswith(b"HTTP/1.1 200 ")  # then nothing more is read
            wait_for(lambda: router.metrics().get("pdmesh:router_client_cutoffs_total", 0) >= 1, 30,
                     "the router to cut the stalled reader off")
            wait_for(lambda: running(url, client) == 0, 10, "its slots to be freed")
        finally:
            s.close()
        completes_and_streams(url, client)


def test_prometheus_scrapes_a_router_over_https(tmp_path, certs):
    need_tool("prometheus", "prometheus")
    with Launcher(log_dir=tmp_path) as mesh:
        router, url, client = https_router(mesh, certs)
        completes_and_streams(url, client)
        cfg = config_for({"pdmesh-router": f"127.0.0.1:{router.http_port}"})
        cfg["scrape_configs"][0].update(scheme="https", tls_config={"ca_file": str(certs / "ca.pem")})
        prom = Prometheus(tmp_path, cfg)
        try:
            prom.wait_ready()
            wait_for(lambda: prom.query('up{job="pdmesh-router"} == 1')
                     and prom.query('pdmesh:router_requests_total{status="200"} >= 2'), 30,
                     "Prometheus to scrape the router's /metrics over HTTPS")
        finally:
            prom.close()


def test_https_with_several_processes(tmp_path, certs):
    with Launcher(log_dir=tmp_path) as mesh:
        router, url, client = https_router(mesh, certs, "--processes", "2", port=free_port())
        for _ in range(4):  # new connections, spread over the processes by the kernel
            with httpx.Client(verify=trusting(certs), timeout=10) as fresh:
                completes_and_streams(url, fresh)
        assert running(url, client) == 0


def test_the_launcher_waits_for_a_router_made_https_by_its_environment(tmp_path, certs):
    # what `make run` does with PDMESH_SSL_* in deploy/pdmesh.env: the flags' twins, no flags
    with Launcher(log_dir=tmp_path) as mesh:
        _, prefill, decode = mesh.start_fake_workers()
        router = mesh.start_router([prefill], [decode], env={"PDMESH_SSL_KEYFILE": str(certs / "server.key"),
                                                             "PDMESH_SSL_CERTFILE": str(certs / "server.pem")})
        assert router.http_url.startswith("https://")  # waited for over HTTPS
        completes_and_streams(router.http_url, httpx.Client(verify=trusting(certs), timeout=10))
        assert router.metrics()["pdmesh:router_num_running_reqs"] == 0


def test_client_certificates_when_required(tmp_path, certs):
    known = trusting(certs)
    known.load_cert_chain(str(certs / "client.pem"), str(certs / "client.key"))
    with Launcher(log_dir=tmp_path) as mesh:
        _, url, client = https_router(mesh, certs, "--ssl-ca-certs", str(certs / "ca.pem"), "--ssl-cert-reqs", "2",
                                      verify=known)
        completes_and_streams(url, client)
        with pytest.raises(httpx.TransportError):  # no client certificate: the handshake fails
            httpx.get(url + "/health", verify=trusting(certs), timeout=5).raise_for_status()
        # the containers' health check presents one (PDMESH_HEALTH_CERTFILE / KEYFILE), or fails without
        check = [sys.executable, str(ROOT / "deploy" / "healthcheck.py")]
        env = {**os.environ, "PDMESH_HEALTH_URL": url + "/health"}
        assert subprocess.run(check, capture_output=True, timeout=30, env=env).returncode == 1
        env.update(PDMESH_HEALTH_CERTFILE=str(certs / "client.pem"), PDMESH_HEALTH_KEYFILE=str(certs / "client.key"))
        done = subprocess.run(check, capture_output=True, text=True, timeout=30, env=env)
        assert done.returncode == 0, done.stderr
        assert running(url, client) == 0


@pytest.mark.parametrize(("flags", "says"), [
    (["--ssl-keyfile", "{d}/server.key"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-keyfile", "{d}/client.key", "--ssl-certfile", "{d}/server.pem"], "cannot load --ssl-certfile"),
    (["--ssl-keyfile", "{d}/server.key", "--ssl-certfile", "{d}/missing.pem"], "missing.pem"),
    (["--ssl-keyfile", "{d}/server.key", "--ssl-certfile", "{d}/server.pem", "--ssl-cert-reqs", "2"],
     "needs --ssl-ca-certs"),
    (["--ssl-cert-reqs", "1"], "need --ssl-keyfile and --ssl-certfile"),
], ids=["key_alone", "key_not_of_cert", "missing_file", "reqs_without_ca", "reqs_without_tls"])
def test_bad_tls_settings_end_the_router_with_one_line(certs, flags, says):
    argv = [a.format(d=certs) for a in flags]
    done = run_service("router", ["--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2", "--port", str(free_port()),
                                  *argv])
    assert done.returncode == EXIT_CONFIG, done.stderr[-2000:]
    assert says in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
