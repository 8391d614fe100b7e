"""The version of the protocol between the router and its workers (worker.proto's calls and what
each side expects of the other's behaviour), which they exchange in every health probe's Load
call and check: the KV transfer between prefill and decode has its own version
(services/transfer/wire_format.py, checked at bootstrap).

Compatibility: a peer is accepted when its version is at least this side's minimum, and this
side's version at least the peer's minimum. A release that keeps working with the previous one
bumps PROTOCOL_VERSION only (router and workers may then differ by one release, in either
order, through a rolling upgrade); one that cannot also raises MIN_PEER_VERSION (then router and
workers must be upgraded together). Version 0 is a release from before the versions; it speaks
version 1's protocol.
"""

from __future__ import annotations

PROTOCOL_VERSION = 2  # 2: refusal codes, prompt logprobs, epoch and page size in Load
MIN_PEER_VERSION = 0


def incompatibility(peer: str, peer_version: int, peer_min: int,
                    version: int = PROTOCOL_VERSION, min_version: int = MIN_PEER_VERSION) -> str:
    """Why this side and `peer` cannot work together ("" when they can), as one log-ready sentence."""
    if peer_version < min_version:
        return (f"{peer} speaks router-worker protocol version {peer_version}, older than this side's minimum "
                f"{min_version} (this side speaks {version}); upgrade it")
    if version < peer_min:
        return (f"{peer} needs router-worker protocol version {peer_min} or newer, this side speaks {version}; "
                f"upgrade this side")
    return ""
