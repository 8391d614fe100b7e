"""Worker addresses from `--prefill` / `--decode` specs: an IP literal is one worker; a name is
every address it resolves to (a Kubernetes headless Service answers with one address per ready
pod), re-resolved periodically so pods that come and go join and leave the pool.

Each resolved address is a worker of its own, and decode is handed the chosen prefill's own
address, so it attaches to the very process that holds the room.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable

Resolver = Callable[[str, int], Awaitable[list[str]]]


def split_host_port(spec: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); raises ValueError with the spec named."""
    host, sep, port = spec.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"worker address {spec!r} is not host:port")
    return host.strip("[]"), int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


async def system_resolver(host: str, port: int) -> list[str]:
    """Every address of `host` (IPv4 preferred; IPv6 only when there is no IPv4)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    v4 = sorted({info[4][0] for info in infos if info[0] == socket.AF_INET})
    v6 = sorted({info[4][0] for info in infos if info[0] == socket.AF_INET6})
    return [join_host_port(ip, port) for ip in (v4 or v6)]


async def resolve_specs(
    specs: list[str], resolver: Resolver = system_resolver
) -> tuple[list[tuple[str, str]], list[str]]:
    """([(address, spec it came from)], specs that failed to resolve), in spec order."""
    found: list[tuple[str, str]] = []
    failed: list[str] = []
    for spec in specs:
        host, port = split_host_port(spec)
        if is_ip(host):
            addrs = [join_host_port(host, port)]
        else:
            try:
                addrs = await resolver(host, port)
            except OSError:
                failed.append(spec)
                continue
        seen = {a for a, _ in found}
        found.extend((a, spec) for a in addrs if a not in seen)
    return found, failed
