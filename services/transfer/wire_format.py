"""Wire-level constants and codecs of the KV transfer: protocol version, notification tags,
aux row words, agent names and memory layouts.

Pure Python (no torch, no nixl), so both the state machines and the tests use it freely.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from dataclasses import dataclass
from enum import StrEnum

# Bump on any change to bootstrap.proto, to the notification format or to the aux row layout.
# 2: AbortReply.quiesced, HeartbeatReply.forward_age_seconds; 3: AttachRequest.skip_pages, aux AUX_CACHED;
# 4: aux AUX_SENT_PAGES, AUX_CHECKSUM (the KV checksum, services/transfer/kv_checksum.py);
# 5: AttachRequest.held_pages, held_checksums (prefill READs decode's held prefix pages)
PROTOCOL_VERSION = 5

# aux row words (int64), mirrored from services/engine/kv_pool.py (kept equal by a unit test).
AUX_ROOM, AUX_TOKEN, AUX_LOGPROB_BITS, AUX_EPOCH, AUX_CACHED, AUX_SENT_PAGES, AUX_CHECKSUM = 0, 1, 2, 3, 4, 5, 6
AUX_WORDS = 7

_NOTIF_PREFIX = b"pdmesh-kv"

# Rooms and epochs travel as uint64 on the wire and as int64 in the aux row.
MAX_ROOM = (1 << 63) - 1


class TransferError(RuntimeError):
    """Base of the transfer layer's errors."""


class ProtocolMismatch(TransferError):
    """The peer speaks another protocol version (maps to gRPC FAILED_PRECONDITION)."""

    def __init__(self, local: int, remote: int, who: str = "peer"):
        self.local, self.remote = local, remote
        super().__init__(
            f"KV bootstrap protocol version mismatch: {who} speaks version {remote}, "
            f"this worker speaks version {local}; upgrade both sides to the same pdmesh release"
        )


class NixlError(TransferError):
    """A NIXL call failed; ``disconnected`` when NIXL reported the remote peer gone.
    (Defined here, not next to the agent, so that code handling it needs no nixl import.)"""

    def __init__(self, msg: str, disconnected: bool = False):
        super().__init__(msg)
        self.disconnected = disconnected


def check_protocol_version(remote: int, who: str = "peer", local: int = PROTOCOL_VERSION) -> None:
    if remote != local:
        raise ProtocolMismatch(local, remote, who)


class MemoryKind(StrEnum):
    DRAM = "DRAM"
    VRAM = "VRAM"


@dataclass(frozen=True)
class MemoryLayout:
    """Where a worker's registered KV pages and aux rows live (the peer computes addresses)."""

    kv_base_addr: int
    page_nbytes: int
    num_pages: int
    kv_memory_kind: MemoryKind
    kv_device_id: int
    aux_base_addr: int
    aux_row_nbytes: int
    num_aux_slots: int

    def page_addr(self, page: int) -> int:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} outside 0..{self.num_pages - 1}")
        return self.kv_base_addr + page * self.page_nbytes

    def aux_addr(self, slot: int) -> int:
        if not 0 <= slot < self.num_aux_slots:
            raise ValueError(f"aux slot {slot} outside 0..{self.num_aux_slots - 1}")
        return self.aux_base_addr + slot * self.aux_row_nbytes

    def compatible_with(self, other: MemoryLayout) -> str | None:
        """None when KV pages and aux rows of the two layouts have the same shape, else why not."""
        if self.page_nbytes != other.page_nbytes:
            return f"page size differs: {self.page_nbytes} vs {other.page_nbytes} bytes (model/page_size/dtype mismatch)"
        if self.aux_row_nbytes != other.aux_row_nbytes:
            return f"aux row size differs: {self.aux_row_nbytes} vs {other.aux_row_nbytes} bytes"
        return None


# --- agent names -------------------------------------------------------------------------


def new_epoch() -> int:
    """A per-start number: later starts get larger epochs (wall clock in ns, fits int64)."""
    return time.time_ns() & MAX_ROOM


