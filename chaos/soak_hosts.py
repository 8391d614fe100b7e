"""The chaos soak's hosts mode: the same router + 2 prefills + 2 decodes, each in its own network
namespace (services/launch/netns.py Topology, services/launch/host_mesh.py HostMesh), so that a
prefill and a decode can be partitioned. The clients and the soak's own HTTP calls run on threads that have entered the
`client` host's namespace: every address the soak speaks to lives inside namespaces it created.

`HostsMesh` has the interface the soak uses of services/launch's Launcher (start_worker,
start_router, restart, procs, close) plus `partition` / `heal`.
"""

from __future__ import annotations

import pathlib
import secrets
import threading

from services.launch.host_mesh import HostMesh
from services.launch.netns import Topology, enter_thread
from services.launch.proc import Proc

HOSTS = ["router", "p0", "p1", "d0", "d1", "client"]


class HostsMesh:
    def __init__(self, workdir: pathlib.Path):
        self.topo = Topology.create(HOSTS)
        try:
            # workers listen beyond loopback here: they start only with an internal token
            self.hm = HostMesh(self.topo, workdir, observer="client",
                               env={"PDMESH_INTERNAL_TOKEN": secrets.token_hex(16)})
        except Exception:
            self.topo.destroy()
            raise
        self._next = {"prefill": 0, "decode": 0}

    @property
    def procs(self) -> list[Proc]:
        return self.hm.procs

    def start_worker(self, role: str, *flags: str, wait: bool = True) -> Proc:
        host = f"{role[0]}{self._next[role]}"
        self._next[role] += 1
        return self.hm.start_worker(role, host, *flags, wait=wait)

    def start_router(self, prefills, decodes, *flags: str) -> Proc:
        return self.hm.start_router("router", prefills, decodes, *flags)

    def wait_healthy(self, proc: Proc) -> None:
        self.hm.wait_healthy(proc)

    def restart(self, proc: Proc, wait: bool = True, drop_flags=(), add_args=()) -> Proc:
        return self.hm.restart(proc, wait=wait, drop_flags=drop_flags, add_args=add_args)

    def partition(self, prefill: int, decode: int, direction: str) -> None:
        p, d = f"p{prefill}", f"d{decode}"
        if direction == "both":
            self.topo.links.partition(p, d)
        elif direction == "to_decode":
            self.topo.links.block(p, d)
        else:
            self.topo.links.block(d, p)

    def heal(self, prefill: int, decode: int) -> None:
        self.topo.links.heal(f"p{prefill}", f"d{decode}")

    def close(self) -> None:
        """Every process, then every namespace (also on failure: callers use it in finally)."""
        try:
            self.hm.close()
        finally:
            self.topo.destroy()


def run_inside(ns: str, fn):
    """fn() on a thread inside `ns`'s network namespace (threads it starts inherit it); its
    result or its exception comes back to the caller. The caller's thread stays where it is."""
    box: dict = {}

    def body():
        try:
            enter_thread(ns)
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            box["err"] = e

    t = threading.Thread(target=body, name=f"in-{ns}", daemon=True)  # a Ctrl-C in the caller still tears down
    t.start()
    t.join()
    if "err" in box:
        raise box["err"]
    return box["out"]
