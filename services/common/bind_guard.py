"""Internal authentication fails closed: a worker that listens beyond loopback needs a token.

Without `--internal-token-file` / `--internal-token`, anyone who reaches a worker's gRPC port may
send it prompts, attach to its rooms or read its KV. On 127.0.0.1 only this host can; on any other
address (0.0.0.0 in a container, a pod IP) the worker refuses to start unless
`--allow-insecure-bind` says that is meant (a network that is itself closed, a test).
"""

from __future__ import annotations

import ipaddress
import socket
import sys

from services.common.logging_setup import get_logger

EXIT_CONFIG = 78  # EX_CONFIG: fix the configuration, a restart alone will not help


def is_loopback(host: str) -> bool:
    """True when every address `host` stands for is a loopback one ("" and wildcards are not)."""
    host = host.strip().strip("[]")
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def insecure_bind_refusal(host: str, has_token: bool, allow_insecure_bind: bool) -> str | None:
    """Why the worker must not start (None: it may)."""
    if has_token or allow_insecure_bind or is_loopback(host):
        return None
    return (f"refusing to listen on {host!r} without an internal token: anyone who reaches this port could "
            "use the worker. Give the same secret to the router and every worker (--internal-token-file, or "
            "PDMESH_INTERNAL_TOKEN), listen on 127.0.0.1, or pass --allow-insecure-bind if the network is closed")


def refuse_insecure_bind(role: str, host: str, has_token: bool, allow_insecure_bind: bool) -> None:
    """Exit (EXIT_CONFIG, one log line saying why) when the worker must not start."""
    refusal = insecure_bind_refusal(host, has_token, allow_insecure_bind)
    if refusal:
        get_logger(role).error(refusal, host=host)
        sys.exit(EXIT_CONFIG)
    if allow_insecure_bind and not has_token and not is_loopback(host):
        get_logger(role).warning("listening beyond loopback WITHOUT an internal token (--allow-insecure-bind)",
                                 host=host)
