"""The one NIXL agent of a worker process. The only module in pdmesh that imports nixl.

- One agent per process, named ``pdmesh-<role>-<host>-<pid>-<epoch>`` (epoch: per start).
- Created with ``enable_prog_thread=False``: the owner (the worker's asyncio loop, through
  services/transfer/poller.py) drives UCX progress by polling ``check_xfer_state`` and
  ``get_new_notifs``. With NIXL's progress thread small writes stalled ~8 ms each here
  (docs/transfer.md has the numbers). UCX progress is needed on *both* sides: a WRITE only
  completes at the sender after the receiver's worker has progressed, so the receiver polls
  too while it waits for KV.
- The KV pool tensor and the aux rows are registered once, at construction.
- Every NIXL call that can raise is wrapped: the caller gets a :class:`NixlError` and fails
  the one room concerned; nothing here raises past the owning room.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

import numpy as np
import torch

from services.common.logging_setup import get_logger
from services.transfer.descriptors import Desc
from services.transfer.wire_format import MemoryKind, MemoryLayout, NixlError, agent_name, new_epoch

log = get_logger("transfer.nixl")

# The wheel is nixl-cu12 (module nixl_cu12; requirements.txt); with a CUDA 13 build of torch,
# nixl-cu13 (module nixl_cu13) is preferred when installed (scripts/gpu_check.py, docs/gpu.md).
_NIXL_MODULES = ("nixl_cu13", "nixl_cu12") if (torch.version.cuda or "").startswith("13") else ("nixl_cu12", "nixl_cu13")
for _name in _NIXL_MODULES:
    try:
        _api = importlib.import_module(f"{_name}._api")
        nixl_agent, nixl_agent_config = _api.nixl_agent, _api.nixl_agent_config
        nixlRemoteDisconnectError = importlib.import_module(f"{_name}._bindings").nixlRemoteDisconnectError
        break
    except ImportError:
        continue
else:  # pragma: no cover - exercised only on broken installs
    raise ImportError("pdmesh needs the nixl-cu12 package (module nixl_cu12), or nixl-cu13 with a CUDA 13 "
                      "torch; see requirements.txt")


def _route_nixl_logging() -> None:
    """nixl's Python logger prints INFO lines to *stdout* with its own handler; send its records
    through the process's logging configuration instead (stdout stays clean for JSON output)."""
    lg = logging.getLogger("nixl")
    for h in list(lg.handlers):
        lg.removeHandler(h)
    lg.propagate = True
    if lg.level == logging.NOTSET or lg.level < logging.WARNING:
        lg.setLevel(logging.WARNING)


_route_nixl_logging()


def _wrap(what: str, e: BaseException) -> NixlError:
    return NixlError(
        f"{what}: {type(e).__name__}: {e}", disconnected=isinstance(e, nixlRemoteDisconnectError)
    )


@dataclass(eq=False)
class Xfer:
    """A posted (or about to be posted) transfer and its NIXL handle."""

    handle: object
    peer: str
    nbytes: int
    ndescs: int
    released: bool = False
    release_error: str = ""  # why NIXL refused the last release (the handle is deferred)


def _mem_kind(t: torch.Tensor) -> tuple[MemoryKind, int]:
    if t.device.type == "cuda":
        return MemoryKind.VRAM, t.device.index or 0
    if t.device.type == "cpu":
        return MemoryKind.DRAM, 0
    raise ValueError(f"NIXL cannot register memory on device {t.device}")


