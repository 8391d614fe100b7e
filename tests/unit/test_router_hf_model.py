"""The router with a Hugging Face model folder: served name, context length from config.json, chat
template, and stop strings / detokenization over multi-byte BPE tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.config import RouterSettings
from services.common.model_name import served_name
from services.common.tokenizer import load_tokenizer
from services.router.errors import APIError
from services.router.model_info import context_length
from services.router.output import OutputText
from services.router.protocol import parse_chat, parse_completion
from services.router.service import Router
from tests.unit.test_tokenizer import build_llama3_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = build_llama3_folder(tmp_path_factory.mktemp("hf") / "tiny-llama3")
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                  "max_position_embeddings": 128}))
    return path


def test_name_and_context_length(folder, tmp_path):
    assert served_name(str(folder)) == "tiny-llama3"
    assert served_name("builtin") == "pdmesh-tiny"
    assert context_length(str(folder)) == 128
    assert context_length("builtin") == 8192
    assert context_length(str(tmp_path)) == 4096  # no config.json: the engine's default
    nested = tmp_path / "vlm"
    nested.mkdir()
    (nested / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 256}}))
    assert context_length(str(nested)) == 256


def test_router_validates_against_the_folder(folder):
    router = Router(RouterSettings(prefill=["127.0.0.1:1"], decode=["127.0.0.1:2"], model=str(folder)))
    info = router.info
    assert info.name == "tiny-llama3" and info.context_length == 128
    messages = [{"role": "user", "content": "Hello there"}]
    spec = parse_chat({"model": "tiny-llama3", "messages": messages, "max_tokens": 5}, info)
    assert spec.prompt_ids == router.tokenizer.encode_chat(messages)
    assert parse_completion({"model": str(folder), "prompt": "hi"}, info).model == "tiny-llama3"  # alias
    with pytest.raises(APIError) as e:
        parse_chat({"model": "tiny-llama3", "messages": messages, "max_tokens": 200}, info)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"


@pytest.mark.parametrize("text,stop", [("naïve café — 世界, done", "é —"), ("the quick brown fox", "k br"),
                                       ("emoji 🤖🎉 party", "🎉")])
def test_stop_strings_over_bpe_tokens(folder, text, stop):
    tok = load_tokenizer(str(folder))
    ids = tok.encode(text, add_special_tokens=False)
    out = OutputText(tok, tok.encode("prompt"), [stop])
    pieces = []
    for token in ids:
        pieces.append(out.add(token))
        assert "\ufffd" not in pieces[-1]
        if out.stopped:
            break
    assert out.stopped and "".join(pieces) == out.text == text[: text.index(stop)]
