"""Beam search over one prompt (vLLM's `use_beam_search`), as pure bookkeeping: no workers here.

The router runs it the way vLLM's OpenAI server does, one token at a time on the workers
(services/router/beam_run.py): each step asks, for every live beam, the model's 2 × width most
likely next tokens with their log-probabilities (the raw ones, as the workers report logprobs),
and `BeamSearch.expand` keeps the `width` best continuations. A continuation that takes a stop
token (eos unless ignore_eos, the request's stop_token_ids; not before min_tokens) is a finished
beam; a beam that reaches max_tokens finishes by length. The answer is the `width` best finished
beams, best first.

Score: the sum of the chosen tokens' logprobs over length ** length_penalty, the length counting
the generated tokens without the stop token (vLLM counts the prompt too; transformers, as here,
the generated tokens only: with the prompt counted the penalty fades on long prompts). A
length_penalty above 0 favours longer beams, below 0 shorter ones.

Stopping early: once `width` beams have finished and no live beam can still score above the worst
of them (a logprob is never positive, so a beam's sum only falls; its length is bounded by
max_tokens), the search ends; what it returns is what running every step to max_tokens would.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from services.common.sampling_params import MAX_TOP_LOGPROBS

TopTokens = Sequence[tuple[int, float]]  # (token id, logprob), most likely first

MAX_WIDTH = MAX_TOP_LOGPROBS // 2  # beams per prompt: each step asks the workers 2 x width alternatives


@dataclass
class Beam:
    tokens: list[int] = field(default_factory=list)  # generated ids; a stop token last when it ended so
    logprobs: list[float] = field(default_factory=list)  # each chosen token's
    tops: list[TopTokens] = field(default_factory=list)  # each step's alternatives (for the reply's logprobs)
    cum: float = 0.0  # sum of `logprobs`
    finish: str = ""  # "" while live; "stop" (a stop token) or "length"

    def extended(self, token: int, logprob: float, top: TopTokens) -> Beam:
        return Beam([*self.tokens, token], [*self.logprobs, logprob], [*self.tops, top], self.cum + logprob)


def score(beam: Beam, length_penalty: float) -> float:
    length = len(beam.tokens) - (beam.finish == "stop")
    return beam.cum / max(length, 1) ** length_penalty


class BeamSearch:
    def __init__(self, width: int, max_tokens: int, stop_ids: Collection[int], min_tokens: int = 0,
                 length_penalty: float = 1.0):
        if not 1 <= width <= MAX_WIDTH or max_tokens < 1:
            raise ValueError(f"width {width} (1..{MAX_WIDTH}) and max_tokens {max_tokens} (>= 1)")
        self.width = width
        self.max_tokens = max_tokens
        self.stop_ids = frozenset(stop_ids)
        self.min_tokens = min_tokens
        self.length_penalty = length_penalty
        self.live: list[Beam] = [Beam()]
        self.finished: list[Beam] = []  # the best `width` so far, best first
        self.steps = 0

    @property
    def candidates(self) -> int:
        """Alternatives each step needs per live beam: enough that `width` continuations remain
        when every live beam's stop tokens are among its most likely ones."""
        return 2 * self.width

    @property
    def done(self) -> bool:
        if not self.live:
            return True
        if len(self.finished) < self.width:
            return False
        worst = score(self.finished[-1], self.length_penalty)
        return all(self._best_reachable(b) <= worst for b in self.live)

    def _best_reachable(self, beam: Beam) -> float:
        """The highest score any continuation of `beam` can reach: its sum only falls, and over the
        length its score is best at the longest (penalty > 0) or the shortest (penalty <= 0)."""
        if self.length_penalty > 0:
            return beam.cum / self.max_tokens ** self.length_penalty
        return beam.cum / max(len(beam.tokens), 1) ** self.length_penalty

    def expand(self, tops: Sequence[TopTokens]) -> None:
        """One step: `tops[i]` is live beam i's most likely next tokens (at least `candidates` of
        them, or the whole vocabulary)."""
        if len(tops) != len(self.live):
            raise ValueError(f"{len(tops)} results for {len(self.live)} live beams")
        self.steps += 1
        grown: list[Beam] = []
        ended: list[Beam] = []
        for beam, top in zip(self.live, tops, strict=True):
            may_stop = len(beam.tokens) >= self.min_tokens
            for token, logprob in top[: self.candidates]:
                child = beam.extended(token, logprob, top)
                if token in self.stop_ids:
                    if may_stop:  # before min_tokens the workers would never sample it
                        child.finish = "stop"
                        ended.append(child)
                else:
                    grown.append(child)
        grown = self._best(grown)
        if self.steps >= self.max_tokens:
            for beam in grown:
                beam.finish = "length"
            ended += grown
            grown = []
        self.live = grown
        self.finished = self._best(self.finished + ended)

    def _best(self, beams: list[Beam]) -> list[Beam]:
        # sorted() is stable: equal scores keep the order of the beams and of their alternatives
        return sorted(beams, key=lambda b: score(b, self.length_penalty), reverse=True)[: self.width]

    def result(self) -> list[Beam]:
        """The `width` best beams, best first (live ones too if the search was cut short)."""
        return self._best(self.finished + self.live)
