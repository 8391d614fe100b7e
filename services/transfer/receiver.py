"""Decode side of the KV transfer: rooms waiting for KV, notifications, aux-row verification.

Owned by the decode worker's asyncio loop. Typical life of a room:

    receiver.create_room(room, bootstrap_addr)       # Decode RPC arrived -> Bootstrapping
    params = receiver.prepare_attach(room, pages)    # pages allocated by the worker; aux slot taken
    (Attach RPC, see services/transfer/bootstrap.py: KVReceiveCoordinator does all of this)
    receiver.mark_attached(room, sender_agent, sender_epoch)   # -> WaitingForInput (phase 1)
    receiver.mark_forward_done(room)                 # heartbeat says forward done -> Transferring (phase 2)
    receiver.poll()                                  # notification + verified aux row -> Success
    row = receiver.result(room)                      # first token id and logprob
    receiver.release(room)                           # worker took over the pages -> gone

A notification is accepted only if it comes from the agent the room attached to, carries this
receiver's epoch and the sender's epoch, and the aux row in the room's slot names this room and
that sender epoch. Anything else fails the room: never wrong KV with a 200.

No torch and no nixl import (the agent is passed in).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.logging_setup import get_logger
from services.transfer.kv_checksum import NONE as NO_CHECKSUM
from services.transfer.kv_checksum import kv_checksum
from services.transfer.reader import page_checksum
from services.transfer.side import TransferSide
from services.transfer.state import Clock, Room, RoomState
from services.transfer.wire_format import (
    AUX_CHECKSUM,
    AUX_WORDS,
    AbortNotification,
    AuxRow,
    KVNotification,
    verify_aux,
)

log = get_logger("transfer.receiver")


@dataclass(frozen=True)
class AttachParams:
    room: int
    agent_name: str
    epoch: int
    dst_pages: list[int]
    dst_aux_slot: int
    skip_pages: int = 0  # leading prompt pages decode holds already: prefill sends the rest
    # their ids, offered for prefill's READ (empty: not offered), and each one's KV checksum
    held_pages: list[int] = field(default_factory=list)
    held_checksums: list[int] = field(default_factory=list)


@dataclass(eq=False)
class ReceiverRoom(Room):
    peer: str = ""  # the prefill's bootstrap address
    dst_pages: list[int] | None = None
    aux_slot: int | None = None
    sender_agent: str | None = None
    sender_epoch: int | None = None
    result: AuxRow | None = None
    attached_at: float | None = None
    forward_done_at: float | None = None
    early: list[tuple[str, KVNotification]] | None = None  # notifications before the attach reply
    code: str = "UNAVAILABLE"  # the gRPC code its failure maps to (DATA_LOSS: the KV checksum failed)


_WAITING = (RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING)


class KVReceiver(TransferSide[ReceiverRoom]):
    logger = log

    def __init__(
        self,
        agent,
        pool,
        *,
        clock: Clock = time.monotonic,
        on_terminal: Callable[[ReceiverRoom], None] | None = None,
        tombstones: int = 65536,
        verify_checksum: bool = False,
        corrupt_kv: float = 0.0,
        fault_seed: int = 0,
        corrupt_kv_read: bool = False,
    ):
        """agent: NixlAgent of this process; pool: KVPool (uses .aux and .aux_allocator, and
        .page_run_bytes to verify the KV checksum)."""
        super().__init__(agent, pool, clock, on_terminal, tombstones)
        # check every room's KV against the sender's checksum before it is used
        # (services/transfer/kv_checksum.py); rows that carry none (sender's check off) pass
        self.verify_checksum = verify_checksum
        # TEST-ONLY fault knob: with this probability a room's first page is corrupted after its
        # WRITE landed (every value negated: finite, and wrong), drawn from a generator seeded with fault_seed
        self.corrupt_kv = corrupt_kv
        self._fault_rng = random.Random(fault_seed)
        if corrupt_kv:
            log.warning("FAULT INJECTION ON: KV receiver corrupts a room's KV", probability=corrupt_kv)
        # TEST-ONLY fault knob: the checksum of the last held page an Attach offers is wrong (a READ
        # always takes the last: prefill reads from the end of its own hit on),
        # so prefill's READ of it fails verification and prefill computes those tokens itself
        self.corrupt_kv_read = corrupt_kv_read
        if corrupt_kv_read:
            log.warning("FAULT INJECTION ON: held-page checksums in Attach are wrong")
        # remembers a cached page's checksum while it stays cached (the decode worker sets its
        # PrefixCache here): an offered page is hashed once, not once per round
        self.checksum_memo = None
        self.stats = {"success": 0, "failed": 0, "dropped_notifs": 0, "foreign_notifs": 0}

    # --- rooms --------------------------------------------------------------------------
    def create_room(self, room: int, peer: str) -> ReceiverRoom:
        """Raises DuplicateRoom for a live or finished room id."""
        return self.rooms.add(ReceiverRoom(room, self.clock(), peer=peer))

    def prepare_attach(self, room: int, dst_pages: list[int], skip_pages: int = 0,
                       held_pages: list[int] = ()) -> AttachParams:
        """Record the destination pages (allocated by the worker) and take an aux slot. Held
        pages offered for a READ get a KV checksum each (with verify_checksum on): they are
        complete, shared, read-only cache pages, so their bytes do not change while the room
        holds them; prefill compares what its READ brought."""
        r = self.rooms.get(room)
        if r is None or r.state != RoomState.BOOTSTRAPPING:
            raise ValueError(f"room {room} cannot attach ({'unknown' if r is None else r.state.label})")
        if r.aux_slot is None:
            r.aux_slot = self.pool.aux_allocator.alloc(1, owner=("kv-recv", room))[0]
            for i in range(AUX_WORDS):  # a stale row can never pass verification
                self.pool.aux[r.aux_slot, i] = 0
        r.dst_pages = list(dst_pages)
        r.early = []
        self.wakeup()  # poll notifications from now on (one may beat the attach reply)
        checksums = [self._held_checksum(p) for p in held_pages] if self.verify_checksum else []
        if checksums and self.corrupt_kv_read:
            checksums[-1] ^= 1
            log.warning("FAULT: held-page checksum corrupted in Attach", room=room, page=held_pages[-1])
        return AttachParams(room, self.agent_name, self.epoch, list(dst_pages), r.aux_slot, skip_pages,
                            list(held_pages), checksums)

    def _held_checksum(self, page: int) -> int:
        def compute(p: int) -> int:
            return page_checksum(self.pool.page_run_bytes, p)

        return compute(page) if self.checksum_memo is None else self.checksum_memo.checksum(page, compute)

    def mark_attached(self, room: int, sender_agent: str, sender_epoch: int) -> bool:
        """The Attach RPC succeeded -> WaitingForInput. False if the room is gone or terminal."""
        r = self.rooms.for_event(room, open_only=True)
        if r is None:
            return False
        r.sender_agent, r.sender_epoch = sender_agent, sender_epoch
        r.attached_at = self.clock()
        r.advance(RoomState.WAITING_FOR_INPUT, r.attached_at)
        early, r.early = r.early or [], None
        for sender, n in early:
            self._on_notif(r, sender, n)
        self.wakeup()
        return True

    def mark_forward_done(self, room: int) -> bool:
        """Prefill finished the forward and is sending -> Transferring (phase-2 clock)."""
        r = self.rooms.get(room)
        if r is None or r.state != RoomState.WAITING_FOR_INPUT:
            return False
        r.forward_done_at = self.clock()
        return r.advance(RoomState.TRANSFERRING, r.forward_done_at)

    def poll(self) -> int:
        """Fetch notifications (this also drives UCX progress, which the sender's WRITE needs
        to complete). Returns how many rooms still wait for KV."""
        for sender, msgs in self.agent.get_notifs().items():
            for msg in msgs:
                abort = AbortNotification.decode(msg)
                if abort is not None:
                    self._on_abort(sender, abort)
                    continue
                n = KVNotification.decode(msg)
                if n is None:
                    self.stats["foreign_notifs"] += 1
                    continue
                r = self.rooms.for_event(n.room, open_only=True)
                if r is None:
                    self.stats["dropped_notifs"] += 1  # late: the room is gone
                    continue
                if r.state == RoomState.BOOTSTRAPPING:
                    if r.early is None:  # not even attaching: cannot be ours
                        self.stats["dropped_notifs"] += 1
                        continue
                    r.early.append((sender, n))
                    continue
                self._on_notif(r, sender, n)
        return self.num_waiting

    @property
    def num_waiting(self) -> int:
        return sum(
            1
            for r in self.rooms
            if r.state in _WAITING or (r.state == RoomState.BOOTSTRAPPING and r.early is not None)
        )

    def _on_abort(self, sender: str, a: AbortNotification) -> None:
        r = self.rooms.get(a.room)
        # only the prefill generation this room attached to may abort it
        if r is None or r.state.terminal or r.sender_agent != sender or r.sender_epoch != a.sender_epoch:
            self.stats["dropped_notifs"] += 1
            return
        self._fail(r, f"prefill gave up the room: {a.reason}")

    def _on_notif(self, r: ReceiverRoom, sender: str, n: KVNotification) -> None:
        if r.state.terminal:
            return
        if sender != r.sender_agent:
            self._fail(r, f"KV notification for room {r.room} from {sender}, attached to {r.sender_agent}")
            return
        if n.receiver_epoch != self.epoch or n.sender_epoch != r.sender_epoch:
            self._fail(
                r,
                f"KV notification epochs (sender {n.sender_epoch}, receiver {n.receiver_epoch}) "
                f"!= expected (sender {r.sender_epoch}, receiver {self.epoch})",
            )
            return
        words = [int(v) for v in self.pool.aux[r.aux_slot].tolist()]
        row = AuxRow.from_words(words)
        why = verify_aux(row, r.room, r.sender_epoch)
        if why:
            self._fail(r, why)
            return
        if self.corrupt_kv and row.sent_pages and self._fault_rng.random() < self.corrupt_kv:
            self.pool.kv[r.dst_pages[0]].neg_()
            log.warning("FAULT: KV page corrupted after its WRITE landed", room=r.room, page=r.dst_pages[0])
        why = self._check_kv(r, row, words)
        if why:
            self._fail(r, why, code="DATA_LOSS")
            return
        r.result = row
        r.advance(RoomState.SUCCESS, self.clock())
        self.stats["success"] += 1
        self._tell_owner(r)

    def result(self, room: int) -> AuxRow | None:
        r = self.rooms.get(room)
        return r.result if r is not None else None

    def _check_kv(self, r: ReceiverRoom, row: AuxRow, words: list[int]) -> str | None:
        """None when the room's KV pages hash to the sender's checksum (or it sent none), else why not."""
        if not self.verify_checksum or row.checksum == NO_CHECKSUM:
            return None
        if not 0 < row.sent_pages <= len(r.dst_pages or ()):
            return f"KV checksum: the sender wrote {row.sent_pages} pages, the room has {len(r.dst_pages or ())}"
        pages = r.dst_pages[: row.sent_pages]
        if kv_checksum(self.pool.page_run_bytes, pages, words[:AUX_CHECKSUM]) != row.checksum:
            return f"KV checksum mismatch over pages {pages[:8]}{'...' if len(pages) > 8 else ''} (corrupt or misplaced KV)"
        return None

    def _fail(self, r: ReceiverRoom, reason: str, code: str = "UNAVAILABLE") -> bool:
        if not r.fail(reason, self.clock()):
            return False
        r.code = code
        self.stats["failed"] += 1
        log.warning("kv receive failed", room=r.room, reason=reason)
        self._tell_owner(r)
        return True

    def release(self, room: int) -> ReceiverRoom | None:
        """Forget a room and free its aux slot (the worker keeps/frees the KV pages).
        A non-terminal room fails first."""
        r = self.rooms.get(room)
        if r is None:
            return None
        if not r.state.terminal:
            self._fail(r, "released while in flight")
        if r.aux_slot is not None:
            self.pool.aux_allocator.free([r.aux_slot], owner=("kv-recv", room))
            r.aux_slot = None
        return self.rooms.remove(room)

    # --- liveness -----------------------------------------------------------------------
    def waiting_by_peer(self) -> dict[str, list[int]]:
        """Attached rooms still waiting for KV, grouped by prefill address (for heartbeats)."""
        out: dict[str, list[int]] = {}
        for r in self.rooms.in_state(*_WAITING):
            out.setdefault(r.peer, []).append(r.room)
        return out

    def apply_heartbeat(
        self, peer: str, asked: list[int], sender_epoch: int, held: list[int], forward_done: list[int]
    ) -> list[int]:
        """Fail asked rooms prefill no longer holds (or held by another prefill generation);
        start phase 2 for rooms whose forward is done. Returns the rooms failed."""
        held_s, done_s, failed = set(held), set(forward_done), []
        for room in asked:
            r = self.rooms.get(room)
            if r is None or r.state not in _WAITING or r.peer != peer:
                continue
            if r.sender_epoch != sender_epoch:
                if self._fail(r, f"prefill {peer} restarted (epoch {r.sender_epoch} -> {sender_epoch})"):
                    failed.append(room)
            elif room not in held_s:
                if self._fail(r, f"prefill {peer} no longer holds room {room}"):
                    failed.append(room)
            elif room in done_s:
                self.mark_forward_done(room)
        return failed

    def fail_waiting_for_input(self, peer: str, reason: str, sender_epoch: int | None = None) -> list[int]:
        """Prefill is alive but its forward is stuck: fail the rooms still waiting for their
        forward (phase 1), of its generation `sender_epoch` when given (a room of an earlier one
        fails as "restarted", by apply_heartbeat). Rooms in phase 2 keep their own transfer clock."""
        failed = []
        for r in self.rooms.in_state(RoomState.WAITING_FOR_INPUT):
            if sender_epoch is not None and r.sender_epoch != sender_epoch:
                continue
            if r.peer == peer and self._fail(r, reason):
                failed.append(r.room)
        return failed

    def fail_peer(self, peer: str, reason: str) -> list[int]:
        """Prefill unreachable: fail every room waiting on it (incl. ones still attaching)."""
        failed = []
        for r in self.rooms:
            if r.peer == peer and not r.state.terminal and self._fail(r, reason):
                failed.append(r.room)
        return failed
