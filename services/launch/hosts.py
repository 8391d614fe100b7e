"""Placement on the hosts of a `Topology` (services/launch/netns.py): each service inside its
host's network namespace, with its own IPC/UTS namespaces and hostname, bound to the host's
address on its role's usual ports. The launcher reaches their HTTP ports from an observer host
through `NsThread`, so nothing it speaks to lives outside the namespaces."""

from __future__ import annotations

from services.launch.netns import NsThread, Topology

GRPC_PORT = {"prefill": 50051, "decode": 50052}
HTTP_PORT = {"prefill": 8081, "decode": 8082, "router": 8000}

# The transfer settings of a real network (docs/transfer.md "Across hosts"): a partitioned
# peer's WRITE fails in seconds, not after Linux's TCP retries (minutes).
HOST_ENV = {"PDMESH_TRANSFER_TCP_USER_TIMEOUT": "5"}


class Hosts:
    health_timeout = 120.0  # every worker of a host test loads at once, each in its own namespaces
    poll = 0.1
    keep_queue = False  # Proc.metrics(): every sample summed under its name

    def __init__(self, topo: Topology, observer: str = "observer", env: dict[str, str] | None = None):
        self.topo = topo
        self.obs = NsThread(topo.ns(observer))
        self.env = {**HOST_ENV, **(env or {})}

    def addr(self, host: str) -> str:
        return self.topo.addr(host)

    def ports(self, role: str, host: str, grpc_port: int = 0, http_port: int = 0) -> tuple[int | None, int]:
        grpc = (grpc_port or GRPC_PORT[role]) if role in GRPC_PORT else None
        return grpc, http_port or HTTP_PORT[role]

    def service_args(self, role: str, host: str) -> list[str]:
        args = ["--host", self.addr(host)]
        if role in GRPC_PORT:
            # a small pool (six hosts' workers share one machine) and a name that says where it runs
            args += ["--num-pages", "512", "--worker-id", f"{role}-{host}"]
        return args

    def command(self, host: str, cmd: list[str]) -> list[str]:
        return self.topo.wrap(host, cmd)

    def log_name(self, role: str, host: str, n: int) -> str:
        return f"{role}-{host}-{n}.log"

    def call(self, fn, *args, **kwargs):
        return self.obs.call(fn, *args, **kwargs)

    def close(self) -> None:
        self.obs.close()
