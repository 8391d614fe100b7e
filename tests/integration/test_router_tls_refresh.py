"""A renewed certificate served without a restart (--enable-ssl-refresh, vLLM's flag), by a real
router process in front of fake workers, with certificates made by the real openssl: a half-
written pair (the new certificate with the old key) leaves the previous certificate served and
counted as a failed reload, the key landing next puts the new pair in service for new
connections while a connection already open keeps going, and a router without the flag keeps
what it read at start; a Kubernetes-style secret mount (files through a `..data` symlink that is
swapped) is followed by every one of --processes 2; the CA file is read again too, so a client
certificate from a newly trusted CA is accepted."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
from pathlib import Path

import httpx
import pytest

from services.common.bind_guard import EXIT_CONFIG
from services.launch.launcher import Launcher
from services.launch.ports import free_port
from services.launch.probes import labelled_samples, wait_for
from services.launch.proc import run_service
from tests.integration.test_router_tls import (
    certs,
    completes_and_streams,
    https_router,
    openssl,
    running,
    trusting,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed (Debian package openssl)"),
]

__all__ = ["certs"]  # the module's CA and first server certificate (a fixture, used by name)


def mint(ca_dir: Path, out: Path, name: str, *, server: bool = True) -> tuple[Path, Path]:
    """A new key and certificate called `name`, signed by the CA in `ca_dir` (its key and pem)."""
    out.mkdir(parents=True, exist_ok=True)
    ext = ["-extfile", str(ca_dir / "server.ext")] if server else []
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}", cwd=out)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", str(ca_dir / "ca.pem"), "-CAkey", str(ca_dir / "ca.key"),
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", *ext, cwd=out)
    return out / f"{name}.key", out / f"{name}.pem"


def served_name(port: int, ca: Path) -> str:
    """The common name of the certificate a new connection to the router is given."""
    ctx = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
        return dict(pair[0] for pair in s.getpeercert()["subject"])["commonName"]


def replace_file(src: Path, dst: Path) -> None:
    """`dst` becomes `src`'s content in one step, as a deploy tool writes it."""
    tmp = dst.with_name(dst.name + ".new")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def reloads(url: str, client: httpx.Client, outcome: str) -> float:
    return sum(v for labels, v in labelled_samples(client.get(url + "/metrics").text, "pdmesh:router_tls_reloads_total")
               if labels["outcome"] == outcome)


def failing(url: str, client: httpx.Client) -> float:
    return sum(v for _, v in labelled_samples(client.get(url + "/metrics").text, "pdmesh:router_tls_reload_failing"))


def test_a_renewed_certificate_is_served_to_new_connections(tmp_path, certs):
    live = tmp_path / "live"
    live.mkdir()
    for name in ("server.key", "server.pem", "ca.pem"):
        shutil.copyfile(certs / name, live / name)
    renewed_key, renewed_pem = mint(certs, tmp_path / "renewed", "pdmesh renewed")
    first, served_by = "pdmesh test server", ""
    with Launcher(log_dir=tmp_path) as mesh:
        router, url, client = https_router(mesh, live, "--enable-ssl-refresh")
        fixed, fixed_url, fixed_client = https_router(mesh, live)  # the same files, no flag
        completes_and_streams(url, client)  # its connection stays open across the renewal
        assert served_name(router.http_port, live / "ca.pem") == first

        # half-written: the new certificate with the old key does not load, the old pair is still served
        replace_file(renewed_pem, live / "server.pem")
        wait_for(lambda: reloads(url, client, "failed") >= 1, 10, "the router to try the changed files")
        assert served_name(router.http_port, live / "ca.pem") == first
        with httpx.Client(verify=trusting(live), timeout=10) as fresh:
            completes_and_streams(url, fresh)
        assert "still serving the previous certificate" in router.log()
        assert failing(url, client) == 1

        replace_file(renewed_key, live / "server.key")  # the pair is whole: new connections get it
        wait_for(lambda: served_name(router.http_port, live / "ca.pem") == "pdmesh renewed", 10,
                 "the renewed certificate to be served")
        assert reloads(url, client, "reloaded") == 1 and reloads(url, client, "failed") == 1
        assert failing(url, client) == 0
        with httpx.Client(verify=trusting(live), timeout=10) as fresh:
            completes_and_streams(url, fresh)
        completes_and_streams(url, client)  # the connection opened before the renewal still serves
        served_by = served_name(fixed.http_port, live / "ca.pem")
        completes_and_streams(fixed_url, fixed_client)
        assert running(url, client) == 0
        assert "Traceback" not in router.log()
    assert served_by == first  # without the flag the certificate read at start stays


def test_a_swapped_secret_mount_reaches_every_process_and_the_ca_is_read_again(tmp_path, certs):
    # a Kubernetes secret volume: each file is a symlink through ..data, and an update points
    # ..data at a new folder in one rename
    other_ca = tmp_path / "other-ca"
    other_ca.mkdir()
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=pdmesh other CA", cwd=other_ca)
    client_key, client_pem = mint(other_ca, tmp_path / "client", "client of the other CA", server=False)
    mount = tmp_path / "mount"

    def publish(version: str, key: Path, pem: Path, cas: list[Path]) -> None:
        folder = mount / f"..{version}"
        folder.mkdir(parents=True)
        shutil.copyfile(key, folder / "server.key")
        shutil.copyfile(pem, folder / "server.pem")
        (folder / "ca.pem").write_bytes(b"".join(ca.read_bytes() for ca in cas))
        link = mount / "..data.new"
        link.symlink_to(folder.name)
        os.replace(link, mount / "..data")

    publish("v1", certs / "server.key", certs / "server.pem", [certs / "ca.pem"])
    for name in ("server.key", "server.pem", "ca.pem"):
        (mount / name).symlink_to(Path("..data") / name)
    renewed_key, renewed_pem = mint(certs, tmp_path / "renewed", "pdmesh renewed")

    other_client = trusting(certs)
    other_client.load_cert_chain(str(client_pem), str(client_key))
    with Launcher(log_dir=tmp_path) as mesh:
        router, url, client = https_router(
            mesh, mount, "--enable-ssl-refresh", "--processes", "2", "--ssl-ca-certs", str(mount / "ca.pem"),
            "--ssl-cert-reqs", "1", port=free_port())
        with pytest.raises(httpx.TransportError):  # a certificate from a CA not yet trusted
            httpx.get(url + "/health", verify=other_client, timeout=5).raise_for_status()

        publish("v2", renewed_key, renewed_pem, [certs / "ca.pem", other_ca / "ca.pem"])
        # each new connection lands on either process (the kernel spreads them): all must have reloaded
        wait_for(lambda: all(served_name(router.http_port, certs / "ca.pem") == "pdmesh renewed" for _ in range(12)),
                 15, "both processes to serve the renewed certificate")
        with httpx.Client(verify=other_client, timeout=10) as newly_trusted:
            completes_and_streams(url, newly_trusted)
        assert running(url, client) == 0
        assert "Traceback" not in router.log()


def test_refresh_without_a_certificate_ends_the_router_with_one_line():
    done = run_service("router", ["--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2", "--port", str(free_port()),
                                  "--enable-ssl-refresh"])
    assert done.returncode == EXIT_CONFIG, done.stderr[-2000:]
    assert "--enable-ssl-refresh needs --ssl-keyfile" in done.stderr and "Traceback" not in done.stderr
