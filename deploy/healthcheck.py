#!/usr/bin/env python3
"""Container health check for every pdmesh role: exit 0 when /health answers 200, else 1.

One image runs all three roles, so the check finds out which one runs here and on which port:

1. ``PDMESH_HEALTH_URL`` if set (e.g. http://127.0.0.1:8081/health), else
2. the command line of the ``python -m services.<role>`` process in this container
   (``--http-port`` for workers, ``--port`` for the router), else
3. that flag's PDMESH_* environment twin, else the role's default port.

A router serving HTTPS itself (``--ssl-certfile`` or its twin) is asked over HTTPS, without
checking its certificate (this is the container asking its own process, under whatever name the
certificate holds). One that requires client certificates (``--ssl-cert-reqs 2``) cannot be
asked this way: give such a container a health check of its own.

Standard library only (it runs every few seconds; it must not import torch).
"""

from __future__ import annotations

import os
import pathlib
import ssl
import sys
import urllib.error
import urllib.request

DEFAULT_PORTS = {"prefill": 8081, "decode": 8082, "router": 8000}
PORT_FLAG = {"prefill": "--http-port", "decode": "--http-port", "router": "--port"}
PORT_ENV = {"prefill": "PDMESH_HTTP_PORT", "decode": "PDMESH_HTTP_PORT", "router": "PDMESH_PORT"}


def role_and_port(argv: list[str], env: dict[str, str]) -> tuple[str, int] | None:
    """(role, HTTP port) of a pdmesh service started with this argv, or None if it is not one."""
    role = None
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m" and argv[i + 1].startswith("services."):
            role = argv[i + 1].split(".", 1)[1]
            break
    if role not in DEFAULT_PORTS:
        return None
    flag = PORT_FLAG[role]
    port = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            port = argv[i + 1]
        elif arg.startswith(flag + "="):
            port = arg.split("=", 1)[1]
    if port is None:
        port = env.get(PORT_ENV[role]) or DEFAULT_PORTS[role]
    return role, int(port)


def serves_tls(argv: list[str], env: dict[str, str]) -> bool:
    """Whether a router started with this argv and environment serves HTTPS (--ssl-certfile)."""
    for i, arg in enumerate(argv):
        if arg == "--ssl-certfile" and i + 1 < len(argv):
            return bool(argv[i + 1])
        if arg.startswith("--ssl-certfile="):
            return bool(arg.split("=", 1)[1])
    return bool(env.get("PDMESH_SSL_CERTFILE"))


def find_service(proc: pathlib.Path = pathlib.Path("/proc")) -> tuple[str, int, str] | None:
    """The pdmesh service running in this container (lowest pid first): (role, HTTP port, scheme)."""
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
            return role, port, "https" if role == "router" and serves_tls(args, env) else "http"
    return None


def health_url() -> str:
    url = os.environ.get("PDMESH_HEALTH_URL")
    if url:
        return url
    found = find_service()
    if found is None:
        raise RuntimeError("no `python -m services.<role>` process found in this container")
    role, port, scheme = found
    return f"{scheme}://127.0.0.1:{port}/health"


def main() -> int:
    try:
        url = health_url()
        tls = ssl._create_unverified_context() if url.startswith("https:") else None  # its own process
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
