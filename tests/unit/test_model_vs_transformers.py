"""Our engine against transformers' reference implementations on tiny random checkpoints."""

from __future__ import annotations

import contextlib

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.engine.kv_pool import KVPool
from services.engine.loader import load_model
from services.engine.local_generate import generate
from services.engine.runner import DecodeItem, ModelRunner, PrefillItem
from services.fakes.hf_checkpoints import save_tiny_llama, save_tiny_qwen2

transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 42, 99, 3, 250, 7, 7, 64, 128, 11, 200, 31, 8, 77, 150, 2, 9, 61, 33, 45]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        save_tiny_llama(folder)
        hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    else:
        save_tiny_qwen2(folder, max_shard_size="100KB")  # sharded, with an index file
        hf = transformers.Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_model(str(folder), device="cpu")
    return request.param, folder, hf, ours


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@contextlib.contextmanager
def _runner_with_pages(ours, num_tokens):
    """A runner on a fresh 16-page pool and pages for num_tokens; after, every page is free again."""
    pool = KVPool(ours.config, num_pages=16, page_size=4)
    runner = ModelRunner(ours.model, pool)
    pages = pool.allocator.alloc(pool.pages_for_tokens(num_tokens), owner="t")
    yield runner, pages
    pool.allocator.free(pages, owner="t")
    assert pool.allocator.is_whole()


def test_prefill_logits_match(checkpoint):
    _, _, hf, ours = checkpoint
    with _runner_with_pages(ours, len(PROMPT)) as (runner, pages):
        # every position's logits: run the prompt as one-token-longer prefixes is slow; instead compare
        # the last-token logits of each prefix length via a chunked prefill (one token per chunk)
        ref = _hf_logits(hf, PROMPT)
        ours_last = runner.prefill([PrefillItem(PROMPT, 0, pages)])[0]
        assert torch.max(torch.abs(ours_last - ref[-1])).item() <= 1e-4


def test_chunked_prefill_and_decode_logits_match(checkpoint):
    _, _, hf, ours = checkpoint
    with _runner_with_pages(ours, len(PROMPT) + 1) as (runner, pages):
        ref = _hf_logits(hf, PROMPT)
        # chunks of 5, 7, rest: each chunk's last logits equal the reference at that position
        cuts = [0, 5, 12, len(PROMPT) - 1]
        for a, b in zip(cuts, cuts[1:], strict=False):
            got = runner.prefill([PrefillItem(PROMPT[a:b], a, pages)])[0]
            assert torch.max(torch.abs(got - ref[b - 1])).item() <= 1e-4
        # the last prompt token through the decode path
        got = runner.decode([DecodeItem(PROMPT[-1], len(PROMPT) - 1, pages)])[0]
        assert torch.max(torch.abs(got - ref[-1])).item() <= 1e-4


def test_greedy_generation_matches_hf_generate(checkpoint):
    _, _, hf, ours = checkpoint
    pool = KVPool(ours.config, num_pages=32, page_size=4)
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([PROMPT]),
            attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
            max_new_tokens=32,
            do_sample=False,
            pad_token_id=0,
        )[0, len(PROMPT) :].tolist()
    got = generate(ours.model, pool, [PROMPT], [SamplingParams(temperature=0.0, max_tokens=32)])[0]
    assert len(ref) == 32
    assert got == ref
    assert pool.allocator.is_whole()
