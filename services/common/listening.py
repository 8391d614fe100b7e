"""Listening sockets, and whether a port is free to listen on.

A worker checks its ports before it loads its model, so a port already taken (a second mesh on
this machine, a worker still running) fails in a second with the port named, not after minutes
of loading, and never by sharing the port: gRPC's servers would otherwise set SO_REUSEPORT, and
the kernel would then spread the router's connections over both processes.
"""

from __future__ import annotations

import socket


def listening_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A bound TCP socket; with `reuse_port`, one of several on the same port (the router's
    `--processes N`)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


def port_taken(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on (e.g. "[Errno 98] Address already in use"), or None
    when it can. Port 0 (any free port) is always free. Connections of an earlier process left in
    TIME_WAIT do not count, as for the servers' own binds (SO_REUSEADDR)."""
    if port == 0:
        return None
    try:
        listening_socket(host, port, reuse_port=False).close()
    except OSError as e:
        return str(e)
    return None
