"""lm-evaluation-harness's `generate_until` through the mesh equals transformers' greedy output.

lm-eval itself (pinned in .venv-clients) runs the local task tests/clients/tasks/pdmesh_greedy
against the router three times: `local-completions` (token-id prompts, four per request: batched
prompts), `local-chat-completions` (messages; the router applies the chat template) and
`anthropic-chat-completions` (the same messages through Anthropic's Messages API, /v1/messages).
Every answer in lm-eval's samples equals transformers' greedy continuation of the same prompt on
the same checkpoint, cut at the stop strings the client sent, and the exact_match score equals
the one those reference answers earn. The scenario ends with the invariants (queues empty, KV pools whole).
"""

from __future__ import annotations

import json

import pytest

from tests.clients.lm_eval_client import (
    chat_run,
    completions_run,
    messages_run,
    messages_stops,
    run_lm_eval,
    task_docs,
)
from tests.clients.reference import chat_prompt_ids, completion_prompt_ids, greedy_text

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

TASK = "pdmesh_greedy"


def test_generate_until_answers_equal_transformers_greedy(pd_router, tmp_path):
    m, router = pd_router
    docs = task_docs(TASK)
    outputs = run_lm_eval([completions_run(router, [TASK], batch_size=4), chat_run(router, [TASK]),
                           messages_run(router, [TASK])], tmp_path)
    for kind, out in zip(("completions", "chat", "messages"), outputs, strict=True):
        samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
        assert len(samples) == len(docs), kind
        expected = []
        for s in samples:
            context, gen_kwargs = s["arguments"][0]
            if kind == "completions":
                ids = completion_prompt_ids(context)
            else:  # lm-eval's JsonChatStr: the messages as JSON
                ids = chat_prompt_ids(json.loads(context[0]))
            until = messages_stops(gen_kwargs["until"]) if kind == "messages" else gen_kwargs["until"]
            want = greedy_text(ids, gen_kwargs["max_gen_toks"], until)
            got = s["resps"][0][0]
            print(f"{kind} {s['doc']['prompt']!r} -> {got!r}")
            assert got == want, (kind, s["doc_id"], got, want)
            expected.append(want)
        assert any(a.strip() for a in expected), f"{kind}: every answer is empty, nothing was compared"
        reference_score = sum(a == d["answer"] for a, d in zip(expected, docs, strict=True)) / len(docs)
        assert out["results"][TASK]["exact_match,none"] == pytest.approx(reference_score), kind
    m.assert_invariants()
