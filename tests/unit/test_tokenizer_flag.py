"""vLLM's --tokenizer: the tokenizer and its chat template from a folder of their own, the model
folder still giving the weights, the context length, the sampling defaults and the ids generation
stops on — in the tokenizer loader, the router (its app, against scripted workers) and a worker's
engine (its structured-output tokenizer)."""

from __future__ import annotations

import shutil

import httpx
import pytest

from services.common.tokenizer import BUILTIN_MODEL_DIR, load_tokenizer
from tests.unit.test_router_app import cluster_factory  # noqa: F401 - fixture

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """The built-in model as two folders: the model without its tokenizer, and the tokenizer."""
    root = tmp_path_factory.mktemp("split")
    model, tok = root / "model", root / "tokenizer"
    model.mkdir()
    tok.mkdir()
    for f in BUILTIN_MODEL_DIR.iterdir():
        shutil.copy(f, (tok if f.name in TOKENIZER_FILES else model) / f.name)
    return model, tok


def test_the_tokenizer_folder_and_the_model_s_stop_ids(split):
    model, tok = split
    builtin = load_tokenizer("builtin")
    both = load_tokenizer(str(model), str(tok))
    text = "Return the number of items."
    assert both.encode(text) == builtin.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert both.apply_chat_template(messages) == builtin.apply_chat_template(messages)
    # generation_config.json (in the model folder) adds <|end|> to the tokenizer's eos
    assert both.eos_token_ids == builtin.eos_token_ids and len(both.eos_token_ids) == 2
    assert load_tokenizer(str(tok)).eos_token_ids == builtin.eos_token_ids[:1]
    with pytest.raises(Exception):  # noqa: B017 - the model folder alone has no tokenizer to load
        load_tokenizer(str(model))


def test_router_with_a_tokenizer_folder(cluster_factory, split):  # noqa: F811
    model, tok = split
    c = cluster_factory(model=str(model), tokenizer=str(tok))
    body = {"model": "model", "messages": [{"role": "user", "content": "hi"}]}
    builtin = load_tokenizer("builtin")
    want = builtin.encode(builtin.apply_chat_template(body["messages"]), add_special_tokens=False)
    assert httpx.post(c.url + "/tokenize", json=body).json()["tokens"] == want
    r = httpx.post(c.url + "/v1/chat/completions", json={**body, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert c.decodes[0].seen.requests[0].token_ids == want
    # the context length comes from the model folder's config.json
    assert httpx.get(c.url + "/v1/models").json()["data"][0]["max_model_len"] == 8192
    c.all_rpcs_ended()


def test_worker_engine_reads_grammars_with_the_tokenizer_folder(split):
    from services.engine.worker_engine import WorkerEngine

    model, tok = split
    engine = WorkerEngine(str(model), "cpu", "float32", 8, 16, tokenizer_path=str(tok))
    assert engine.grammars is not None  # structured output served
    alone = WorkerEngine(str(model), "cpu", "float32", 8, 16)
    assert alone.grammars is None  # the model folder has no tokenizer: structured output is refused
