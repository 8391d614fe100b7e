"""Worker discovery: names stand for every address they resolve to; the pool follows changes."""

from __future__ import annotations

import asyncio
import socket

import pytest

from services.router.discovery import resolve_specs, split_host_port, system_resolver
from services.router.pool import WorkerPool


def test_split_host_port():
    assert split_host_port("10.0.0.5:50051") == ("10.0.0.5", 50051)
    assert split_host_port("[::1]:7") == ("::1", 7)
    assert split_host_port("pdmesh-prefill:50051") == ("pdmesh-prefill", 50051)
    for bad in ("nohost", "host:", ":80", "host:http"):
        with pytest.raises(ValueError, match="host:port"):
            split_host_port(bad)


def test_localhost_resolves_with_the_system_resolver():
    found, failed = asyncio.run(resolve_specs(["localhost:5000", "127.0.0.9:6000"]))
    addrs = [a for a, _ in found]
    assert "127.0.0.1:5000" in addrs and "127.0.0.9:6000" in addrs and not failed
    with pytest.raises(OSError):
        asyncio.run(system_resolver("no-such-host.invalid", 1))


class ScriptedDNS:
    """A resolver whose answers the test sets (what a headless Service returns as pods change)."""

    def __init__(self, table):
        self.table = table

    async def __call__(self, host, port):
        if host not in self.table:
            raise socket.gaierror(socket.EAI_NONAME, "unknown")
        return [f"{ip}:{port}" for ip in self.table[host]]


def test_pool_follows_the_addresses_behind_a_name():
    dns = ScriptedDNS({"prefills": ["127.0.0.2", "127.0.0.3"], "decodes": ["127.0.0.4"]})

    async def scenario():
        pool = WorkerPool(["prefills:50051"], ["decodes:50052", "127.0.0.5:50052"], resolver=dns, timeout=0.2)
        await pool.refresh_addresses()
        assert [w.addr for w in pool.prefills] == ["127.0.0.2:50051", "127.0.0.3:50051"]
        assert [w.addr for w in pool.decodes] == ["127.0.0.4:50052", "127.0.0.5:50052"]
        first = pool.prefills[0]
        # a pod goes away, another comes
        dns.table["prefills"] = ["127.0.0.3", "127.0.0.6"]
        first.inflight = 1  # one of our requests still runs on the leaving pod
        await pool.refresh_addresses()
        assert [w.addr for w in pool.prefills] == ["127.0.0.3:50051", "127.0.0.6:50051"]
        assert first in pool._retired  # its channel stays open for the request in flight
        first.inflight = 0
        # the name stops resolving (DNS hiccup): the known workers stay
        del dns.table["prefills"]
        await pool.refresh_addresses()
        assert [w.addr for w in pool.prefills] == ["127.0.0.3:50051", "127.0.0.6:50051"]
        assert first not in pool._retired  # closed once idle
        await pool.close()

    asyncio.run(scenario())
