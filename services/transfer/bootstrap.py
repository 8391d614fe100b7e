"""gRPC bootstrap of the KV transfer (proto/pdmesh/v1/bootstrap.proto), grpc.aio on both ends.

- :class:`KVBootstrapServicer` — served by the prefill worker on top of a KVSender.
- :class:`BootstrapClient` — the raw calls, for the decode worker.
- :class:`KVReceiveCoordinator` — decode-side flow on top of a KVReceiver: register once per
  prefill (again after it restarted or dropped us), attach rooms, heartbeat every prefill that
  holds rooms and fail rooms that prefill no longer holds or that wait on an unreachable
  prefill (docs/architecture.md, transfer phase 1).

Errors carry a machine-readable kind in the trailing metadata key ``pdmesh-error``.
A protocol version mismatch is FAILED_PRECONDITION naming both versions, on both sides.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from services.common.generated.pdmesh.v1 import bootstrap_pb2 as pb
from services.common.generated.pdmesh.v1 import bootstrap_pb2_grpc as pb_grpc
from services.common.grpc_server import internal_channel
from services.common.logging_setup import get_logger
from services.transfer.receiver import AttachParams, KVReceiver
from services.transfer.sender import BootstrapRejected, KVSender
from services.transfer.wire_format import (
    PROTOCOL_VERSION,
    MemoryKind,
    MemoryLayout,
    ProtocolMismatch,
    TransferError,
)

log = get_logger("transfer.bootstrap")

ERROR_KEY = "pdmesh-error"
VERSION_KEY = "pdmesh-protocol-version"

_KIND_TO_PB = {MemoryKind.DRAM: pb.MEMORY_KIND_DRAM, MemoryKind.VRAM: pb.MEMORY_KIND_VRAM}
_PB_TO_KIND = {v: k for k, v in _KIND_TO_PB.items()}


# The proto's MemoryLayout has the dataclass's fields, by name; only the memory kind is an enum.
_LAYOUT_NUMBERS = tuple(f.name for f in dataclasses.fields(MemoryLayout) if f.name != "kv_memory_kind")


def layout_to_pb(lay: MemoryLayout) -> pb.MemoryLayout:
    return pb.MemoryLayout(kv_memory_kind=_KIND_TO_PB[lay.kv_memory_kind],
                           **{name: getattr(lay, name) for name in _LAYOUT_NUMBERS})


def layout_from_pb(m: pb.MemoryLayout) -> MemoryLayout:
    if m.kv_memory_kind not in _PB_TO_KIND:
        raise ValueError(f"unknown memory kind {m.kv_memory_kind}")
    return MemoryLayout(kv_memory_kind=_PB_TO_KIND[m.kv_memory_kind],
                        **{name: getattr(m, name) for name in _LAYOUT_NUMBERS})


# --- server (prefill) ------------------------------------------------------------------------


class KVBootstrapServicer(pb_grpc.KVBootstrapServicer):
    def __init__(self, sender: KVSender, forward_age: Callable[[], float] | None = None):
        """forward_age: seconds the worker's current forward has run (0 when none), reported
        in every heartbeat reply so decode can bound its wait by progress."""
        self.sender = sender
        self.forward_age = forward_age or (lambda: 0.0)

    @staticmethod
    async def _abort(context, code: grpc.StatusCode, kind: str, msg: str):
        await context.abort(
            code, msg, trailing_metadata=((ERROR_KEY, kind), (VERSION_KEY, str(PROTOCOL_VERSION)))
        )

    async def _check_version(self, request, context) -> None:
        if request.protocol_version != PROTOCOL_VERSION:
            msg = str(ProtocolMismatch(PROTOCOL_VERSION, request.protocol_version, who="the decode worker"))
            await self._abort(context, grpc.StatusCode.FAILED_PRECONDITION, "version-mismatch", msg)

    async def _rejected(self, context, e: BootstrapRejected):
        await self._abort(context, getattr(grpc.StatusCode, e.code), e.kind, str(e))

    async def RegisterPeer(self, request, context):
        await self._check_version(request, context)
        try:
            layout = layout_from_pb(request.layout)
        except ValueError as e:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "bad-request", str(e))
        try:
            self.sender.register_peer(
                request.worker_id, request.agent_name, request.epoch, request.nixl_metadata, layout
            )
        except BootstrapRejected as e:
            await self._rejected(context, e)
        return pb.RegisterPeerReply(
            protocol_version=PROTOCOL_VERSION,
            agent_name=self.sender.agent_name,
            epoch=self.sender.epoch,
            layout=layout_to_pb(self.sender.layout),
        )

    async def Attach(self, request, context):
        await self._check_version(request, context)
        try:
            self.sender.attach(
                request.room, request.agent_name, request.epoch, list(request.dst_pages), request.dst_aux_slot,
                request.skip_pages, list(request.held_pages), list(request.held_checksums),
            )
        except BootstrapRejected as e:
            await self._rejected(context, e)
        return pb.AttachReply(sender_epoch=self.sender.epoch, sender_agent_name=self.sender.agent_name)

    async def Abort(self, request, context):
        await self._check_version(request, context)
        known = self.sender.abort(request.room, f"aborted by decode: {request.reason or 'no reason given'}")
        return pb.AbortReply(known=known, quiesced=self.sender.quiesced(request.room))

    async def Heartbeat(self, request, context):
        await self._check_version(request, context)
        held, done, registered = self.sender.heartbeat(request.agent_name, request.epoch, list(request.rooms))
        return pb.HeartbeatReply(
            sender_epoch=self.sender.epoch,
            held_rooms=held,
            forward_done_rooms=done,
            peer_registered=registered,
            forward_age_seconds=self.forward_age(),
        )


def add_bootstrap_servicer(
    server: grpc.aio.Server, sender: KVSender, forward_age: Callable[[], float] | None = None
) -> KVBootstrapServicer:
    servicer = KVBootstrapServicer(sender, forward_age)
    pb_grpc.add_KVBootstrapServicer_to_server(servicer, server)
    return servicer


# --- client (decode) -------------------------------------------------------------------------


class BootstrapCallError(TransferError):
    """A bootstrap RPC failed: ``kind`` from the server (or "unavailable"/"rpc-error"), ``code``
    the gRPC status code."""

    def __init__(self, address: str, method: str, code: grpc.StatusCode | None, kind: str, details: str):
        self.address, self.method, self.code, self.kind, self.details = address, method, code, kind, details
        super().__init__(
            f"{method} to prefill {address} failed ({code.name if code else '?'}/{kind}): {details}"
        )


@dataclass(frozen=True)
class SenderInfo:
    agent_name: str
    epoch: int
    layout: MemoryLayout


@dataclass(frozen=True)
class HeartbeatResult:
    sender_epoch: int
    held: list[int]
    forward_done: list[int]
    peer_registered: bool
    forward_age: float = 0.0  # seconds prefill's current forward has run; 0 when none


@dataclass(frozen=True)
class AbortResult:
    known: bool  # prefill held the room
    quiesced: bool  # no live or deferred NIXL transfer on prefill references the room


class BootstrapClient:
    def __init__(self, address: str, timeout: float = 5.0):
        self.address = address
        self.timeout = timeout
        # keep-alive + fast reconnect: a connection that died in a partition is replaced within
        # seconds of the network healing (services/common/grpc_server.py); presents the token
        self._channel = internal_channel(address)
        self._stub = pb_grpc.KVBootstrapStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method: str, request, timeout: float | None = None):
        try:
            return await getattr(self._stub, method)(request, timeout=timeout or self.timeout)
        except grpc.aio.AioRpcError as e:
            kind, remote_version = "rpc-error", None
            for k, v in e.trailing_metadata() or ():
                if k == ERROR_KEY:
                    kind = v
                elif k == VERSION_KEY:
                    remote_version = int(v)
            if (
                e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                and kind == "rpc-error"
            ):
                kind = "unavailable"
            if kind == "version-mismatch":
                raise ProtocolMismatch(PROTOCOL_VERSION, remote_version, who=f"prefill {self.address}") from e
            raise BootstrapCallError(self.address, method, e.code(), kind, e.details() or "") from e

    async def register_peer(
        self, worker_id: str, agent_name: str, epoch: int, metadata: bytes, layout: MemoryLayout
    ) -> SenderInfo:
        reply = await self._call(
            "RegisterPeer",
            pb.RegisterPeerRequest(
                protocol_version=PROTOCOL_VERSION,
                worker_id=worker_id,
                agent_name=agent_name,
                epoch=epoch,
                nixl_metadata=metadata,
                layout=layout_to_pb(layout),
            ),
        )
        if reply.protocol_version != PROTOCOL_VERSION:
            raise ProtocolMismatch(PROTOCOL_VERSION, reply.protocol_version, who=f"prefill {self.address}")
        return SenderInfo(reply.agent_name, reply.epoch, layout_from_pb(reply.layout))

    async def attach(self, p: AttachParams) -> tuple[str, int]:
        reply = await self._call(
            "Attach",
            pb.AttachRequest(
                protocol_version=PROTOCOL_VERSION,
                room=p.room,
                agent_name=p.agent_name,
                epoch=p.epoch,
                dst_pages=p.dst_pages,
                dst_aux_slot=p.dst_aux_slot,
                skip_pages=p.skip_pages,
                held_pages=p.held_pages,
                held_checksums=p.held_checksums,
            ),
        )
        return reply.sender_agent_name, reply.sender_epoch

    async def abort(self, room: int, reason: str, agent_name: str = "", timeout: float | None = None) -> AbortResult:
        reply = await self._call(
            "Abort",
            pb.AbortRequest(
                protocol_version=PROTOCOL_VERSION, room=room, reason=reason, agent_name=agent_name
            ),
            timeout,
        )
        return AbortResult(reply.known, reply.quiesced)

    async def heartbeat(
        self, agent_name: str, epoch: int, rooms: list[int], timeout: float | None = None
    ) -> HeartbeatResult:
        reply = await self._call(
            "Heartbeat",
            pb.HeartbeatRequest(
                protocol_version=PROTOCOL_VERSION, agent_name=agent_name, epoch=epoch, rooms=rooms
            ),
            timeout,
        )
        return HeartbeatResult(
            reply.sender_epoch,
            list(reply.held_rooms),
            list(reply.forward_done_rooms),
            reply.peer_registered,
            reply.forward_age_seconds,
        )


# --- decode-side coordinator -----------------------------------------------------------------


class KVReceiveCoordinator:
    """Decode worker's bootstrap flow; owned by its asyncio loop."""

    def __init__(
        self,
        receiver: KVReceiver,
        worker_id: str,
        *,
        rpc_timeout: float = 5.0,
        heartbeat_interval: float = 2.0,
        heartbeat_max_failures: int = 3,
        forward_timeout: float = 300.0,
    ):
        """forward_timeout: decode's --forward-timeout; a prefill reporting a forward older
        than this fails the rooms that wait on it in phase 1 (it is not progressing)."""
        self.receiver = receiver
        self.worker_id = worker_id
        self.rpc_timeout = rpc_timeout
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_max_failures = heartbeat_max_failures
        self._clients: dict[str, BootstrapClient] = {}
        self._registered: dict[str, SenderInfo] = {}
        self._reg_locks: dict[str, asyncio.Lock] = {}
        self.forward_timeout = forward_timeout
        self._hb_failures: dict[str, int] = {}
        self._hb_task: asyncio.Task | None = None
        # per prefill address: the last sender epoch seen, and a generation bumped whenever
        # that prefill is "really gone" (a new epoch, or heartbeat_max_failures in a row), so
        # decode's quarantine (services/decode/quarantine.py) knows its late writes can't come
        self._epochs: dict[str, int] = {}
        self._gone: dict[str, int] = {}

    def client(self, address: str) -> BootstrapClient:
        c = self._clients.get(address)
        if c is None:
            c = self._clients[address] = BootstrapClient(address, self.rpc_timeout)
        return c

    async def ensure_registered(self, address: str) -> SenderInfo:
        info = self._registered.get(address)
        if info is not None:
            return info
        lock = self._reg_locks.setdefault(address, asyncio.Lock())
        async with lock:
            info = self._registered.get(address)
            if info is None:
                agent = self.receiver.agent
                info = await self.client(address).register_peer(
                    self.worker_id, agent.name, agent.epoch, agent.metadata(), agent.layout
                )
                self._registered[address] = info
                self._saw_epoch(address, info.epoch)
                log.info("registered with prefill", prefill=address, agent=info.agent_name, epoch=info.epoch)
            return info

    def prefill_generation(self, address: str) -> int:
        """Bumped each time the prefill at `address` is known gone (restart or dead)."""
        return self._gone.get(address, 0)

    def _declare_gone(self, address: str, why: str) -> None:
        self._gone[address] = self._gone.get(address, 0) + 1
        log.info("prefill is gone", prefill=address, why=why)

    def _saw_epoch(self, address: str, epoch: int) -> None:
        old = self._epochs.get(address)
        self._epochs[address] = epoch
        if old is not None and old != epoch:
            self._declare_gone(address, f"restarted: epoch {old} -> {epoch}")

    def forget(self, address: str) -> None:
        """Register again on the next attach (prefill restarted or dropped this agent)."""
        self._registered.pop(address, None)

    async def attach(self, room: int, address: str, dst_pages: list[int], skip_pages: int = 0,
                     held_pages: list[int] = ()) -> bool:
        """Attach a room created with receiver.create_room(room, address); `skip_pages` leading
        prompt pages are held here already and not sent; `held_pages` (their ids, or empty)
        offers them for prefill's READ. On any failure the room is failed (reason in
        room.reason) and False returned."""
        try:
            params = self.receiver.prepare_attach(room, dst_pages, skip_pages, held_pages)
        except Exception as e:
            self.receiver.fail(room, f"cannot attach: {e}")
            return False
        for attempt in range(2):
            try:
                await self.ensure_registered(address)
                sender_agent, sender_epoch = await self.client(address).attach(params)
            except BootstrapCallError as e:
                if e.kind == "peer-not-registered" and attempt == 0:
                    self.forget(address)
                    continue
                self.receiver.fail(room, str(e))
                return False
            except Exception as e:  # ProtocolMismatch, NIXL metadata errors, ...
                self.receiver.fail(room, f"attach to prefill {address} failed: {e}")
                return False
            if self.receiver.mark_attached(room, sender_agent, sender_epoch):
                return True
            # the room was failed/aborted here while the Attach RPC was in flight: tell prefill
            await self._abort_remote(address, room, "decode dropped the room during attach")
            return False
        return False  # pragma: no cover

    async def abort(self, room: int, reason: str) -> None:
        """Fail the room here and tell its prefill (best-effort)."""
        r = self.receiver.rooms.get(room)
        self.receiver.fail(room, reason)
        if r is not None and r.peer:
            await self._abort_remote(r.peer, room, reason)

    async def _abort_remote(self, address: str, room: int, reason: str) -> None:
        try:
            await self.client(address).abort(room, reason, self.receiver.agent_name)
        except Exception as e:
            log.info("abort not delivered", room=room, prefill=address, error=str(e))

    async def heartbeat_once(self) -> None:
        by_peer = self.receiver.waiting_by_peer()
        await asyncio.gather(*(self._heartbeat_peer(p, rooms) for p, rooms in by_peer.items()))

    async def _heartbeat_peer(self, peer: str, rooms: list[int]) -> None:
        try:
            hb = await self.client(peer).heartbeat(
                self.receiver.agent_name,
                self.receiver.epoch,
                rooms,
                timeout=min(self.rpc_timeout, self.heartbeat_interval),
            )
        except Exception as e:
            n = self._hb_failures[peer] = self._hb_failures.get(peer, 0) + 1
            log.warning("heartbeat to prefill failed", prefill=peer, failures=n, max_failures=self.heartbeat_max_failures,
                        error=str(e))
            if n >= self.heartbeat_max_failures:
                self._hb_failures[peer] = 0
                self.forget(peer)
                self._declare_gone(peer, f"{n} heartbeats failed")
                self.receiver.fail_peer(peer, f"prefill {peer} unreachable for {n} heartbeats: {e}")
            return
        self._hb_failures[peer] = 0
        self._saw_epoch(peer, hb.sender_epoch)
        if not hb.peer_registered:
            self.forget(peer)
        if hb.forward_age > self.forward_timeout:
            # alive but not progressing: rooms still waiting for their forward would wait forever.
            # Before the held list: prefill's own watchdog may already have dropped the stuck
            # forward's rooms, and their reason is the forward, not "no longer holds"
            failed = self.receiver.fail_waiting_for_input(
                peer,
                f"prefill {peer} forward stuck for {hb.forward_age:.1f}s "
                f"(> --forward-timeout {self.forward_timeout:g}s)",
                sender_epoch=hb.sender_epoch,
            )
            if failed:
                log.warning("prefill forward stuck: waiting rooms failed", prefill=peer,
                            forward_age_s=round(hb.forward_age, 1), failed_rooms=len(failed))
        self.receiver.apply_heartbeat(peer, rooms, hb.sender_epoch, hb.held, hb.forward_done)

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                await self.heartbeat_once()
            except Exception:
                log.exception("heartbeat round failed")
            await asyncio.sleep(self.heartbeat_interval)

    def start_heartbeats(self) -> asyncio.Task:
        if self._hb_task is None or self._hb_task.done():
            self._hb_task = asyncio.get_running_loop().create_task(
                self._heartbeat_loop(), name="kv-heartbeat"
            )
        return self._hb_task

    async def close(self) -> None:
        if self._hb_task is not None:
            self._hb_task.cancel()
            try:
                await self._hb_task
            except asyncio.CancelledError:
                pass
        for c in self._clients.values():
            await c.close()
        self._clients.clear()
