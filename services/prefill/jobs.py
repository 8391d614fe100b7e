"""A prefill job: one Prefill RPC's room, its phase, and how it ended (no torch, no nixl).

One phase enum says where the job is; everything else is derived. The transfer layer's room
state (services/transfer/state.py) says where the KV transfer is — whether decode attached,
whether the WRITE is done — and the worker turns its terminal states into the job's outcome.

  QUEUED    waiting for decode's Attach, or attached and waiting for its next chunk
  READING   attached, pages held: a NIXL READ brings the prompt pages decode holds beyond this
            worker's own prefix-cache hit (services/transfer/reader.py); back to QUEUED when it
            ends, bounded by --kv-read-timeout (a failed READ only means those tokens are computed)
  FORWARD   one of its chunks is in the engine (its pages are in use by the forward)
  INFLIGHT  final chunk done, first token sampled, KV WRITE posted to decode
  FINISHED  outcome delivered to the RPC; pages go back once no forward holds them

Every success, failure, abort and eviction ends in `PrefillWorker.finish(job, outcome)`.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.common.sampling_params import SamplingParams

if TYPE_CHECKING:  # a type only: jobs stay free of torch
    from services.common.prompt_logprobs import PromptLogprobs


class Phase(enum.IntEnum):
    QUEUED = 0
    READING = 1
    FORWARD = 2
    INFLIGHT = 3
    FINISHED = 4


class RoomFailed(Exception):
    """The room ended without its KV reaching decode. `code` is the gRPC status code name the
    Prefill RPC fails with (DEADLINE_EXCEEDED for watchdog evictions, CANCELLED for aborts)."""

    def __init__(self, reason: str, code: str = "UNAVAILABLE"):
        super().__init__(reason)
        self.reason = reason
        self.code = code


@dataclass
class PrefillResult:
    first_token: int
    first_logprob: float
    prompt_tokens: int
    kv_bytes: int
    kv_transfer_seconds: float
    first_top: list[tuple[int, float]] | None = None  # top_logprobs alternatives of the first token
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not computed)
    prompt_logprobs: PromptLogprobs | None = None  # when params.prompt_logprobs is set


@dataclass(eq=False)
class Job:
    room: int
    token_ids: list[int]
    params: SamplingParams
    seq: int  # arrival order
    future: asyncio.Future  # PrefillResult, or RoomFailed
    phase: Phase = Phase.QUEUED
    created_at: float = field(default_factory=time.monotonic)
    pages: list[int] | None = None  # allocated at its first chunk, held until the WRITE is done
    prefilled: int = 0  # prompt tokens whose KV is in its pages (cached or computed)
    cached_tokens: int = 0  # of those, not computed: found in the prefix cache (its first pages are shared), or READ from decode
    cache_keys: list[bytes] | None = None  # its full pages' prefix-cache keys, computed once
    read_pages: int = 0  # READING: pages its READ brings, right after the `prefilled` ones
    first_token: int = -1
    first_logprob: float = 0.0
    first_top: list[tuple[int, float]] | None = None  # top_logprobs alternatives of the first token
    share_key: int = 0  # n > 1: jobs of one key compute their common prompt once (sharing.py)
    canary: bool = False  # the router's canary: served as any job, left out of the request metrics
    prompt_lp: PromptLogprobs | None = None  # params.prompt_logprobs set: what its chunks computed so far

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED

    @property
    def remaining(self) -> int:
        return len(self.token_ids) - self.prefilled

    @property
    def order(self) -> tuple[int, int]:
        """Its place among the waiting jobs: vLLM's priority (lower first; 0 for every job unless
        the router's --scheduling-policy is priority), then arrival."""
        return self.params.priority, self.seq
