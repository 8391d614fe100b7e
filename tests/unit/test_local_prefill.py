"""Colocated local prefill: which PREFILLING jobs' chunks one forward takes (pure, no torch forward)."""

from __future__ import annotations

import asyncio

from services.common.sampling_params import SamplingParams
from services.decode.jobs import Job, Phase
from services.decode.local_prefill import pick_chunks


def job(seq: int, prompt: int, prefilled: int = 0, phase: Phase = Phase.PREFILLING, priority: int = 0) -> Job:
    j = Job(seq + 1, list(range(prompt)), SamplingParams(max_tokens=4, priority=priority), "", seq, asyncio.Queue(),
            phase=phase)
    j.prefilled = prefilled
    return j


def test_oldest_first_within_the_budget():
    a, b, c = job(2, 100), job(0, 700, prefilled=300), job(1, 50)
    assert [(j.seq, n) for j, n in pick_chunks([a, b, c], 512)] == [(0, 400), (1, 50), (2, 62)]


def test_a_long_prompt_takes_the_whole_budget_and_others_wait():
    a, b = job(0, 2000, prefilled=512), job(1, 10)
    assert [(j.seq, n) for j, n in pick_chunks([a, b], 512)] == [(0, 512)]


def test_only_prefilling_jobs_and_only_colocated_ones_exist_there():
    jobs = [job(0, 10, phase=Phase.RUNNING), job(1, 10, phase=Phase.PREALLOC), job(2, 10)]
    assert [(j.seq, n) for j, n in pick_chunks(jobs, 512)] == [(2, 10)]
    assert jobs[2].colocated and pick_chunks([], 512) == []


def test_priority_first_then_arrival():
    # vLLM's priority (the router's --scheduling-policy priority): lower values first
    a, b, c = job(0, 300), job(1, 300, priority=-1), job(2, 300, priority=3)
    assert [(j.seq, n) for j, n in pick_chunks([a, b, c], 512)] == [(1, 300), (0, 212)]
    assert [j.order for j in (a, b, c)] == [(0, 0), (-1, 1), (3, 2)]
