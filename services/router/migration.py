"""What a request needs to continue on another pair: prompt ids + the ids generated so far (pure).

Re-submitting `prompt + generated` with the remaining max_tokens and the same seed continues the
exact token sequence of an uninterrupted run, because the workers sample the token at absolute
position p from a generator keyed by (seed, p) (services/engine/sampler.py), rebuild the
penalty and min_tokens state from the ids (`num_generated` says which were generated), and a greedy
forward over the same ids gives the same logits whether the KV was computed token by token or
in one prefill (up to float rounding, which the batch-equivalence tests bound).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from services.common.sampling_params import SamplingParams


@dataclass
class Progress:
    prompt_ids: list[int]
    max_tokens: int
    generated: list[int] = field(default_factory=list)

    def add(self, token_ids: list[int]) -> None:
        self.generated += token_ids

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.generated)

    def ids(self) -> list[int]:
        """The prompt of the next attempt."""
        return self.prompt_ids + self.generated

    def params(self, base: SamplingParams) -> SamplingParams:
        """The request's parameters for the next attempt: same seed, the tokens still owed, and
        how many of its prompt ids were generated (penalties and min_tokens count those). A
        continuation asks for no prompt logprobs: the first attempt's first chunk delivered them."""
        if base.max_tokens == self.remaining and base.num_generated == len(self.generated):
            return base  # a first attempt: nothing changes, and a copy (with its validation) costs
        return replace(base, max_tokens=self.remaining, num_generated=len(self.generated), prompt_logprobs=None)


def migration_reason(failure) -> str:
    """The `reason` label of pdmesh:router_migrations_total for a WorkerFailure."""
    return {"ejected": "decode_ejected", "stalled": "decode_stalled", "ended": "stream_ended"}.get(
        failure.kind, "decode_failed"
    )
