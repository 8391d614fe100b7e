"""Lane messages never exceed the transport's message limit, whatever one call carries.

A lane message carries every entry that was ready when it was written; without a bound one large
call (a long prompt, a big grammar, times n) would make a message past gRPC's
`max_send_message_length`, and gRPC would fail the whole stream: every unrelated call on that
worker. So a batch is cut into messages of at most `LANE_MESSAGE_BYTES`, and an entry that could
not fit even alone is refused by itself (RESOURCE_EXHAUSTED) and never sent.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from services.common.grpc_server import MAX_MESSAGE_BYTES

# room for the envelope: each entry of a repeated field adds a tag and a length varint (< 16 bytes)
ENTRY_OVERHEAD_BYTES = 16
LANE_MESSAGE_BYTES = MAX_MESSAGE_BYTES - 64 * 1024


def entry_bytes(entry) -> int:
    """Bytes one entry adds to a lane message."""
    return entry.ByteSize() + ENTRY_OVERHEAD_BYTES


def batches(entries: Sequence, sizes: Sequence[int], limit: int = LANE_MESSAGE_BYTES) -> Iterator[list]:
    """`entries` in order, grouped into lists whose sizes sum to at most `limit` (each entry
    must fit alone: the caller refuses the ones that do not)."""
    group: list = []
    used = 0
    for entry, size in zip(entries, sizes, strict=True):
        if group and used + size > limit:
            yield group
            group, used = [], 0
        group.append(entry)
        used += size
    if group:
        yield group
