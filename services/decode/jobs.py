"""A decode job: one Decode RPC's room, its phase, and what it streams (no torch, no nixl).

  PREALLOC     waiting for KV pages for its prompt (+1 token)
  ATTACHING    pages held; the Attach RPC to prefill is in flight — prefill may learn the page
               ids and WRITE into them from here until it lets go of the room
  AWAITING_KV  attached: prefill computes (phase 1, bounded by its liveness and progress) or
               sends (phase 2, bounded by --transfer-timeout); the receiver's room state says which
  PREFILLING   colocated (no prefill worker): pages held; decode computes the prompt itself,
               in chunks under --chunked-prefill-size that alternate with decode steps, and
               samples the first token (services/decode/local_prefill.py)
  RUNNING      KV and first token arrived (or were computed here): in the decode batch, one token per step
  RETRACTED    gave its pages back when the pool ran dry; recomputes its KV to rejoin the batch
  FINISHED     last chunk or failure delivered; pages released once nothing uses them

Every stop, length, failure, abort and eviction ends in `DecodeWorker.finish(job, failure)`.
Whether an operation still uses a job's pages (an attach RPC, a forward) is known to the
component running that operation, not stored on the job.
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
    PREALLOC = 0
    ATTACHING = 1
    AWAITING_KV = 2
    PREFILLING = 3
    RUNNING = 4
    RETRACTED = 5
    FINISHED = 6


# Phases in which prefill knows the job's page ids and may still WRITE into them: pages of a
# job that ends here are quarantined until prefill lets go of the room.
PAGES_EXPOSED = (Phase.ATTACHING, Phase.AWAITING_KV)


class DecodeFailed(Exception):
    def __init__(self, reason: str, code: str = "UNAVAILABLE"):
        super().__init__(reason)
        self.reason = reason
        self.code = code  # gRPC status code name


@dataclass
class Tokens:
    """One streamed chunk: one token as the worker emits it, or several coalesced (coalesce())."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    completion_tokens: int  # total so far
    # per token, the top_logprobs alternatives [(id, logprob)]; empty when the request asked for none
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    def extend(self, later: Tokens) -> None:
        """Append the next chunk's tokens (every per-token list stays aligned with token_ids)."""
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        self.top_logprobs += later.top_logprobs
        self.finish_reason = later.finish_reason
        self.completion_tokens = later.completion_tokens


def coalesce(first: Tokens, queue: asyncio.Queue) -> tuple[Tokens, object | None]:
    """`first` plus every Tokens already queued behind it, as one chunk, and the item that stopped
    the merge (a DecodeFailed, sent after the tokens before it), if any.

    Tokens pile up in a room's queue while the stream is still writing the previous chunk (the
    client or the router reads slower than decode produces): sending them as one DecodeChunk
    costs the reader one message instead of one per token. A stream that keeps up still gets
    one token per chunk, when each is produced."""
    merged: Tokens | None = None
    while not first.finish_reason and not queue.empty():
        item = queue.get_nowait()
        if not isinstance(item, Tokens):
            return merged or first, item
        if merged is None:  # a copy: `first` stays as the worker made it
            merged = Tokens(list(first.token_ids), list(first.logprobs), first.finish_reason,
                            first.completion_tokens, list(first.top_logprobs))
        merged.extend(item)
        first = merged
    return merged or first, None


@dataclass(eq=False)
class Job:
    room: int
    token_ids: list[int]  # the prompt
    params: SamplingParams
    prefill_addr: str  # "" for a colocated job: no prefill worker, no KV transfer
    seq: int  # arrival order: after `priority`, the order for pages, batch slots and retraction
    out: asyncio.Queue  # Tokens | DecodeFailed, read by the servicer
    phase: Phase = Phase.PREALLOC
    ended_in: Phase | None = None  # the phase it was in when it finished
    created_at: float = field(default_factory=time.monotonic)
    pages: list[int] | None = None
    output: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens whose KV is in its pages by a local prefill (colocated jobs)
    # prompt tokens whose KV its first pages share with the prefix cache: not sent by prefill,
    # not computed by a local prefill
    cached_tokens: int = 0
    # prompt tokens whose KV nobody computed for it, as usage reports them: with a prefill
    # worker, the prefix prefill found cached (the aux row carries it); colocated, cached_tokens
    usage_cached_tokens: int = 0
    # its first pages that its Attach offered prefill for a READ (the held prefix; 0: none)
    offered_pages: int = 0
    last_token_at: float | None = None
    canary: bool = False  # the router's canary: served as any job, left out of the request metrics
    # colocated with params.prompt_logprobs: what its local prefill chunks computed (the first
    # chunk with tokens carries them)
    prompt_lp: PromptLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED

    @property
    def colocated(self) -> bool:
        return not self.prefill_addr

    @property
    def order(self) -> tuple[int, int]:
        """Its place for pages, batch slots and (last first) retraction: vLLM's priority (lower
        first; 0 for every job unless the router's --scheduling-policy is priority), then arrival."""
        return self.params.priority, self.seq

    @property
    def kv_tokens(self) -> list[int]:
        """The tokens whose KV its pages hold once it runs: prompt and every generated token but
        the last (the next step feeds that one)."""
        return self.token_ids + self.output[:-1]

    @property
    def context_len(self) -> int:
        """Tokens whose KV the next step needs in the cache, plus the one it feeds."""
        return len(self.token_ids) + len(self.output)