def agent_name(role: str, epoch: int, host: str | None = None, pid: int | None = None) -> str:
    host = host or socket.gethostname()
    pid = os.getpid() if pid is None else pid
    return f"pdmesh-{role}-{host}-{pid}-{epoch}"


# --- notifications -----------------------------------------------------------------------


@dataclass(frozen=True)
class KVNotification:
    """Sent by NIXL with the WRITE of a room's KV; delivered only after the bytes landed."""

    room: int
    sender_epoch: int
    receiver_epoch: int

    def encode(self) -> bytes:
        return b"%s:%d:%d:%d" % (_NOTIF_PREFIX, self.room, self.sender_epoch, self.receiver_epoch)

    @classmethod
    def decode(cls, msg: bytes) -> KVNotification | None:
        """None for anything that is not one of ours (malformed messages are ignored)."""
        parts = msg.split(b":")
        if len(parts) != 4 or parts[0] != _NOTIF_PREFIX:
            return None
        try:
            room, s_epoch, r_epoch = (int(p) for p in parts[1:])
        except ValueError:
            return None
        return cls(room, s_epoch, r_epoch)


@dataclass(frozen=True)
class AbortNotification:
    """Prefill gave up a room decode attached to (eviction, abort): sent best-effort with NIXL's
    notification channel so decode fails the room at once instead of at its next heartbeat."""

    room: int
    sender_epoch: int
    reason: str

    def encode(self) -> bytes:
        return b"%s:%d:%d:%s" % (_ABORT_PREFIX, self.room, self.sender_epoch, self.reason.encode()[:200])

    @classmethod
    def decode(cls, msg: bytes) -> AbortNotification | None:
        parts = msg.split(b":", 3)
        if len(parts) != 4 or parts[0] != _ABORT_PREFIX:
            return None
        try:
            return cls(int(parts[1]), int(parts[2]), parts[3].decode(errors="replace"))
        except ValueError:
            return None


_ABORT_PREFIX = b"pdmesh-abort"


# --- aux row -----------------------------------------------------------------------------


def float_to_bits(x: float) -> int:
    """A float64 as the signed int64 with the same bits (what the aux row stores)."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def bits_to_float(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


@dataclass(frozen=True)
class AuxRow:
    room: int
    token: int
    logprob: float
    epoch: int  # the sender's epoch
    cached_tokens: int = 0  # prompt tokens the sender found in its prefix cache (usage reports them)
    sent_pages: int = 0  # KV pages the WRITE carries (the first ones of the room's destination pages)
    checksum: int = 0  # the KV checksum of those pages and the words before it; 0: none computed

    def words(self) -> list[int]:
        w = [0] * AUX_WORDS
        w[AUX_ROOM] = self.room
        w[AUX_TOKEN] = self.token
        w[AUX_LOGPROB_BITS] = float_to_bits(self.logprob)
        w[AUX_EPOCH] = self.epoch
        w[AUX_CACHED] = self.cached_tokens
        w[AUX_SENT_PAGES] = self.sent_pages
        w[AUX_CHECKSUM] = self.checksum
        return w

    @classmethod
    def from_words(cls, w: list[int]) -> AuxRow:
        return cls(
            room=w[AUX_ROOM],
            token=w[AUX_TOKEN],
            logprob=bits_to_float(w[AUX_LOGPROB_BITS]),
            epoch=w[AUX_EPOCH],
            cached_tokens=w[AUX_CACHED],
            sent_pages=w[AUX_SENT_PAGES],
            checksum=w[AUX_CHECKSUM],
        )


def verify_aux(row: AuxRow, room: int, sender_epoch: int) -> str | None:
    """None when the aux row belongs to this room from this sender generation, else why not."""
    if row.room != room:
        return f"aux row carries room {row.room}, expected {room} (stale or misdirected KV)"
    if row.epoch != sender_epoch:
        return f"aux row carries sender epoch {row.epoch}, expected {sender_epoch} (sender restarted?)"
    return None
