"""Batched, chunked, paged execution yields exactly what each sequence yields alone."""

import pytest

from services.common.sampling_params import SamplingParams
from services.engine.kv_pool import KVPool
from services.engine.loader import load_model
from services.engine.local_generate import generate

CHUNK_BUDGET = 48
LENGTHS = [3, 17, 40, 49, 64, 130, 7, 75]  # several longer than the chunk budget


@pytest.fixture(scope="module")
def builtin():
    return load_model(None)


def _prompts():
    return [[(i * 37 + j * 11) % 256 for j in range(n)] for i, n in enumerate(LENGTHS)]


@pytest.mark.parametrize(
    "make_params",
    [
        lambda i: SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        lambda i: SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1000 + i, max_tokens=12, ignore_eos=True),
    ],
    ids=["greedy", "seeded-sampling"],
)
def test_batch_equals_alone(builtin, make_params):
    pool = KVPool(builtin.config, num_pages=200, page_size=16)
    prompts = _prompts()
    params = [make_params(i) for i in range(len(prompts))]
    assert len(prompts) >= 8 and any(len(p) > CHUNK_BUDGET for p in prompts)
    batched = generate(builtin.model, pool, prompts, params, chunk_budget=CHUNK_BUDGET)
    assert pool.allocator.is_whole()
    for prompt, p, out in zip(prompts, params, batched, strict=True):
        alone = generate(builtin.model, pool, [prompt], [p], chunk_budget=10_000)  # unchunked
        assert out == alone[0]
        assert len(out) == p.max_tokens
    assert pool.allocator.is_whole()
    # the outputs are not trivially identical across prompts (the test could not catch a mixup)
    assert len({tuple(o) for o in batched}) == len(batched)


def test_eos_and_stop_token_ids_end_generation(builtin):
    pool = KVPool(builtin.config, num_pages=64, page_size=16)
    prompt = list(range(20, 60))
    free_run = generate(builtin.model, pool, [prompt], [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)])[0]
    stop_at = free_run[5]
    first = free_run.index(stop_at)
    stopped = generate(
        builtin.model, pool, [prompt], [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(stop_at,))]
    )[0]
    assert stopped == free_run[: first + 1]
    assert pool.allocator.is_whole()


def test_fresh_prompts_attend_stacked_with_the_same_result(builtin):
    """Fresh prompts of equal or similar length share stacked attention calls (padded to the
    longest); logits and tokens must be those of each prompt alone, with a lone long prompt and
    a cached continuation in the same batch."""
    import torch

    from services.engine.runner import ModelRunner, PrefillItem

    pool = KVPool(builtin.config, num_pages=64, page_size=16)
    runner = ModelRunner(builtin.model, pool)
    lengths = [40, 40, 40, 33, 29, 17, 12, 140]
    prompts = [[(i * 13 + j * 7) % 256 for j in range(n)] for i, n in enumerate(lengths)] + [list(range(90))]
    tables = [pool.allocator.alloc(pool.pages_for_tokens(len(p)), owner=i) for i, p in enumerate(prompts)]
    # the last sequence continues: its first 50 tokens are already cached
    runner.prefill([PrefillItem(prompts[-1][:50], 0, tables[-1])])
    items = [PrefillItem(p, 0, t) for p, t in zip(prompts[:-1], tables[:-1], strict=True)]
    items.append(PrefillItem(prompts[-1][50:], 50, tables[-1]))
    batched = runner.prefill(items)
    for i, (p, t) in enumerate(zip(prompts, tables, strict=True)):
        alone = runner.prefill([PrefillItem(p, 0, t)])[0]
        assert torch.allclose(batched[i], alone, atol=1e-5), (i, float((batched[i] - alone).abs().max()))
    for i in range(len(prompts)):
        pool.allocator.free(tables[i], owner=i)
    assert pool.allocator.is_whole()

    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * len(prompts)
    together = generate(builtin.model, pool, prompts, params)
    for prompt, p, out in zip(prompts, params, together, strict=True):
        assert out == generate(builtin.model, pool, [prompt], [p])[0]


def test_fresh_spans_group_by_padding_cost():
    from services.engine.attention_metadata import PrefillSeqSpan, group_fresh_spans

    def span(n, start_pos=0):
        return PrefillSeqSpan(0, n, None, None, None, start_pos)

    spans = [span(40), span(12), span(40), span(33), span(140), span(29), span(17), span(50, start_pos=8)]
    groups = [[s.num_tokens for s in g] for g in group_fresh_spans(spans)]
    # 140 alone (a 40 padded to 140 would do 12x its own attention work); 40/40/33/29 pad to
    # 40 and 17/12 to 17 (at most 1.5x their length); the continuation never groups
    assert groups == [[40, 40, 33, 29], [17, 12]]
