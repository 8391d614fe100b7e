"""Penalties, logit_bias and min_tokens through real prefill + decode processes: greedy output with
each control equals single-process generation with the same control — with decode's KV pool so
small that requests are retracted and recomputed, and in the form a migrated request takes
(prompt + generated ids, `num_generated`, the remaining max_tokens). One mesh for the module."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest

from services.common.builtin_tokenizer import BUILTIN_EOS_ID
from services.common.sampling_params import SamplingParams
from services.engine.kv_pool import KVPool
from services.engine.loader import load_model
from services.engine.local_generate import generate_full
from services.fakes.worker_client import generate
from tests.integration.mesh import Mesh

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

# The controls below are written in byte tokens (ord("e"), printable bytes as stops): the random
# byte-level model, on which each control visibly changes greedy output.
MODEL = "builtin-random"
PAGE, PAGES = 16, 12  # 6 prompts of 20 fit, their 40-token continuations do not: retraction
CONTROLS = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.8),
    "repetition": dict(repetition_penalty=1.4),
    "logit_bias": dict(logit_bias=((ord("e"), 8.0), (ord(" "), -100.0), (ord("a"), 3.5))),
    # most printable bytes stop: greedy would stop at once, min_tokens holds it back until 20
    "min_tokens": dict(min_tokens=20, stop_token_ids=(BUILTIN_EOS_ID, *range(33, 127))),
    "all": dict(presence_penalty=-0.5, frequency_penalty=0.3, repetition_penalty=1.2, logit_bias=((ord("x"), 2.0),),
                min_tokens=5, stop_token_ids=(BUILTIN_EOS_ID,)),
}


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    mesh = Mesh(tmp_path_factory.mktemp("controls"))
    try:
        decode_flags = ("--model", MODEL, "--num-pages", str(PAGES), "--page-size", str(PAGE))
        (p,), (d,) = mesh.start_workers(1, 1, ("--model", MODEL), decode_flags)
        yield mesh, p, d
    finally:
        mesh.close()


@pytest.fixture(scope="module")
def reference_model():
    return load_model(MODEL)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(20)] for _ in range(6)]


def _run(p, d, prompts, params):
    async def all_requests():
        return await asyncio.gather(*(generate(p.grpc_addr, d.grpc_addr, pr, pa, timeout=90)
                                      for pr, pa in zip(prompts, params, strict=True)))
    return asyncio.run(all_requests())


def _params(control: str, max_tokens: int, **kw) -> SamplingParams:
    stops_matter = control in ("min_tokens", "all")  # eos must stay a stop token for min_tokens to mean anything
    return SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": not stops_matter,
                             **CONTROLS[control], **kw})


def test_greedy_with_each_control_equals_single_process_under_retraction(workers, reference_model):
    """One request per control, all at once, on a decode pool that must retract some of them."""
    mesh, p, d = workers
    names = sorted(CONTROLS)
    prompts = _prompts(3)
    params = [_params(c, 40) for c in names]
    params.append(_params("all", 40, temperature=0.9, top_p=0.9, seed=5))  # and one seeded, sampled
    prompts.append(prompts[0])
    assert sum(-(-(20 + 40) // PAGE) for _ in prompts) > PAGES  # the pool cannot hold them all
    outs = _run(p, d, prompts, params)
    refs = generate_full(reference_model.model, KVPool(reference_model.config, 64, PAGE), prompts, params)
    plain = generate_full(reference_model.model, KVPool(reference_model.config, 64, PAGE), prompts,
                          [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * len(prompts))
    for name, out, ref, q in zip([*names, "all-sampled"], outs, refs, plain, strict=True):
        assert out.ok, (name, out.prefill_error, out.decode_error)
        assert out.tokens == ref.token_ids, name
        assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-4), name
        assert ref.token_ids != q.token_ids, f"{name}: the control changed nothing"
    assert 20 <= len(refs[names.index("min_tokens")].token_ids) < 40
    assert d.metrics()["pdmesh:num_retracted_requests_total"] >= 1
    mesh.assert_invariants()


def test_a_migrated_request_continues_exactly(workers, reference_model):
    """What the router sends after a migration: prompt + the k generated ids, num_generated=k."""
    mesh, p, d = workers
    names = ["presence", "frequency", "repetition", "min_tokens"]
    prompts = _prompts(7)[: len(names)]
    base = [_params(c, 30) for c in names]
    refs = generate_full(reference_model.model, KVPool(reference_model.config, 64, PAGE), prompts, base)
    k = 6
    moved = [pr + ref.token_ids[:k] for pr, ref in zip(prompts, refs, strict=True)]
    outs = _run(p, d, moved, [replace(b, max_tokens=30 - k, num_generated=k) for b in base])
    # without num_generated the rules over generated tokens would miss k of them (repetition counts
    # prompt and generated alike, so it is the one control for which this changes nothing)
    wrong = _run(p, d, moved, [replace(b, max_tokens=30 - k) for b in base])
    for name, out, bad, ref in zip(names, outs, wrong, refs, strict=True):
        assert out.ok, (name, out.prefill_error, out.decode_error)
        assert out.tokens == ref.token_ids[k:], name
        assert (bad.tokens == ref.token_ids[k:]) == (name == "repetition"), name
    mesh.assert_invariants()
