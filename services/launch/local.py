"""Placement on this machine: every service a process here, on free 127.0.0.1 ports (or the
ports its spec names), reached directly."""

from __future__ import annotations

from services.launch.ports import free_port


class Local:
    health_timeout = 90.0  # a CPU worker loads the built-in model in seconds; a loaded machine needs more
    poll = 0.02
    keep_queue = True  # Proc.metrics(): a `queue`-labelled sample under its own key

    def __init__(self, bind: str = "", env: dict[str, str] | None = None):
        self.bind = bind  # --host of every service; "" leaves each service's default
        self.env = dict(env or {})

    def addr(self, host: str) -> str:
        return "127.0.0.1"

    def ports(self, role: str, host: str, grpc_port: int = 0, http_port: int = 0) -> tuple[int | None, int]:
        grpc = (grpc_port or free_port()) if role != "router" else None
        return grpc, http_port or free_port()

    def service_args(self, role: str, host: str) -> list[str]:
        return ["--host", self.bind] if self.bind else []

    def command(self, host: str, cmd: list[str]) -> list[str]:
        return cmd

    def log_name(self, role: str, host: str, n: int) -> str:
        return f"{role}-{n}.log"

    @staticmethod
    def call(fn, *args, **kwargs):
        return fn(*args, **kwargs)

    def close(self) -> None:
        pass