class NixlAgent:
    """Owns the process's NIXL agent, its registered memory and its remote peers.

    Not thread-safe: call it from the thread that owns the worker's event loop.
    """

    def __init__(
        self,
        role: str,
        kv: torch.Tensor,
        aux: torch.Tensor,
        *,
        epoch: int | None = None,
        backends: tuple[str, ...] = ("UCX",),
        name: str | None = None,
    ):
        if not kv.is_contiguous() or not aux.is_contiguous():
            raise ValueError("kv and aux must be contiguous tensors")
        if aux.device.type != "cpu":
            raise ValueError("aux rows must live in host memory")
        self.epoch = new_epoch() if epoch is None else epoch
        self.name = name or agent_name(role, self.epoch)
        self.role = role
        cfg = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
        try:
            self._agent = nixl_agent(self.name, cfg)
            for b in backends:
                if b in self._agent.get_plugin_list():
                    # "peer" (NIXL's default, pinned here): a dead peer surfaces as an error
                    init = {"ucx_error_handling_mode": "peer"} if b == "UCX" else {}
                    self._agent.create_backend(b, init)
        except Exception as e:
            raise _wrap("creating the NIXL agent", e) from e
        if not self._agent.backends:
            raise NixlError(f"none of the NIXL backends {list(backends)} is available")
        self.kv, self.aux = kv, aux
        self.kv_kind, self.kv_device = _mem_kind(kv)
        try:
            self._reg_kv = self._agent.register_memory(kv)
            self._reg_aux = self._agent.register_memory(aux)
        except Exception as e:
            raise _wrap("registering the KV pool with NIXL", e) from e
        num_pages = kv.shape[0]
        self.layout = MemoryLayout(
            kv_base_addr=kv.data_ptr(),
            page_nbytes=kv[0].numel() * kv.element_size() if num_pages else 0,
            num_pages=num_pages,
            kv_memory_kind=self.kv_kind,
            kv_device_id=self.kv_device,
            aux_base_addr=aux.data_ptr(),
            aux_row_nbytes=aux[0].numel() * aux.element_size(),
            num_aux_slots=aux.shape[0],
        )
        self._peers: set[str] = set()
        self._live: set[Xfer] = set()
        self._unclaimed: dict[str, list[bytes]] = {}  # notifications fetched by progress()
        self._zombies: list[Xfer] = []  # release refused (still active); retried on later polls
        self.closed = False
        log.info("nixl agent ready", agent=self.name, kv_kind=self.kv_kind.value, kv_device=self.kv_device,
                 progress_thread=False)

    # --- metadata and peers ---------------------------------------------------------------
    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    @property
    def peers(self) -> set[str]:
        return set(self._peers)

    def add_peer(self, metadata: bytes) -> str:
        """Load a remote agent's metadata; returns its name. A name already loaded is reloaded."""
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as e:
            raise _wrap("add_remote_agent", e) from e
        name = name.decode() if isinstance(name, bytes) else name
        self._peers.add(name)
        return name

    def remove_peer(self, name: str) -> None:
        """Forget a remote agent (disconnects). Best-effort: never raises."""
        if name not in self._peers:
            return
        self._peers.discard(name)
        try:
            self._agent.remove_remote_agent(name)
        except Exception as e:  # already gone on the NIXL side
            log.warning("remove_remote_agent failed", agent=name, error=str(e))

    # --- transfers ------------------------------------------------------------------------
    def _dlist(self, ranges: list[tuple[int, int]], kind: MemoryKind, device: int):
        arr = np.array([(a, n, device) for a, n in ranges], dtype=np.uint64).reshape(-1, 3)
        return self._agent.get_xfer_descs(arr, kind.value)

    def post_write(
        self,
        peer: str,
        descs: list[Desc],
        kind: MemoryKind,
        local_device: int,
        remote_device: int,
        notif: bytes = b"",
    ) -> tuple[Xfer, str]:
        """Build and post a WRITE of descs (src: local, dst: the peer's) to peer. Returns
        (xfer, "DONE" | "PROC"). Raises NixlError (the xfer is then already released)."""
        return self._post("WRITE", peer, descs, kind, local_device, remote_device, notif)

    def post_read(
        self, peer: str, descs: list[Desc], kind: MemoryKind, local_device: int, remote_device: int
    ) -> tuple[Xfer, str]:
        """Build and post a READ of the peer's memory into ours: each desc's dst_addr is the
        peer's, its src_addr the local range the bytes land in (the same pairing as a WRITE, the
        other way round). No notification: the peer is not told. Returns (xfer, "DONE" | "PROC");
        raises NixlError (the xfer is then already released)."""
        return self._post("READ", peer, descs, kind, local_device, remote_device, b"")

    def _post(self, op: str, peer: str, descs: list[Desc], kind: MemoryKind, local_device: int,
              remote_device: int, notif: bytes) -> tuple[Xfer, str]:
        if peer not in self._peers:
            raise NixlError(f"peer {peer} is not loaded (never registered, or replaced/removed)")
        if not descs:
            raise NixlError("empty transfer")
        try:
            local = self._dlist([(d.src_addr, d.nbytes) for d in descs], kind, local_device)
            remote = self._dlist([(d.dst_addr, d.nbytes) for d in descs], kind, remote_device)
            handle = self._agent.initialize_xfer(op, local, remote, peer, notif)
        except Exception as e:
            raise _wrap(f"initialize_xfer ({op}) with {peer}", e) from e
        x = Xfer(handle, peer, sum(d.nbytes for d in descs), len(descs))
        self._live.add(x)
        try:
            st = self._agent.transfer(handle)
        except Exception as e:
            self.release(x)
            raise _wrap(f"posting a {op} with {peer}", e) from e
        if st == "ERR":
            self.release(x)
            raise NixlError(f"posting a {op} with {peer} returned ERR")
        return x, st

    def check(self, x: Xfer) -> str:
        """Return "DONE" or "PROC"; raises NixlError on error (the caller releases)."""
        try:
            st = self._agent.check_xfer_state(x.handle)
        except Exception as e:
            raise _wrap(f"transfer to {x.peer}", e) from e
        if st == "ERR":
            raise NixlError(f"transfer to {x.peer} reported ERR")
        return st

    def release(self, x: Xfer) -> bool:
        """Release a handle; an active transfer is cancelled. Never raises: a handle NIXL
        refuses to release now is kept and retried by :meth:`retry_releases`, and False is
        returned (the transfer may still touch its memory)."""
        if x.released:
            return True
        try:
            self._agent.release_xfer_handle(x.handle)
        except Exception as e:
            x.release_error = f"{type(e).__name__}: {e}"
            log.warning("release of a transfer deferred", peer=x.peer, error=str(e))
            if x not in self._zombies:
                self._zombies.append(x)
            return False
        x.released = True
        self._live.discard(x)
        return True

    def retry_releases(self) -> None:
        for x in list(self._zombies):
            self._zombies.remove(x)
            self.release(x)

    @property
    def num_live_handles(self) -> int:
        """Transfer handles not yet released (tests assert 0 after every scenario)."""
        return len(self._live)

    # --- notifications --------------------------------------------------------------------
    def get_notifs(self) -> dict[str, list[bytes]]:
        """New notifications by sending agent name. Also drives UCX progress."""
        self.progress()
        got, self._unclaimed = self._unclaimed, {}
        return got

    def progress(self) -> None:
        """Drive UCX progress (e.g. to flush a standalone notification). Notifications that
        arrive meanwhile are kept for the next get_notifs()."""
        try:
            got = self._agent.get_new_notifs()
        except Exception as e:
            log.warning("get_new_notifs failed", error=str(e))
            return
        for k, v in got.items():
            self._unclaimed.setdefault(k.decode() if isinstance(k, bytes) else k, []).extend(v)

    def send_notif(self, peer: str, msg: bytes) -> bool:
        """Best-effort standalone notification."""
        if peer not in self._peers:
            return False
        try:
            self._agent.send_notif(peer, msg)
            return True
        except Exception as e:
            log.warning("send_notif failed", peer=peer, error=str(e))
            return False

    @classmethod
    def for_pool(cls, role: str, pool, **kw) -> NixlAgent:
        """The agent of a worker whose KV pool is ``pool`` (services.engine.kv_pool.KVPool)."""
        return cls(role, pool.kv, pool.aux, **kw)

    def close(self) -> None:
        """Release handles, forget peers, deregister memory. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for x in list(self._live):
            self.release(x)
        for p in list(self._peers):
            self.remove_peer(p)
        for reg in (self._reg_kv, self._reg_aux):
            try:
                self._agent.deregister_memory(reg)
            except Exception as e:
                log.warning("deregister_memory failed", error=str(e))
