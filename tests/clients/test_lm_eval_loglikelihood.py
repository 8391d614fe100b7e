"""lm-evaluation-harness's multiple-choice scoring (log-likelihood) through the mesh equals transformers.

lm-eval (`local-completions`, two prompts per request) scores tests/clients/tasks/pdmesh_choice:
for every choice it sends context + choice with `echo: true, logprobs: 1, max_tokens: 1` and sums
the prompt logprobs of the choice's tokens. Each sum is within 1e-3 per token of transformers' on
the same checkpoint and tokens, the greedy flags agree, and lm-eval's accuracy equals the accuracy
of the transformers scores. (`local-chat-completions` cannot score log-likelihoods: lm-eval refuses
it for chat, as chat completions have no prompt logprobs.)
"""

from __future__ import annotations

import pytest

from tests.clients.lm_eval_client import completions_run, run_lm_eval, task_docs
from tests.clients.reference import continuation_logprob, hf_model_and_tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

TASK = "pdmesh_choice"


def test_multiple_choice_accuracy_equals_transformers(pd_router, tmp_path):
    m, router = pd_router
    docs = task_docs(TASK)
    (out,) = run_lm_eval([completions_run(router, [TASK], batch_size=2)], tmp_path)
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    assert len(samples) == len(docs)
    _, tok = hf_model_and_tokenizer()
    correct = 0
    for s, doc in zip(samples, docs, strict=True):
        assert len(s["arguments"]) == len(doc["choices"])
        ref_scores = []
        for (context, continuation), resp in zip(s["arguments"], s["resps"], strict=True):
            got_ll, got_greedy = resp[0]
            ref_ll, ref_greedy = continuation_logprob(context, continuation)
            n_tokens = max(1, len(tok(continuation, add_special_tokens=False).input_ids))
            assert abs(got_ll - ref_ll) <= 1e-3 * n_tokens, (s["doc_id"], continuation, got_ll, ref_ll)
            assert bool(got_greedy) == ref_greedy, (s["doc_id"], continuation)
            ref_scores.append(ref_ll)
        print(f"{doc['question']!r}: mesh {[r[0][0] for r in s['resps']]} transformers {ref_scores}")
        correct += max(range(len(ref_scores)), key=ref_scores.__getitem__) == doc["label"]
    assert out["results"][TASK]["acc,none"] == pytest.approx(correct / len(docs))
    m.assert_invariants()
