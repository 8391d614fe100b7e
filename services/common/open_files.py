"""The process's open-files limit (RLIMIT_NOFILE), raised to what a service needs.

Every client connection is a file descriptor. Where the soft limit is below what the router's
--max-connections needs (Docker 25 and later start containers at a soft 1,024 under a high hard
limit; many hosts default to 1,024), accept() fails with EMFILE long before the router's own
connection bound would close the longest-idle connection to make room: a client holding about a
thousand idle connections would keep every other client out. So the router raises the soft limit
towards the hard one at start (as vLLM and SGLang do), and where even the hard limit is too low
it serves fewer connections than asked, with a warning, so that its bound still acts first.
The workers raise theirs too (WORKER_OPEN_FILES), and warn where the hard limit holds it lower.
"""

from __future__ import annotations

import resource

# descriptors the router keeps for itself beside client connections: its lanes and gRPC channels
# to the workers, the listening socket, the event loop's, logs, the tokenizer's files (an idle
# router with one prefill and one decode holds about 25)
RESERVED = 256

# a worker's descriptors: a connection (or two) per router process and per peer worker, NIXL's
# UCX endpoints and shared-memory segments per peer, the checkpoint's files; few in a small mesh,
# but a container's soft 1,024 is within reach of a large one, so each worker raises its soft
# limit to this at start (where the hard limit allows)
WORKER_OPEN_FILES = 65536
WORKER_OPEN_FILES_LOW = 4096  # a hard limit holding a worker under this is worth a warning


def raise_soft_limit(wanted: int) -> tuple[int, int]:
    """Raise the soft open-files limit to `wanted` (the hard limit where that is lower); never
    lower it. Returns (soft, hard) as they are afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass  # as it was: the caller sizes itself to what it has
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft, hard


def reserved_within(soft: int) -> int:
    """The descriptors kept for the router's own files under a soft limit of `soft`."""
    return min(RESERVED, soft // 4)


def connections_within(max_connections: int, soft: int) -> int:
    """The most client connections that fit under `soft` descriptors beside the router's own."""
    if soft == resource.RLIM_INFINITY:
        return max_connections
    return max(1, min(max_connections, soft - reserved_within(soft)))
