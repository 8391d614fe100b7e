"""Prompt logprobs on the engine: chunked prefill rows reduced per chunk equal transformers'
log-softmax over the whole prompt (the built-in checkpoint, fp32 on CPU)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from services.engine.kv_pool import KVPool
from services.engine.loader import load_model
from services.engine.prompt_logprobs import PromptLogprobs, chunk_targets, reduce_chunk
from services.engine.runner import ModelRunner, PrefillItem

transformers = pytest.importorskip("transformers")

FOLDER = pathlib.Path(__file__).resolve().parents[2] / "models" / "pdmesh-tiny"
PROMPT = [5, 17, 42, 99, 3, 250, 7, 7, 64, 128, 11, 200, 31, 8, 77, 150, 2, 9, 61, 33, 45]


@pytest.fixture(scope="module")
def models():
    hf = transformers.AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32).eval()
    return hf, load_model(str(FOLDER), device="cpu", dtype=torch.float32)


def reference(hf, ids: list[int], k: int) -> tuple[list[float], list[int], list[list[int]]]:
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)[:-1]
    tgt = torch.tensor(ids[1:])
    own = lp.gather(1, tgt[:, None])[:, 0]
    ranks = ((lp > own[:, None]).sum(1) + 1).tolist()
    return own.tolist(), ranks, torch.topk(lp, k, dim=-1).indices.tolist()


@pytest.mark.parametrize("cuts", [[0, len(PROMPT)], [0, 5, 12, len(PROMPT)], [0, 1, 2, len(PROMPT) - 1, len(PROMPT)]])
def test_chunked_prompt_logprobs_match_transformers(models, cuts):
    hf, ours = models
    pool = KVPool(ours.config, num_pages=16, page_size=4)
    runner = ModelRunner(ours.model, pool)
    pages = pool.allocator.alloc(pool.pages_for_tokens(len(PROMPT)), owner="t")
    got = PromptLogprobs(3)
    for a, b in zip(cuts, cuts[1:], strict=False):
        last, full = runner.prefill_rows([PrefillItem(PROMPT[a:b], a, pages)], [0])
        assert full[0].shape[0] == b - a  # only this chunk's rows
        got.extend(reduce_chunk(full[0], chunk_targets(PROMPT, a, b - a), 3))
    want, ranks, tops = reference(hf, PROMPT, 3)
    assert len(got) == len(PROMPT) - 1
    assert max(abs(x - y) for x, y in zip(got.logprobs, want, strict=True)) < 1e-4
    assert got.ranks == ranks
    assert [got.top_ids[i * 3 : i * 3 + 3] for i in range(len(got))] == tops
    pool.allocator.free(pages, owner="t")
    assert pool.allocator.is_whole()


def test_final_row_predicts_nothing_in_the_prompt():
    assert chunk_targets([1, 2, 3, 4], 2, 2) == [4]
    assert chunk_targets([1, 2, 3, 4], 0, 2) == [2, 3]
    out = reduce_chunk(torch.zeros(1, 8), [], 2)
    assert len(out) == 0 and out.top_ids == []


def test_the_wire_tells_none_sent_from_none_asked():
    """A one-token prompt with k = 0 has nothing to carry; the message is still present, so the
    router does not read it as a worker that ignored the request."""
    from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
    from services.common.prompt_logprobs import from_pb, to_pb

    reply = wpb.PrefillReply()
    to_pb(PromptLogprobs(0), reply.prompt_logprobs)
    back = wpb.PrefillReply.FromString(reply.SerializeToString())
    assert back.HasField("prompt_logprobs") and len(from_pb(back.prompt_logprobs)) == 0
    assert not wpb.PrefillReply().HasField("prompt_logprobs")
    full = PromptLogprobs(2, [-1.0], [3], [7, 9], [-0.1, -0.2])
    reply = wpb.PrefillReply()
    to_pb(full, reply.prompt_logprobs)
    assert from_pb(wpb.PrefillReply.FromString(reply.SerializeToString()).prompt_logprobs) == full
