"""What a mesh is made of, written down before anything starts: which services, on which hosts,
with which model, flags, environment and ports.

    spec = MeshSpec.pd(prefills=2, decodes=1, router_flags=("--policy", "round_robin"))
    with Launcher(spec) as mesh:
        mesh.router.http_url

A port of 0 lets the placement choose (a free port on this machine, the role's usual port on a
namespace host). The router of a spec is sent to every prefill and decode of the same spec.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WORKER_ROLES = ("prefill", "decode")
ROLES = (*WORKER_ROLES, "router")


@dataclass(frozen=True)
class Service:
    role: str  # prefill | decode | router
    flags: tuple[str, ...] = ()  # after the launcher's own (--grpc-port, --device, ...): a flag here wins
    env: dict[str, str] = field(default_factory=dict)
    host: str = ""  # a Topology host (hosts placement); "" on this machine
    grpc_port: int = 0  # workers only
    http_port: int = 0  # the router's serving port, a worker's status port

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r} (one of {', '.join(ROLES)})")


@dataclass(frozen=True)
class MeshSpec:
    services: tuple[Service, ...]
    model: str = ""  # --model of every service when set; "" leaves each service's default (builtin)
    device: str = "cpu"  # --device of every worker; a worker's own flags may name another
    env: dict[str, str] = field(default_factory=dict)  # every process's, under each service's own
    parent_death: bool = False  # children SIGKILLed when the launcher dies (single-threaded launchers only)
    stop_grace: float = 0.0  # seconds between SIGTERM and SIGKILL on stop; 0 kills at once
    health_timeout: float = 0.0  # seconds a service has to become healthy; 0: the placement's default

    @classmethod
    def pd(cls, prefills: int = 1, decodes: int = 1, prefill_flags: tuple[str, ...] = (),
           decode_flags: tuple[str, ...] = (), router_flags: tuple[str, ...] = (), router: bool = True,
           **kw) -> MeshSpec:
        """P prefills, D decodes and (unless router=False) a router in front of all of them."""
        services = [*(Service("prefill", tuple(prefill_flags)) for _ in range(prefills)),
                    *(Service("decode", tuple(decode_flags)) for _ in range(decodes))]
        if router:
            services.append(Service("router", tuple(router_flags)))
        return cls(tuple(services), **kw)

    def of_role(self, role: str) -> list[Service]:
        return [s for s in self.services if s.role == role]
