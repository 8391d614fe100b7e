"""The beam search run (services/router/beam_run.py) over a fake orchestrator: what each step asks
the workers, the choices' chunks, a failure reaching every choice, and a closed choice cancelling
the search and closing its steps' generators."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.common.prompt_logprobs import PromptLogprobs
from services.router.attempt import Chunk
from services.router.beam_run import BeamRun
from services.router.beam_search import BeamSearch
from services.router.errors import APIError, upstream_failed
from services.router.fanout import FanIn
from services.router.protocol import GenerateSpec
from tests.unit.test_beam_search import EOS, toy_model

PROMPT = [5, 6]


class FakeOrchestrator:
    """Answers each one-token step from the toy model; records the steps' specs."""

    def __init__(self, top, block_at_step: int | None = None, fail_at_step: int | None = None):
        self.top = top
        self.eos_ids = [EOS]
        self.specs: list[GenerateSpec] = []
        self.rooms: list[int | None] = []
        self.open = 0  # step generators started and not yet closed
        self.block_at_step, self.fail_at_step = block_at_step, fail_at_step
        self.blocked = asyncio.Event()

    def new_request(self, spec, first_room=None, share=None):
        self.specs.append(spec)
        self.rooms.append(first_room)
        return SimpleNamespace(spec=spec, attempts=1, budget=SimpleNamespace(migrations=0))

    async def generate(self, req, deadline, timeout):
        spec = req.spec
        step = len(spec.prompt_ids) - len(PROMPT)
        self.open += 1
        try:
            if step == self.fail_at_step:
                raise upstream_failed("decode went away")
            if step == self.block_at_step:
                self.blocked.set()
                await asyncio.Event().wait()
            top = self.top(tuple(spec.prompt_ids[len(PROMPT):]))[: spec.logprobs]
            prompt = PromptLogprobs(k=1) if spec.prompt_logprobs is not None else None
            yield Chunk([top[0][0]], [top[0][1]], "length", [top], cached_tokens=1, prompt=prompt)
        finally:
            self.open -= 1


def spec(**kw) -> GenerateSpec:
    base = dict(kind="completion", model="m", prompt_ids=list(PROMPT), max_tokens=5, n=3, beam_search=True,
                temperature=0.7, top_k=4, stop_token_ids=[4], logprobs=2)
    return GenerateSpec(**{**base, **kw})


async def collect(run: BeamRun) -> list[Chunk]:
    fan = FanIn(run.choices())
    got: dict[int, Chunk] = {}
    while len(got) < run.spec.n:
        index, chunk = await fan.next()
        if chunk is not None:
            got[index] = chunk
    await fan.close()
    return [got[i] for i in range(run.spec.n)]


def test_choices_are_the_best_beams_and_each_step_asks_one_greedy_token():
    top = toy_model(3)
    orch = FakeOrchestrator(top)
    requests: list = []
    s = spec(prompt_logprobs=1)
    chunks = asyncio.run(collect(BeamRun(orch, s, 1e9, 60, requests, first_room=77)))
    search = BeamSearch(3, 5, {EOS, 4})
    while not search.done:
        search.expand([top(tuple(b.tokens)) for b in search.live])
    want = search.result()
    assert [c.token_ids for c in chunks] == [b.tokens for b in want]
    assert [c.finish_reason for c in chunks] == [b.finish for b in want]
    for c, b in zip(chunks, want, strict=True):
        assert c.logprobs == b.logprobs and c.cached_tokens == 1 and c.prompt is not None
        assert all(len(t) == 2 for t in c.top)  # the request's logprobs = 2 alternatives, not the step's 6
    assert len(requests) == len(orch.specs) and orch.rooms[0] == 77 and set(orch.rooms[1:]) == {None}
    for step in orch.specs:
        assert step.max_tokens == 1 and step.n == 1 and step.logprobs == 6  # 2 x width
        assert step.temperature == 0.0 and step.top_k == 0 and step.ignore_eos and not step.stop_token_ids
        assert not step.beam_search and step.prompt_ids[: len(PROMPT)] == PROMPT
    assert orch.specs[0].prompt_logprobs == 1 and all(st.prompt_logprobs is None for st in orch.specs[1:])
    assert orch.open == 0


def test_a_failed_step_fails_every_choice_and_ends_the_others():
    orch = FakeOrchestrator(toy_model(4), fail_at_step=2)

    async def main():
        fan = FanIn(BeamRun(orch, spec(), 1e9, 60, []).choices())
        errors = 0
        for _ in range(3):
            with pytest.raises(APIError):
                await fan.next()
            errors += 1
        await fan.close()
        return errors

    assert asyncio.run(main()) == 3
    assert orch.open == 0


def test_closing_the_choices_mid_search_cancels_the_steps():
    orch = FakeOrchestrator(toy_model(6), block_at_step=2)

    async def main():
        fan = FanIn(BeamRun(orch, spec(), 1e9, 60, []).choices())
        await asyncio.wait_for(orch.blocked.wait(), 5)
        assert orch.open > 0
        await fan.close()
        return orch.open

    assert asyncio.run(main()) == 0


def test_logprobs_off_gives_no_alternatives():
    orch = FakeOrchestrator(toy_model(8))
    chunks = asyncio.run(collect(BeamRun(orch, spec(logprobs=None, n=2), 1e9, 60, [])))
    assert all(c.top is None for c in chunks)
    assert all(st.logprobs == 4 for st in orch.specs)
