"""A mesh on the hosts of a network-namespace `Topology`: the Launcher with the hosts placement
(hosts.py), each process inside its host's network namespace, bound to the host's address on
its role's usual ports, and the host named first in each start. Every HTTP call to a process
(`proc.get`, `proc.post`, `proc.call(fn)`) is made from an observer host, so nothing the caller
speaks to lives outside the namespaces. The chaos soak's hosts mode and tests/hosts use it.
"""

from __future__ import annotations

import pathlib

from services.launch.hosts import Hosts
from services.launch.launcher import Launcher
from services.launch.netns import Topology
from services.launch.proc import Proc


class HostMesh(Launcher):
    def __init__(self, topo: Topology, log_dir: pathlib.Path, observer: str = "observer", env: dict | None = None):
        super().__init__(log_dir=log_dir, placement=Hosts(topo, observer, env))
        self.topo = topo

    def start_worker(self, role: str, host: str, *extra: str, env: dict | None = None, wait: bool = True) -> Proc:
        return super().start_worker(role, *extra, host=host, env=env, wait=wait)

    def start_router(self, host: str, prefills: list[Proc], decodes: list[Proc], *extra: str,
                     port: int = 8000, env: dict | None = None) -> Proc:
        return super().start_router(prefills, decodes, *extra, host=host, port=port, env=env)

    def assert_invariants(self, timeout: float = 15, procs: list[Proc] | None = None) -> None:
        """Queue gauges 0, every KV pool whole, no live NIXL handle, on every live worker."""
        super().assert_invariants(timeout, procs, nixl=True)
