"""One prompt's beam search run on the workers (services/router/beam_search.py holds the search).

Each step is one ordinary one-token request per live beam — prompt + the beam's tokens, greedy,
asking the 2 × width most likely next tokens — sent through the orchestrator like any request, so
every step fails over, respects the request's deadline and takes what the prefix cache holds
(a beam's prompt grows by one token a step; the cache-aware pool sends it back to the workers
that hold the rest). The steps of one search step run concurrently, as the choices of n > 1 do.

The reply's choices are the best beams, best first: `choices()` gives one chunk iterator per
choice, each ending with a single chunk holding its beam's tokens (the stop token last, as decode
sends it), their logprobs and alternatives, the prompt's cached tokens and prompt logprobs from
the first step, so the response is rendered, streamed and counted as any other
(services/router/render.py). A choice closed before the search ends (its client left, a
sibling failed) cancels the search and its steps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from services.router.attempt import Chunk
from services.router.beam_search import Beam, BeamSearch
from services.router.errors import bad_request
from services.router.orchestrator import sampling_params
from services.router.protocol import GenerateSpec
from services.router.request_state import RequestState


def step_spec(spec: GenerateSpec, alternatives: int) -> GenerateSpec:
    """What every step asks the workers: one greedy token and its `alternatives` most likely
    rivals, nothing that would end or reshape it (the search applies the stop tokens itself)."""
    return replace(spec, n=1, max_tokens=1, min_tokens=0, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                   presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=(),
                   allowed_token_ids=(), bad_words=(), grammar=None, stop=[], stop_token_ids=[],
                   ignore_eos=True, logprobs=alternatives, prompt_logprobs=None, echo=False, echo_text="",
                   echo_only=False, stream=False, batch=(), beam_search=False)


class BeamRun:
    def __init__(self, orchestrator, spec: GenerateSpec, deadline: float, timeout: float,
                 requests: list[RequestState], first_room: int | None = None):
        self.orchestrator = orchestrator
        self.spec = spec
        self.deadline = deadline
        self.timeout = timeout
        self.requests = requests  # every step's request object, for the request's log line
        self.first_room = first_room
        stop_ids = sampling_params(spec, orchestrator.eos_ids).stop_token_ids  # as decode would stop
        self.search = BeamSearch(spec.n, spec.max_tokens, stop_ids, spec.min_tokens, spec.length_penalty)
        self.alternatives = max(self.search.candidates, spec.logprobs or 0)
        self.cached_tokens = 0
        self.prompt_logprobs = None
        self._task: asyncio.Task | None = None

    def choices(self) -> list[AsyncIterator[Chunk]]:
        return [self._choice(i) for i in range(self.spec.n)]

    async def _choice(self, index: int) -> AsyncIterator[Chunk]:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        task = self._task
        try:
            beams = await asyncio.shield(task)
        finally:
            if not task.done():  # this choice was closed or cancelled mid-search: so is the search
                task.cancel()
                await asyncio.wait([task])
        if index >= len(beams):
            raise bad_request(f"Beam search found {len(beams)} beams, fewer than n ({self.spec.n}): the stop "
                              "tokens took the most likely continuations.", param="n", code="invalid_value")
        yield self._chunk(beams[index])

    async def _run(self) -> list[Beam]:
        search = self.search
        while not search.done:
            first = search.steps == 0
            steps = [asyncio.ensure_future(self._step(beam, first and i == 0))
                     for i, beam in enumerate(search.live)]
            try:
                tops = await asyncio.gather(*steps)
            except BaseException:
                for s in steps:
                    s.cancel()
                await asyncio.gather(*steps, return_exceptions=True)
                raise
            search.expand(tops)
        return search.result()

    async def _step(self, beam: Beam, first: bool) -> Sequence[tuple[int, float]]:
        spec = step_spec(self.spec, self.alternatives)
        spec = replace(spec, prompt_ids=[*self.spec.prompt_ids, *beam.tokens],
                       prompt_logprobs=self.spec.worker_prompt_logprobs if first else None)
        orchestrator = self.orchestrator
        req = orchestrator.new_request(spec, self.first_room if first else None)
        self.requests.append(req)
        gen = orchestrator.generate(req, self.deadline, self.timeout)
        top: Sequence[tuple[int, float]] = ()
        try:
            async for chunk in gen:
                if chunk.token_ids and not top:
                    top = chunk.top[0] if chunk.top else [(chunk.token_ids[0], chunk.logprobs[0])]
                if first:
                    self.cached_tokens = max(self.cached_tokens, chunk.cached_tokens)
                    if chunk.prompt is not None:
                        self.prompt_logprobs = chunk.prompt
        finally:
            await gen.aclose()
        return top

    def _chunk(self, beam: Beam) -> Chunk:
        k = self.spec.logprobs
        tops = [list(t[:k]) for t in beam.tops] if k else None
        return Chunk(list(beam.tokens), list(beam.logprobs), beam.finish, tops, self.cached_tokens,
                     self.prompt_logprobs)
