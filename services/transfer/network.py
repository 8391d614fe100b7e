"""Transfer settings for a real network: which address a worker advertises and which UCX
transports, devices and TCP timeouts its NIXL agent uses (docs/transfer.md "Across hosts").

UCX reads its environment when the NIXL agent creates its backend, so `configure_transport`
runs before `NixlAgent(...)`. Each flag that is set writes its UCX variable; a UCX variable
already in the environment is kept when the flag is left empty (operators may still tune UCX
directly). Pure stdlib: no nixl import.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass, field

WILDCARDS = ("", "0.0.0.0", "::", "[::]")
_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class Transport:
    advertise_host: str
    env: dict[str, str] = field(default_factory=dict)  # the UCX variables in force

    def as_dict(self) -> dict:
        return {"advertise_host": self.advertise_host, **self.env}


def advertise_host(advertise: str, bind_host: str) -> str:
    """The address peers should use: --advertise-host, else --host unless it is a wildcard,
    else this host name's address."""
    if advertise:
        return advertise
    if bind_host not in WILDCARDS:
        return bind_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return bind_host


def interface_of(address: str) -> str | None:
    """Name of the local interface holding IPv4 `address` (None when none does)."""
    try:
        target = ipaddress.ip_address(socket.gethostbyname(address))
    except (OSError, ValueError):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            if ipaddress.ip_address(socket.inet_ntoa(raw[20:24])) == target:
                return name
    return None


def configure_transport(
    advertise: str, bind_host: str, tls: str = "", net_devices: str = "", tcp_user_timeout: float = 0.0
) -> Transport:
    host = advertise_host(advertise, bind_host)
    if tls:
        os.environ["UCX_TLS"] = tls
    if net_devices == "auto":
        iface = interface_of(host)
        if iface and iface != "lo" and not ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            os.environ["UCX_NET_DEVICES"] = iface
    elif net_devices:
        os.environ["UCX_NET_DEVICES"] = net_devices
    if tcp_user_timeout > 0:
        # UCX's time syntax; applies to its TCP transport (data and active messages)
        os.environ["UCX_TCP_USER_TIMEOUT"] = f"{tcp_user_timeout:g}s"
    env = {k: os.environ[k] for k in ("UCX_TLS", "UCX_NET_DEVICES", "UCX_TCP_USER_TIMEOUT") if k in os.environ}
    return Transport(host, env)
