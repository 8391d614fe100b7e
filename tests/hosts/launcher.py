"""The host tests' mesh: services/launch's Launcher with the hosts placement
(services/launch/hosts.py), each process inside its host's network namespace of a `Topology`,
bound to the host's address on its role's usual ports. The test process reaches their HTTP
ports from an observer host (`proc.get`, `proc.post`, `proc.call(fn)`).
"""

from __future__ import annotations

import pathlib

from services.launch.hosts import GRPC_PORT, HOST_ENV, HTTP_PORT, Hosts
from services.launch.launcher import Launcher
from services.launch.netns import Topology
from services.launch.proc import ROOT, Proc

__all__ = ["GRPC_PORT", "HOST_ENV", "HTTP_PORT", "ROOT", "HostMesh", "HostProc"]

HostProc = Proc  # a process on a host: Proc with `host`, `addr` and calls made from the observer


class HostMesh(Launcher):
    def __init__(self, topo: Topology, tmp_path: pathlib.Path, observer: str = "observer", env: dict | None = None):
        super().__init__(log_dir=tmp_path, placement=Hosts(topo, observer, env))
        self.topo, self.tmp_path = topo, tmp_path

    def start_worker(self, role: str, host: str, *extra: str, env: dict | None = None, wait: bool = True) -> Proc:
        return super().start_worker(role, *extra, host=host, env=env, wait=wait)

    def start_router(self, host: str, prefills: list[Proc], decodes: list[Proc], *extra: str,
                     port: int = 8000, env: dict | None = None) -> Proc:
        return super().start_router(prefills, decodes, *extra, host=host, port=port, env=env)

    def assert_invariants(self, timeout: float = 15, procs: list[Proc] | None = None) -> None:
        """Queue gauges 0, every KV pool whole, no live NIXL handle, on every live worker."""
        super().assert_invariants(timeout, procs, nixl=True)
