"""Hosts on one machine: Linux network namespaces joined by veth pairs to a bridge, and a helper
that shapes and breaks the links between any two of them.

    topo = Topology.create(["router", "p1", "p2", "d1", "d2", "outside"])
    topo.addr("p1")                       # "10.77.0.11"
    topo.links.partition("p1", "d1")      # both directions (nftables DROP in each host)
    topo.links.partition("p1", "d1", one_way=True)   # p1 -> d1 dropped, d1 -> p1 passes
    topo.links.heal("p1", "d1")
    topo.links.cap("p1", "1gbit")         # egress of p1 (tc tbf on its interface)
    topo.links.loss("p1", "d1", 0.005)    # random loss p1 -> d1 (nftables numgen random)
    topo.links.link_down("d1") / link_up("d1")
    topo.links.delay("p1", "20ms")        # tc netem; raises NetemMissing where the kernel lacks it
    topo.destroy()

Layout: a "switch" namespace holds the bridge `br0`; each host namespace holds `eth0` (its
address in 10.77.<net>.0/24) whose peer `v-<host>` sits on the bridge. Nothing touches the
machine's own interfaces or addresses: every address lives inside namespaces created here, and
`destroy()` (also registered with atexit) deletes them all, which removes every veth, rule and
qdisc with them. Namespace names carry a per-run prefix, so concurrent runs never collide.

Usable from the tests (tests/hosts/conftest.py) and from the chaos soak (`Links` only needs
namespace names and addresses).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

CLONE_NEWNET = 0x40000000


class NetemMissing(RuntimeError):
    """This kernel has no `netem` qdisc, so added delay cannot be tested here."""


def run(*cmd: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, input=input)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def unsupported_reason() -> str | None:
    """Why host tests cannot run here (None when they can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "nft", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (Debian packages iproute2, nftables, util-linux)"
    probe = f"pdmprobe{os.getpid()}"
    p = run("ip", "netns", "add", probe, check=False)
    if p.returncode != 0:
        return f"`ip netns add` does not work here: {p.stderr.strip()}"
    try:
        p = run("ip", "netns", "exec", probe, "nft", "add", "table", "inet", "probe", check=False)
        if p.returncode != 0:
            return f"nftables does not work in a namespace here: {p.stderr.strip()}"
    finally:
        run("ip", "netns", "del", probe, check=False)
    return None


def ns_exec(ns: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return run("ip", "netns", "exec", ns, *cmd, check=check)


@dataclass
class Links:
    """Shape and break links between hosts. `ns` maps host -> namespace, `addr` host -> IPv4."""

    ns: dict[str, str]
    addr: dict[str, str]
    iface: str = "eth0"
    _tables: set[str] = field(default_factory=set)

    # --- nftables: one table per host namespace, one chain per hook ---------------------------
    def _table(self, host: str) -> None:
        if host in self._tables:
            return
        script = (
            "table inet pdmesh {\n"
            "  chain out { type filter hook output priority 0; policy accept; }\n"
            "  chain in { type filter hook input priority 0; policy accept; }\n"
            "}\n"
        )
        p = subprocess.run(["ip", "netns", "exec", self.ns[host], "nft", "-f", "-"], input=script,
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"nft table in {host}: {p.stderr.strip()}")
        self._tables.add(host)

    def _rule(self, host: str, chain: str, rule: str) -> None:
        self._table(host)
        ns_exec(self.ns[host], "nft", "add", "rule", "inet", "pdmesh", chain, *rule.split())

    def block(self, src: str, dst: str) -> None:
        """Drop every packet from src to dst (src's output and dst's input)."""
        self._rule(src, "out", f"ip daddr {self.addr[dst]} drop comment \"cut-{dst}\"")
        self._rule(dst, "in", f"ip saddr {self.addr[src]} drop comment \"cut-{src}\"")

    def partition(self, a: str, b: str, one_way: bool = False) -> None:
        """Cut a <-> b (one_way: only a -> b; b's packets still reach a)."""
        self.block(a, b)
        if not one_way:
            self.block(b, a)

    def loss(self, src: str, dst: str, fraction: float) -> None:
        """Drop a random `fraction` of the packets from src to dst (nftables numgen random)."""
        per_mille = round(fraction * 100_000)
        self._rule(src, "out",
                   f"ip daddr {self.addr[dst]} numgen random mod 100000 < {per_mille} drop comment \"loss-{dst}\"")

    def heal(self, a: str | None = None, b: str | None = None) -> None:
        """Remove every drop/loss rule (between a and b when given, else everywhere)."""
        for host in list(self._tables):
            if a is not None and host not in (a, b):
                continue
            for chain in ("out", "in"):
                ns_exec(self.ns[host], "nft", "flush", "chain", "inet", "pdmesh", chain)

    # --- tc: egress shaping on a host's interface ---------------------------------------------
    def cap(self, host: str, rate: str, burst: str = "256kb", latency: str = "50ms") -> None:
        """Limit host's egress to `rate` (e.g. "1gbit") with a token bucket filter."""
        ns_exec(self.ns[host], "tc", "qdisc", "replace", "dev", self.iface, "root", "tbf",
                "rate", rate, "burst", burst, "latency", latency)

    def uncap(self, host: str) -> None:
        ns_exec(self.ns[host], "tc", "qdisc", "del", "dev", self.iface, "root", check=False)

    def delay(self, host: str, delay: str) -> None:
        p = ns_exec(self.ns[host], "tc", "qdisc", "replace", "dev", self.iface, "root", "netem",
                    "delay", delay, check=False)
        if p.returncode != 0:
            raise NetemMissing(f"tc netem is not available in this kernel: {p.stderr.strip()}")

    # --- the whole link -------------------------------------------------------------------
    def link_down(self, host: str) -> None:
        ns_exec(self.ns[host], "ip", "link", "set", self.iface, "down")

    def link_up(self, host: str) -> None:
        ns_exec(self.ns[host], "ip", "link", "set", self.iface, "up")

    def bytes(self, host: str) -> tuple[int, int]:
        """(rx, tx) bytes of host's interface."""
        base = f"/sys/class/net/{self.iface}/statistics"
        out = ns_exec(self.ns[host], "cat", f"{base}/rx_bytes", f"{base}/tx_bytes").stdout.split()
        return int(out[0]), int(out[1])


@dataclass
class Topology:
    prefix: str
    hosts: dict[str, str]  # host -> namespace
    addrs: dict[str, str]  # host -> IPv4
    switch: str
    links: Links
    _destroyed: bool = False

    @classmethod
    def create(cls, hosts: list[str], net: int | None = None) -> Topology:
        prefix = f"pdm{os.getpid()}"
        reap_stale()
        net = 77 if net is None else net
        switch = f"{prefix}-sw"
        names = {h: f"{prefix}-{h}" for h in hosts}
        addrs = {h: f"10.{net}.{(os.getpid() % 200) + 10}.{10 + i}" for i, h in enumerate(hosts)}
        topo = cls(prefix, names, addrs, switch, Links(names, addrs))
        atexit.register(topo.destroy)
        try:
            run("ip", "netns", "add", switch)
            ns_exec(switch, "ip", "link", "add", "br0", "type", "bridge")
            ns_exec(switch, "ip", "link", "set", "br0", "up")
            ns_exec(switch, "ip", "link", "set", "lo", "up")
            for h, ns in names.items():
                run("ip", "netns", "add", ns)
                ns_exec(ns, "ip", "link", "set", "lo", "up")
                # create the pair inside the host namespace, then move the bridge end
                ns_exec(ns, "ip", "link", "add", "eth0", "type", "veth", "peer", "name", f"v-{h}")
                ns_exec(ns, "ip", "link", "set", f"v-{h}", "netns", switch)
                ns_exec(ns, "ip", "addr", "add", f"{addrs[h]}/24", "dev", "eth0")
                ns_exec(ns, "ip", "link", "set", "eth0", "up")
                ns_exec(switch, "ip", "link", "set", f"v-{h}", "master", "br0")
                ns_exec(switch, "ip", "link", "set", f"v-{h}", "up")
        except Exception:
            topo.destroy()
            raise
        return topo

    def addr(self, host: str) -> str:
        return self.addrs[host]

    def ns(self, host: str) -> str:
        return self.hosts[host]

    def wrap(self, host: str, cmd: list[str], own_ipc_uts: bool = True) -> list[str]:
        """`cmd` run inside host's network namespace, with its own IPC and UTS namespaces and
        hostname (so UCX treats the peers as remote hosts instead of copying through CMA)."""
        if not own_ipc_uts:
            return ["ip", "netns", "exec", self.hosts[host], *cmd]
        hostname = f"{self.prefix}-{host}"
        script = 'hostname "$0" && exec "$@"'
        return ["ip", "netns", "exec", self.hosts[host], "unshare", "--ipc", "--uts", "--",
                "sh", "-c", script, hostname, *cmd]

    def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        for ns in [*self.hosts.values(), self.switch]:
            # processes left inside would keep the namespace's veth alive: kill them first
            p = run("ip", "netns", "pids", ns, check=False)
            for pid in p.stdout.split():
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            run("ip", "netns", "del", ns, check=False)


def reap_stale() -> list[str]:
    """Delete the namespaces of earlier runs whose process is gone (a SIGKILLed pytest runs no
    finalizer): names pdm<pid>-..., where no process <pid> exists any more."""
    gone = []
    for line in run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.match(r"^pdm(\d+)-", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}") and int(m.group(1)) != os.getpid():
            for pid in run("ip", "netns", "pids", name, check=False).stdout.split():
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            run("ip", "netns", "del", name, check=False)
            gone.append(name)
    return gone


def leftover_namespaces(prefix: str) -> list[str]:
    out = run("ip", "netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in out if line.startswith(prefix)]


# --- calls from the test process into a namespace ---------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)


def enter_thread(ns: str) -> None:
    """Move the calling thread (and the threads it starts afterwards) into `ns`'s network
    namespace; other threads of the process stay where they are."""
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}): {os.strerror(err)}")
    finally:
        os.close(fd)


class NsThread:
    """Threads that live in a host's network namespace (setns is per thread): `call(fn)`
    runs fn there, so the test process can speak HTTP to the hosts from, e.g., an observer
    host without any address outside the namespaces."""

    def __init__(self, ns: str):
        self._pool = ThreadPoolExecutor(max_workers=8, initializer=enter_thread, initargs=(ns,))

    def call(self, fn, *args, **kwargs):
        return self._pool.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
