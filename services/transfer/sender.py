"""Prefill side of the KV transfer: peers, rooms, WRITE posting and completion.

Owned by the prefill worker's asyncio loop; every method is synchronous and quick (NIXL calls
here only build, post or check transfers). Typical life of a room:

    sender.create_room(room)                       # Prefill RPC arrived -> Bootstrapping
    sender.attach(room, agent, epoch, pages, slot)  # decode's Attach RPC -> WaitingForInput
    sender.send(room, src_pages, token, logprob)    # after the final chunk -> Transferring
    sender.poll()                                   # by services/transfer/poller.py -> Success|Failed
    sender.release(room)                            # worker freed its pages -> gone (tombstoned)

Attach and create may come in either order (the router calls both workers at once): an attach
for a room not created yet is parked and claimed by create_room. The KV pages stay owned by the
worker; this class owns the NIXL handles and one aux staging row per sending room.

A handle NIXL refuses to release (its transfer still active) is *deferred*: kept per room and
retried by `sweep()` (the watchdog tick, so an idle worker retries too) until NIXL lets go.
While a room has one, NIXL may still read the room's source pages and WRITE into decode's
pages, so `quiesced(room)` is False (decode keeps those pages quarantined: AbortReply) and
`free_when_quiesced(room, free)` holds the worker's pages until then.

No torch and no nixl import: the agent is passed in (services/transfer/nixl_agent.NixlAgent, or
a fake in unit tests).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.common.logging_setup import get_logger
from services.transfer.descriptors import Desc, page_descs
from services.transfer.kv_checksum import kv_checksum
from services.transfer.reader import KVReader, ReadOutcome
from services.transfer.side import TransferSide
from services.transfer.state import Clock, DuplicateRoom, Room, RoomState
from services.transfer.wire_format import (
    AUX_CHECKSUM,
    AUX_WORDS,
    AbortNotification,
    AuxRow,
    KVNotification,
    MemoryKind,
    MemoryLayout,
    NixlError,
    TransferError,
)

log = get_logger("transfer.sender")

# How long poll() keeps driving UCX after a standalone notification, so it actually leaves
# (a first message to a peer may need the connection set up first).
NOTIF_FLUSH_SECONDS = 0.5


class BootstrapRejected(TransferError):
    """A bootstrap call the sender refuses. ``kind`` is machine-readable (sent as gRPC
    trailing metadata), ``code`` the gRPC status code name."""

    def __init__(self, kind: str, code: str, msg: str):
        super().__init__(msg)
        self.kind, self.code = kind, code


def _reject(kind: str, code: str, msg: str) -> BootstrapRejected:
    return BootstrapRejected(kind, code, msg)


@dataclass(eq=False)
class Peer:
    worker_id: str
    agent_name: str
    epoch: int
    layout: MemoryLayout


@dataclass(frozen=True)
class AttachInfo:
    agent_name: str
    epoch: int
    dst_pages: tuple[int, ...]
    dst_aux_slot: int
    at: float
    skip_pages: int = 0  # leading source pages decode holds already: not sent
    # decode's ids of those pages, when it offers them for a READ (services/transfer/reader.py),
    # and their KV checksums (empty: none computed)
    held_pages: tuple[int, ...] = ()
    held_checksums: tuple[int, ...] = ()


@dataclass(eq=False)
class _Stage:
    descs: list[Desc]
    kind: MemoryKind
    local_device: int
    remote_device: int
    notif: bytes


@dataclass(eq=False)
class _Deferred:
    """Handles of one room that NIXL refused to release, and what waits for them to go."""

    since: float
    handles: list[Any] = field(default_factory=list)
    on_quiesced: list[Callable[[], None]] = field(default_factory=list)


@dataclass(eq=False)
class SenderRoom(Room):
    attach: AttachInfo | None = None
    src_pages: list[int] | None = None
    aux_slot: int | None = None
    stages: list[_Stage] = field(default_factory=list)
    xfer: Any = None
    nbytes: int = 0
    ndescs: int = 0
    posted_at: float | None = None
    done_at: float | None = None

    @property
    def peer(self) -> str | None:
        return self.attach.agent_name if self.attach else None


class KVSender(TransferSide[SenderRoom]):
    logger = log

    def __init__(
        self,
        agent,
        pool,
        *,
        clock: Clock = time.monotonic,
        on_terminal: Callable[[SenderRoom], None] | None = None,
        max_desc_bytes: int | None = None,
        pending_attach_ttl: float = 300.0,
        stall_before_post: float = 0.0,
        drop_notification: bool = False,
        refuse_attach: bool = False,
        refuse_attach_from: str = "",
        kv_checksum: bool = False,
        misroute_kv: float = 0.0,
        fault_seed: int = 0,
        tombstones: int = 65536,
        read_timeout: float = 5.0,
        stall_read: bool = False,
    ):
        """agent: NixlAgent of this process; pool: KVPool (uses .aux and .aux_allocator).

        stall_before_post: TEST-ONLY fault knob (seconds): a room waits this long in
        Transferring before its WRITE is posted. Off (0) by default; logged loudly when on.
        """
        super().__init__(agent, pool, clock, on_terminal, tombstones)
        self.on_attached: Callable[[SenderRoom], None] | None = None
        self.max_desc_bytes = max_desc_bytes
        self.pending_attach_ttl = pending_attach_ttl
        self.stall_before_post = stall_before_post
        # TEST-ONLY fault knob: WRITEs carry no notification, so decode never learns the KV arrived
        self.drop_notification = drop_notification
        # TEST-ONLY fault knob: every Attach is refused
        self.refuse_attach = refuse_attach
        # TEST-ONLY fault knob: the Attach of a decode whose worker id contains this is refused
        self.refuse_attach_from = refuse_attach_from
        if refuse_attach:
            log.warning("FAULT INJECTION ON: KV sender refuses every attach")
        if refuse_attach_from:
            log.warning("FAULT INJECTION ON: KV sender refuses the attach of decodes named so", name=refuse_attach_from)
        if drop_notification:
            log.warning("FAULT INJECTION ON: KV sender drops every notification")
        if stall_before_post:
            log.warning("FAULT INJECTION ON: KV sender stalls before every post", stall_s=stall_before_post)
        # the KV checksum of every room's pages and aux row (services/transfer/kv_checksum.py)
        self.kv_checksum = kv_checksum
        # TEST-ONLY fault knob: with this probability a room's KV pages land in its own destination
        # pages in the wrong order (two swapped), drawn from a generator seeded with fault_seed
        self.misroute_kv = misroute_kv
        self._fault_rng = random.Random(fault_seed)
        if misroute_kv:
            log.warning("FAULT INJECTION ON: KV sender misroutes a room's pages", probability=misroute_kv)
        self._pending: dict[int, AttachInfo] = {}
        self._flush_until = 0.0  # poll() drives UCX progress until then (abort notifications)
        self._peers: dict[str, Peer] = {}  # by agent name
        self._by_worker: dict[str, Peer] = {}
        self.stats = {"success": 0, "failed": 0, "bytes": 0, "peers_replaced": 0, "peers_dropped": 0}
        self._deferred: dict[int, _Deferred] = {}  # room -> handles NIXL has not released yet
        # READs of decode's held prefix pages (one per room at most), bounded by read_timeout
        self.reader = KVReader(agent, pool, clock=clock, timeout=read_timeout, stall=stall_read)

    # --- identity -----------------------------------------------------------------------
    @property
    def layout(self) -> MemoryLayout:
        return self.agent.layout

    # --- peers --------------------------------------------------------------------------
    def register_peer(
        self, worker_id: str, agent_name: str, epoch: int, metadata: bytes, layout: MemoryLayout
    ) -> None:
        """RegisterPeer. A newer epoch of a known worker replaces the old agent (its rooms fail)."""
        why = self.layout.compatible_with(layout)
        if why:
            raise _reject(
                "layout-mismatch", "FAILED_PRECONDITION", f"decode {worker_id} KV layout incompatible: {why}"
            )
        old = self._by_worker.get(worker_id)
        if old is not None:
            if old.agent_name == agent_name and old.epoch == epoch:
                if agent_name in self._peers:
                    return  # idempotent re-registration
            elif epoch < old.epoch:
                raise _reject(
                    "stale-epoch",
                    "FAILED_PRECONDITION",
                    f"decode {worker_id} registered epoch {epoch} older than the known epoch {old.epoch}",
                )
            else:
                self.stats["peers_replaced"] += 1
                log.info("decode restarted: replacing its agent", decode=worker_id, old_agent=old.agent_name,
                         agent=agent_name)
                self._drop_peer(old, f"decode {worker_id} restarted (epoch {old.epoch} -> {epoch})")
        try:
            loaded = self.agent.add_peer(metadata)
        except NixlError as e:
            raise _reject(
                "bad-metadata", "INVALID_ARGUMENT", f"cannot load NIXL metadata of {agent_name}: {e}"
            ) from e
        if loaded != agent_name:
            self.agent.remove_peer(loaded)
            raise _reject(
                "bad-metadata",
                "INVALID_ARGUMENT",
                f"metadata names agent {loaded!r}, request says {agent_name!r}",
            )
        peer = Peer(worker_id, agent_name, epoch, layout)
        self._peers[agent_name] = peer
        self._by_worker[worker_id] = peer

    def _drop_peer(self, peer: Peer, reason: str) -> None:
        for r in self.rooms:
            if r.peer == peer.agent_name:
                self._fail(r, reason, tell_peer=False)  # the peer is gone or replaced
        for room, a in list(self._pending.items()):
            if a.agent_name == peer.agent_name:
                del self._pending[room]
        self._peers.pop(peer.agent_name, None)
        if self._by_worker.get(peer.worker_id) is peer:
            del self._by_worker[peer.worker_id]
        self.agent.remove_peer(peer.agent_name)

    def peer_registered(self, agent_name: str, epoch: int) -> bool:
        p = self._peers.get(agent_name)
        return p is not None and p.epoch == epoch

    @property
    def peers(self) -> list[Peer]:
        return list(self._peers.values())

    # --- rooms --------------------------------------------------------------------------
    def create_room(self, room: int) -> SenderRoom:
        """The Prefill RPC arrived. Raises DuplicateRoom for a live or finished room id."""
        r = self.rooms.add(SenderRoom(room, self.clock()))
        a = self._pending.pop(room, None)
        if a is not None:
            self._apply_attach(r, a)
        return r

    def attach(self, room: int, agent_name: str, epoch: int, dst_pages: list[int], dst_aux_slot: int,
               skip_pages: int = 0, held_pages: list[int] = (), held_checksums: list[int] = ()) -> None:
        """decode's Attach; decode holds the first `skip_pages` pages already, and offers their
        ids for a READ in `held_pages` (empty: not offered). Raises BootstrapRejected."""
        if self.refuse_attach:
            raise _reject("fault", "UNAVAILABLE", "fault injection: fail_attach")
        peer = self._peers.get(agent_name)
        if peer is None or peer.epoch != epoch:
            raise _reject(
                "peer-not-registered",
                "FAILED_PRECONDITION",
                f"agent {agent_name} (epoch {epoch}) is not registered; call RegisterPeer",
            )
        if self.refuse_attach_from and self.refuse_attach_from in peer.worker_id:
            raise _reject("fault", "UNAVAILABLE", f"fault injection: fail_attach_from={self.refuse_attach_from}")
        if not dst_pages:
            raise _reject("bad-request", "INVALID_ARGUMENT", "attach without destination pages")
        bad = [p for p in dst_pages if not 0 <= p < peer.layout.num_pages]
        if bad or len(set(dst_pages)) != len(dst_pages):
            raise _reject(
                "bad-request", "INVALID_ARGUMENT", f"invalid destination pages {bad or 'duplicates'}"
            )
        if not 0 <= dst_aux_slot < peer.layout.num_aux_slots:
            raise _reject("bad-request", "INVALID_ARGUMENT", f"invalid aux slot {dst_aux_slot}")
        if not 0 <= skip_pages <= peer.layout.num_pages:
            raise _reject("bad-request", "INVALID_ARGUMENT", f"invalid skip_pages {skip_pages}")
        if held_pages:
            bad = [p for p in held_pages if not 0 <= p < peer.layout.num_pages]
            if len(held_pages) != skip_pages or bad or len(set(held_pages)) != len(held_pages):
                raise _reject("bad-request", "INVALID_ARGUMENT",
                              f"held_pages must name the {skip_pages} skipped pages once each, in range "
                              f"(got {len(held_pages)}{', invalid ' + str(bad[:8]) if bad else ''})")
            if set(held_pages) & set(dst_pages):
                raise _reject("bad-request", "INVALID_ARGUMENT", "held_pages and dst_pages overlap")
        if held_checksums and len(held_checksums) != len(held_pages):
            raise _reject("bad-request", "INVALID_ARGUMENT",
                          f"{len(held_checksums)} held checksums for {len(held_pages)} held pages")
        info = AttachInfo(agent_name, epoch, tuple(dst_pages), dst_aux_slot, self.clock(), skip_pages,
                          tuple(held_pages), tuple(held_checksums))
        r = self.rooms.get(room)
        if r is None:
            outcome = self.rooms.outcome(room)
            if outcome is not None:
                raise _reject("room-finished", "NOT_FOUND", f"room {room} already finished ({outcome.label})")
            if room in self._pending:
                raise _reject("room-duplicate", "ALREADY_EXISTS", f"room {room} already attached")
            self._pending[room] = info  # Prefill RPC not here yet
            return
        if r.state.terminal:
            raise _reject("room-finished", "NOT_FOUND", f"room {room} already finished ({r.state.label})")
        if r.attach is not None or r.state != RoomState.BOOTSTRAPPING:
            raise _reject(
                "room-duplicate", "ALREADY_EXISTS", f"room {room} already attached ({r.state.label})"
            )
        self._apply_attach(r, info)

    def _apply_attach(self, r: SenderRoom, a: AttachInfo) -> None:
        r.attach = a
        r.advance(RoomState.WAITING_FOR_INPUT, self.clock())
        if self.on_attached is not None:
            self.on_attached(r)  # the worker's scheduler: the room may now be prefilled

    def send(self, room: int, src_pages: list[int], first_token: int, logprob: float, cached_tokens: int = 0) -> bool:
        """Forward done: post the WRITE of src_pages (in token order) and the aux row; the
        first pages decode said it holds (attach's skip_pages) are left out.

        False (nothing done) if the room is unknown or already terminal (a late event).
        Raises ValueError if the room is not attached yet (the scheduler must not run it)."""
        r = self.rooms.for_event(room, open_only=True)
        if r is None:
            return False
        if r.state != RoomState.WAITING_FOR_INPUT:
            raise ValueError(f"room {room} is {r.state.label}, not attached/waiting")
        a = r.attach
        peer = self._peers.get(a.agent_name)
        now = self.clock()
        r.advance(RoomState.TRANSFERRING, now)
        if peer is None or peer.epoch != a.epoch:
            self._fail(r, f"decode agent {a.agent_name} is gone", tell_peer=False)
            return True
        if a.skip_pages >= len(src_pages):
            self._fail(r, f"decode holds {a.skip_pages} pages of a {len(src_pages)}-page prompt: nothing left to send")
            return True
        src_pages = src_pages[a.skip_pages :]
        if len(src_pages) > len(a.dst_pages):
            self._fail(r, f"{len(src_pages)} KV pages but decode attached only {len(a.dst_pages)}")
            return True
        try:
            slot = self.pool.aux_allocator.alloc(1, owner=("kv-send", room))[0]
        except Exception as e:
            self._fail(r, f"no aux staging slot: {e}")
            return True
        r.aux_slot = slot
        words = AuxRow(room, first_token, logprob, self.epoch, cached_tokens, sent_pages=len(src_pages)).words()
        if self.kv_checksum:
            words[AUX_CHECKSUM] = kv_checksum(self.pool.page_run_bytes, src_pages, words[:AUX_CHECKSUM])
        for i in range(AUX_WORDS):
            self.pool.aux[slot, i] = words[i]
        lay = self.layout
        dst_pages = list(a.dst_pages[: len(src_pages)])
        if self.misroute_kv and len(dst_pages) > 1 and self._fault_rng.random() < self.misroute_kv:
            dst_pages[0], dst_pages[1] = dst_pages[1], dst_pages[0]
            log.warning("FAULT: KV pages misrouted (first two swapped)", room=room)
        kv = page_descs(
            src_pages,
            dst_pages,
            lay.kv_base_addr,
            peer.layout.kv_base_addr,
            lay.page_nbytes,
            self.max_desc_bytes,
        )
        aux = Desc(lay.aux_addr(slot), peer.layout.aux_addr(a.dst_aux_slot), lay.aux_row_nbytes)
        notif = b"" if self.drop_notification else KVNotification(room, self.epoch, a.epoch).encode()
        kv_kind, dev = lay.kv_memory_kind, lay.kv_device_id
        if kv_kind == MemoryKind.DRAM and peer.layout.kv_memory_kind == MemoryKind.DRAM:
            # one WRITE; its notification is delivered after all of its bytes landed
            r.stages = [_Stage(kv + [aux], MemoryKind.DRAM, 0, 0, notif)]
        else:
            # KV and aux live in different memory kinds: KV first, the aux row (+notif) after it is DONE
            r.stages = [
                _Stage(kv, kv_kind, dev, peer.layout.kv_device_id, b""),
                _Stage([aux], MemoryKind.DRAM, 0, 0, notif),
            ]
        r.ndescs = len(kv) + 1
        r.nbytes = sum(d.nbytes for d in kv) + aux.nbytes
        r.posted_at = now
        if self.stall_before_post <= 0:
            self._post_next(r)
        self.wakeup()
        return True

    def start_read(self, room: int, local_pages: list[int], first: int, on_end: Callable[[ReadOutcome], None]
                   ) -> ReadOutcome | None:
        """READ decode's held pages first.. first+len(local_pages)-1 of an attached room into
        local_pages (services/transfer/reader.py). None: posted, on_end(outcome) follows once its
        handle is released; else its outcome now (failed to post, or done at once)."""
        r = self.rooms.get(room)
        if r is None or r.state != RoomState.WAITING_FOR_INPUT or r.attach is None:
            raise ValueError(f"room {room} is not attached and waiting")
        a = r.attach
        last = first + len(local_pages)
        if not 0 <= first < last <= len(a.held_pages):
            raise ValueError(f"READ of held pages {first}..{last - 1}; decode offered {len(a.held_pages)}")
        peer = self._peers.get(a.agent_name)
        if peer is None or peer.epoch != a.epoch:
            return ReadOutcome(False, len(local_pages), 0, 0.0, "error", f"decode agent {a.agent_name} is gone")
        checksums = a.held_checksums[first:last] if a.held_checksums else ()
        outcome = self.reader.start(room, a.agent_name, peer.layout, self.layout, local_pages,
                                    a.held_pages[first:last], checksums, on_end)
        if outcome is None:
            self.wakeup()
        return outcome

    def _post_next(self, r: SenderRoom) -> None:
        st = r.stages.pop(0)
        try:
            r.xfer, status = self.agent.post_write(
                r.peer, st.descs, st.kind, st.local_device, st.remote_device, st.notif
            )
        except NixlError as e:
            self._on_nixl_error(r, e)
            return
        if status == "DONE":
            self._stage_done(r)

    def _release_handle(self, r: SenderRoom) -> None:
        x, r.xfer = r.xfer, None
        if x is not None and self.agent.release(x) is False:
            d = self._deferred.setdefault(r.room, _Deferred(self.clock()))
            d.handles.append(x)
            log.warning("NIXL refused to release its transfer handle; its pages stay held until a sweep releases it",
                        room=r.room, error=getattr(x, "release_error", "") or "still active")

    def _stage_done(self, r: SenderRoom) -> None:
        self._release_handle(r)
        if r.stages:
            self._post_next(r)
            return
        r.done_at = self.clock()
        r.advance(RoomState.SUCCESS, r.done_at)
        self.stats["success"] += 1
        self.stats["bytes"] += r.nbytes
        self._finish(r)

    def _on_nixl_error(self, r: SenderRoom, e: NixlError) -> None:
        self._fail(r, f"NIXL: {e}", tell_peer=False)
        if e.disconnected:
            peer = self._peers.get(r.peer) if r.peer else None
            if peer is not None:
                # the connection is gone: fail its other rooms now and forget the agent; a live
                # decode re-registers on its next attach
                self.stats["peers_dropped"] += 1
                self._drop_peer(peer, f"decode agent {peer.agent_name} disconnected")

    def poll(self) -> int:
        """Drive transfers: check in-flight handles, finish rooms. Returns how many rooms
        still need polling (0: the poller may sleep until woken)."""
        busy = 0
        now = self.clock()
        for r in self.rooms.in_state(RoomState.TRANSFERRING):
            if r.state != RoomState.TRANSFERRING:  # failed meanwhile by a peer drop
                continue
            if r.xfer is None:
                if r.stages and now - r.posted_at >= self.stall_before_post:
                    self._post_next(r)
                if r.state == RoomState.TRANSFERRING:
                    busy += 1
                continue
            try:
                st = self.agent.check(r.xfer)
            except NixlError as e:
                self._on_nixl_error(r, e)
                continue
            if st == "DONE":
                self._stage_done(r)
            if r.state == RoomState.TRANSFERRING:
                busy += 1
        busy += self.reader.poll()
        self.agent.retry_releases()
        if now < self._flush_until:
            self.agent.progress()
            busy += 1
        self._expire_parked(now)
        return busy

    # --- the watchdog's share: work that must move without traffic ----------------------
    def sweep(self, now: float | None = None) -> dict[str, int]:
        """Run every watchdog tick, traffic or not: drop parked attaches older than
        `pending_attach_ttl` and retry deferred handle releases (poll() also does both, but
        runs only while transfers are in flight). Every handle still deferred afterwards is
        logged with its reason. Returns counts for tests and logs."""
        now = self.clock() if now is None else now
        expired = self._expire_parked(now)
        released = 0
        for room, d in list(self._deferred.items()):
            still = [x for x in d.handles if self.agent.release(x) is False]
            released += len(d.handles) - len(still)
            d.handles = still
            if still:
                log.warning("NIXL handles still not released; pages stay held", room=room, handles=len(still),
                            held_s=round(now - d.since, 1),
                            error=getattr(still[0], "release_error", "") or "still active")
                continue
            del self._deferred[room]
            log.info("deferred NIXL handle released", room=room, held_s=round(now - d.since, 1))
            for fn in d.on_quiesced:
                fn()
        return {"expired_attaches": expired, "released_handles": released, "deferred_rooms": len(self._deferred)}

    def _expire_parked(self, now: float) -> int:
        n = 0
        for room, a in list(self._pending.items()):
            if now - a.at > self.pending_attach_ttl:
                del self._pending[room]
                n += 1
                log.warning("parked attach dropped: no Prefill RPC in time", room=room, agent=a.agent_name,
                            ttl_s=self.pending_attach_ttl)
        return n

    def quiesced(self, room: int) -> bool:
        """True iff no live or deferred NIXL transfer references the room: decode may reuse
        the room's pages, and this worker may free its source pages."""
        r = self.rooms.get(room)
        return (r is None or r.state.terminal) and room not in self._deferred

    def free_when_quiesced(self, room: int, free: Callable[[], None]) -> bool:
        """Call free() (the worker returns the room's source pages) now if no deferred handle
        may still read them, else once a sweep has released the last one. True if now."""
        d = self._deferred.get(room)
        if d is None:
            free()
            return True
        d.on_quiesced.append(free)
        return False

    @property
    def num_deferred_handles(self) -> int:
        return sum(len(d.handles) for d in self._deferred.values())

    def abort(self, room: int, reason: str) -> bool:
        """Abort from either side. Fails a live room; a room not created yet is remembered as
        failed so a later attach is refused. Returns whether the room was known."""
        if room in self._pending:
            del self._pending[room]
            self.rooms.tombstone(room, RoomState.FAILED)
            return True
        r = self.rooms.get(room)
        if r is None:
            known = self.rooms.is_known(room)
            self.rooms.tombstone(room, RoomState.FAILED)
            return known
        self._fail(r, reason)
        return True

    def _fail(self, r: SenderRoom, reason: str, tell_peer: bool = True) -> bool:
        if not r.fail(reason, self.clock()):
            return False
        self.stats["failed"] += 1
        log.warning("kv send failed", room=r.room, reason=reason)
        if tell_peer and r.attach is not None:
            # best-effort: decode fails the room now rather than at its next heartbeat. With no
            # progress thread the message moves only while someone drives UCX: poll() does, for
            # a short window.
            if self.agent.send_notif(r.peer, AbortNotification(r.room, self.epoch, reason).encode()):
                self._flush_until = self.clock() + NOTIF_FLUSH_SECONDS
                self.wakeup()
        self._finish(r)
        return True

    def _finish(self, r: SenderRoom) -> None:
        """Terminal: release NIXL handles (the WRITE's, a READ's) and aux slot, tell the owner."""
        self._release_handle(r)
        read = self.reader.cancel(r.room)
        if read is not None:  # the READ may still land in the room's pages: they wait for it
            self._deferred.setdefault(r.room, _Deferred(self.clock())).handles.append(read)
            log.warning("NIXL refused to release a READ handle; the room's pages stay held until a sweep releases it",
                        room=r.room, error=getattr(read, "release_error", "") or "still active")
        r.stages = []
        if r.aux_slot is not None:
            self.pool.aux_allocator.free([r.aux_slot], owner=("kv-send", r.room))
            r.aux_slot = None
        self._tell_owner(r)

    def release(self, room: int) -> SenderRoom | None:
        """Forget a room (its terminal state is remembered). A non-terminal room fails first."""
        r = self.rooms.get(room)
        if r is not None and not r.state.terminal:
            self._fail(r, "released while in flight")
        return self.rooms.remove(room)

    # --- heartbeat ----------------------------------------------------------------------
    def heartbeat(self, agent_name: str, epoch: int, rooms: list[int]) -> tuple[list[int], list[int], bool]:
        """(held, forward_done, registered) for decode's liveness check."""
        held, done = [], []
        for room in rooms:
            r = self.rooms.get(room)
            if r is not None:
                if r.state == RoomState.FAILED or (r.peer is not None and r.peer != agent_name):
                    continue
                held.append(room)
                if r.state in (RoomState.TRANSFERRING, RoomState.SUCCESS):
                    done.append(room)
            elif room in self._pending:
                if self._pending[room].agent_name == agent_name:
                    held.append(room)
            elif self.rooms.outcome(room) == RoomState.SUCCESS:
                held.append(room)
                done.append(room)
        return held, done, self.peer_registered(agent_name, epoch)

    # --- introspection ------------------------------------------------------------------
    @property
    def num_pending_attach(self) -> int:
        return len(self._pending)


__all__ = ["KVSender", "SenderRoom", "BootstrapRejected", "Peer", "AttachInfo", "DuplicateRoom"]
