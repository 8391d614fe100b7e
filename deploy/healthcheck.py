#!/usr/bin/env python3
"""Container health check for every pdmesh role: exit 0 when /health answers 200, else 1.

One image runs all three roles, so the check finds out which one runs here and on which port:

1. ``PDMESH_HEALTH_URL`` if set (e.g. http://127.0.0.1:8081/health), else
2. the command line of the ``python -m services.<role>`` process in this container
   (``--http-port`` for workers, ``--port`` for the router), else
3. that flag's PDMESH_* environment twin, else the role's default port.

A router serving HTTPS itself (``--ssl-certfile`` or its twin) is asked over HTTPS, without
checking its certificate (this is the container asking its own process, under whatever name the
certificate holds). The check presents a client certificate when ``PDMESH_HEALTH_CERTFILE`` and
``PDMESH_HEALTH_KEYFILE`` name one, and otherwise, to a router that requires them
(``--ssl-cert-reqs 2``), the router's own certificate and key: that passes where the router's
certificate is signed by a CA of its ``--ssl-ca-certs`` and may authenticate a client.

Standard library only (it runs every few seconds; it must not import torch).
"""

from __future__ import annotations

import os
import pathlib
import ssl
import sys
import urllib.error
import urllib.request
from typing import NamedTuple

DEFAULT_PORTS = {"prefill": 8081, "decode": 8082, "router": 8000}
PORT_FLAG = {"prefill": "--http-port", "decode": "--http-port", "router": "--port"}


def role_and_port(argv: list[str], env: dict[str, str]) -> tuple[str, int] | None:
    """(role, HTTP port) of a pdmesh service started with this argv, or None if it is not one."""
    role = None
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m" and argv[i + 1].startswith("services."):
            role = argv[i + 1].split(".", 1)[1]
            break
    if role not in DEFAULT_PORTS:
        return None
    return role, int(flag_value(argv, env, PORT_FLAG[role]) or DEFAULT_PORTS[role])


class Service(NamedTuple):
    role: str
    port: int
    scheme: str  # http, or https for a router serving it
    client_pair: tuple[str, str] | None = None  # (certificate, key) to present, if any


def flag_value(argv: list[str], env: dict[str, str], flag: str) -> str:
    """A flag's value on this command line (the last one given), else its PDMESH_* twin, else ""."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    if value is None:
        value = env.get("PDMESH_" + flag.lstrip("-").upper().replace("-", "_"), "")
    return value


def serves_tls(argv: list[str], env: dict[str, str]) -> bool:
    """Whether a router started with this argv and environment serves HTTPS (--ssl-certfile)."""
    return bool(flag_value(argv, env, "--ssl-certfile"))


def client_pair(argv: list[str], env: dict[str, str], own_env: dict[str, str]) -> tuple[str, str] | None:
    """The client certificate and key the check presents to this router (the module's docstring)."""
    if own_env.get("PDMESH_HEALTH_CERTFILE") and own_env.get("PDMESH_HEALTH_KEYFILE"):
        return own_env["PDMESH_HEALTH_CERTFILE"], own_env["PDMESH_HEALTH_KEYFILE"]
    if flag_value(argv, env, "--ssl-cert-reqs").strip() == "2":
        return flag_value(argv, env, "--ssl-certfile"), flag_value(argv, env, "--ssl-keyfile")
    return None


def find_service(proc: pathlib.Path = pathlib.Path("/proc"), own_env: dict[str, str] | None = None) -> Service | None:
    """The pdmesh service running in this container (lowest pid first)."""
    pids = sorted(int(p.name) for p in proc.iterdir() if p.name.isdigit())
    for pid in pids:
        try:
            argv = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")
            env_raw = (proc / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        env = dict(e.decode(errors="replace").split("=", 1) for e in env_raw if b"=" in e)
        found = role_and_port(args, env)
        if found:
            role, port = found
            if role == "router" and serves_tls(args, env):
                return Service(role, port, "https", client_pair(args, env, os.environ if own_env is None else own_env))
            return Service(role, port, "http")
    return None


def health_url() -> tuple[str, tuple[str, str] | None]:
    """The URL to ask, and the client certificate and key to present there (or None)."""
    url = os.environ.get("PDMESH_HEALTH_URL")
    if url:
        return url, client_pair([], {}, dict(os.environ))
    found = find_service()
    if found is None:
        raise RuntimeError("no `python -m services.<role>` process found in this container")
    return f"{found.scheme}://127.0.0.1:{found.port}/health", found.client_pair


def main() -> int:
    try:
        url, pair = health_url()
        tls = None
        if url.startswith("https:"):
            tls = ssl._create_unverified_context()  # its own process, under whatever name its certificate holds
            if pair is not None:
                tls.load_cert_chain(*pair)
        with urllib.request.urlopen(url, timeout=float(os.environ.get("PDMESH_HEALTH_TIMEOUT", "4")),
                                    context=tls) as resp:
            body = resp.read(4096).decode(errors="replace")
            ok = resp.status == 200
    except urllib.error.HTTPError as e:
        print(f"unhealthy: {e.code} from {e.url}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - any failure is "unhealthy"
        print(f"unhealthy: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(body.strip()[:500])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
