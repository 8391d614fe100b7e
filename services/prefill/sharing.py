"""n > 1 on one prefill: the jobs of one share key compute their common prompt once (no torch).

The router sends the n choices of a request to the same prefill with one `share_key`
(PrefillRequest.share_key); each choice is still its own job with its own room, pages,
decode and outcome. Per key, the first job the scheduler puts into a forward is the **leader**;
a later job of the key with identical token ids is a **follower**, and the scheduler asks
`ShareGroups.plan` what to do with it on every pass:

  COMPUTE  no live leader (none yet, or it ended: finished, failed, aborted, evicted), or the
           job already computed a chunk itself: it computes, and leads the key if none does.
  WAIT     the leader is still computing (chunks left, none of them final in this batch): the
           follower is skipped, holding no pages. Bounded by the leader's progress: the leader
           holds pages, so the scheduler runs it first on every pass, each forward under
           --forward-timeout; when the leader ends any other way the key is dropped and the
           follower computes itself on the next pass. So a follower never waits on a dead leader.
  COPY     the leader's KV is complete (its final chunk is in this batch, or it finished
           computing and has not ended): the follower gets its own pages, the engine copies the
           leader's pages into them and samples the follower's first token from the leader's
           last-position logits with the follower's own params (seed, penalties). Every job
           still owns and releases its own pages exactly once; the leader's release waits for
           a forward that copies from its pages (PrefillWorker pins it).

A job of the key whose token ids or prompt_logprobs differ from the leader's (not something the
router sends) computes alone. A follower takes its leader's prompt logprobs with its KV. Once the leader has ended, later arrivals compute and the first one leads anew.
"""

from __future__ import annotations

import enum
from collections.abc import Container

from services.prefill.jobs import Job


class Plan(enum.Enum):
    COMPUTE = "compute"
    WAIT = "wait"
    COPY = "copy"


class ShareGroups:
    def __init__(self) -> None:
        self._leaders: dict[int, Job] = {}

    def __len__(self) -> int:
        return len(self._leaders)

    def leader_of(self, job: Job) -> Job | None:
        return self._leaders.get(job.share_key) if job.share_key else None

    def plan(self, job: Job, final_in_batch: Container[Job] = ()) -> tuple[Plan, Job | None]:
        """What the scheduler does with a job that is ready (attached, not in a forward), and
        the leader it waits on or copies from. `final_in_batch`: jobs whose final chunk the
        batch being built already holds (their followers copy right after that forward)."""
        if not job.share_key or job.prefilled or job.pages is not None:
            return Plan.COMPUTE, None  # not shared, or already computing on its own
        leader = self._leaders.get(job.share_key)
        if leader is None or leader is job or leader.token_ids != job.token_ids:
            return Plan.COMPUTE, None
        if leader.params.prompt_logprobs != job.params.prompt_logprobs:
            return Plan.COMPUTE, None  # a copy takes the leader's prompt logprobs: only the same ones
        if leader.kv_ready or leader in final_in_batch:
            return Plan.COPY, leader
        return Plan.WAIT, leader

    def lead(self, job: Job) -> None:
        """The job is going into a forward with its first chunk: it leads its key if none does."""
        if job.share_key and job.share_key not in self._leaders:
            self._leaders[job.share_key] = job

    def drop(self, job: Job) -> None:
        """The job ended (any outcome): if it led, its key has no leader; waiting followers compute."""
        if job.share_key and self._leaders.get(job.share_key) is job:
            del self._leaders[job.share_key]
        job.last_logits = None
