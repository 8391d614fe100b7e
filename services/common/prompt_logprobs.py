"""Prompt logprobs as plain values (no torch): what the engine computes, the wire carries and the
router renders. The engine's reduction is services/engine/prompt_logprobs.py."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PromptLogprobs:
    """Entry i is prompt position i + 1 (position 0 has no context); alternatives are flat, k per
    position, most likely first."""

    k: int
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.logprobs)

    def extend(self, other: PromptLogprobs) -> None:
        self.logprobs += other.logprobs
        self.ranks += other.ranks
        self.top_ids += other.top_ids
        self.top_logprobs += other.top_logprobs

    def top(self, i: int, k: int | None = None) -> list[tuple[int, float]]:
        """Entry i's alternatives [(id, logprob)], at most k (default all), most likely first."""
        width = self.k if k is None else min(k, self.k)
        at = i * self.k
        return list(zip(self.top_ids[at : at + width], self.top_logprobs[at : at + width], strict=True))


def to_pb(p: PromptLogprobs, msg) -> None:
    """Fill a worker_pb2.PromptLogprobs message (present even when empty: a one-token prompt with
    k = 0 has nothing to carry, and the receiver tells "none asked" from "none sent" by presence)."""
    msg.SetInParent()
    msg.k = p.k
    msg.logprobs.extend(p.logprobs)
    msg.ranks.extend(p.ranks)
    msg.top_token_ids.extend(p.top_ids)
    msg.top_logprobs.extend(p.top_logprobs)


def from_pb(msg) -> PromptLogprobs:
    return PromptLogprobs(int(msg.k), list(msg.logprobs), list(msg.ranks), list(msg.top_token_ids),
                          list(msg.top_logprobs))
