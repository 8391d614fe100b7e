"""n > 1 on one prefill: the choices of one share key compute their common prompt once, through
the prefix cache (no torch).

The router sends the n choices of a request to the same prefill with one `share_key`
(PrefillRequest.share_key); each choice is still its own job with its own room, pages, decode
and outcome. Sharing adds no way of moving KV of its own: it only orders the jobs so that the
prefix cache (services/engine/prefix_cache.py) serves the followers. Per key, the first job the
scheduler puts into a forward is the **leader**; a later job of the key with identical token ids
is a **follower**, and the scheduler asks `ShareGroups.plan` what to do with it on every pass:

  COMPUTE  no live leader (none yet, or it ended: finished, failed, aborted, evicted), nothing
           shareable (a prompt of at most one page: a hit never covers its last token), or the
           job already took its pages: it computes like any job (its cache lookup still finds
           whatever is cached), and leads the key if none does.
  WAIT     the leader has not yet computed every full page a follower could take from the cache
           (`shareable`): the follower is skipped, holding no pages. Bounded by the leader's
           progress: the leader holds pages, so the scheduler runs it first on every pass, each
           forward under --forward-timeout; when the leader ends any other way the key is dropped
           and the follower computes itself on the next pass (taking from the cache whatever full
           pages the leader completed before it ended). So a follower never waits on a dead leader.
  FOLLOW   the leader's shareable pages are in the cache: the follower takes its pages through the
           ordinary lookup (shared, refcounted, no copy) and computes only its tail — at least its
           last token, whose logits give its own first token, sampled with its own params and seed.

What the followers get is what the prefix cache gives any prompt: full pages only. A follower
computes the partial last page (1 to page_size tokens); a prompt of at most one page has nothing
to share and its choices compute side by side. The pages themselves follow the cache's one
lifecycle (refcounted; the last holder lets go), so the leader ending early never takes pages
from a follower that already holds them.

A follower asking for prompt logprobs computes alone, like any job asking for them: they need
every prompt position's logits, which no cached page keeps. Such a job neither waits nor leads.

With the prefix cache off (`--prefix-cache off`) there is nothing to share through, and the
worker has no ShareGroups: the choices compute independently, side by side in the same forwards,
as vLLM's n > 1 without automatic prefix caching. Waiting there would only delay the followers:
they would compute the whole prompt afterwards anyway.
"""

from __future__ import annotations

import enum

from services.engine.prefix_cache import PrefixCache
from services.prefill.jobs import Job


class Plan(enum.Enum):
    COMPUTE = "compute"
    WAIT = "wait"
    FOLLOW = "follow"


class ShareGroups:
    def __init__(self, cache: PrefixCache) -> None:
        self._cache = cache
        self._leaders: dict[int, Job] = {}

    def __len__(self) -> int:
        return len(self._leaders)

    def leader_of(self, job: Job) -> Job | None:
        return self._leaders.get(job.share_key) if job.share_key else None

    def shareable(self, job: Job) -> int:
        """Prompt tokens a follower of this prompt can take from the cache: its full pages but
        the one holding the last token."""
        return self._cache.max_hit_pages(len(job.token_ids)) * self._cache.page_size

    def plan(self, job: Job) -> tuple[Plan, Job | None]:
        """What the scheduler does with a job that is ready (attached, not in a forward), and
        the leader it waits on or follows."""
        if not _shares(job) or job.prefilled or job.pages is not None:
            return Plan.COMPUTE, None  # not shared, or already computing on its own
        leader = self._leaders.get(job.share_key)
        if leader is None or leader is job or leader.token_ids != job.token_ids or not self.shareable(job):
            return Plan.COMPUTE, None
        if leader.prefilled < self.shareable(job):
            return Plan.WAIT, leader
        return Plan.FOLLOW, leader

    def lead(self, job: Job) -> None:
        """The job is going into a forward with its first chunk: it leads its key if none does."""
        if _shares(job) and job.share_key not in self._leaders:
            self._leaders[job.share_key] = job

    def drop(self, job: Job) -> None:
        """The job ended (any outcome): if it led, its key has no leader; waiting followers compute."""
        if job.share_key and self._leaders.get(job.share_key) is job:
            del self._leaders[job.share_key]


def _shares(job: Job) -> bool:
    return bool(job.share_key) and job.params.prompt_logprobs is None
