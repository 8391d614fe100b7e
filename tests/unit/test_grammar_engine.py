"""The grammar engine (services/engine/grammar.py) and the sampler's use of it: masks follow the
grammar, a matcher rebuilt from ids equals the one extended token by token, the grammar beats the
other controls when they disagree, and top_logprobs report the raw distribution."""

from __future__ import annotations

import json
import pathlib

import jsonschema
import pytest
import torch

from services.common.builtin_tokenizer import BUILTIN_END_ID, BUILTIN_EOS_ID, BuiltinTokenizer
from services.common.sampling_params import SamplingParams
from services.common.tokenizer import load_tokenizer
from services.engine.grammar import GrammarError, GrammarRegistry, build_tokenizer
from services.engine.kv_pool import KVPool
from services.engine.loader import load_model
from services.engine.local_generate import generate_full
from services.engine.sampler import Sampler
from services.fakes.random_schemas import random_schema

VOCAB = 264  # builtin-random's
ABC = ("regex", "ab+c")


@pytest.fixture(scope="module")
def registry():
    return GrammarRegistry(build_tokenizer(BuiltinTokenizer(), None, VOCAB), VOCAB)


def allowed(registry, ids, key=None, grammar=ABC):
    return set(torch.nonzero(registry.allowed_mask(key, grammar, ids)).flatten().tolist())


def test_mask_follows_the_grammar(registry):
    a, b, c = (ord(x) for x in "abc")
    assert allowed(registry, []) == {a}
    assert allowed(registry, [a]) == {b}
    assert allowed(registry, [a, b]) == {b, c}
    # complete: only the end of sequence (either of the model's eos ids)
    assert allowed(registry, [a, b, c]) == {BUILTIN_EOS_ID, BUILTIN_END_ID}
    # ids the grammar never allowed (a client-forced prefix): the request can only end
    assert allowed(registry, [c]) == {BUILTIN_EOS_ID, BUILTIN_END_ID}


def test_cached_matcher_equals_one_rebuilt_from_ids(registry):
    schema = ("json_schema", json.dumps(random_schema(3)))
    ids = list(b'{"')
    before = registry.rebuilds
    masks = []
    for n in range(len(ids) + 1):  # extended one id at a time under one key: built once
        masks.append(registry.allowed_mask("room", schema, ids[:n]))
    assert registry.rebuilds == before + 1
    for n in range(len(ids) + 1):  # from scratch (no key), as a migrated request's new worker does
        assert torch.equal(registry.allowed_mask(None, schema, ids[:n]), masks[n])
    # a history that does not extend the cached one (a different attempt) rebuilds, and is right
    assert torch.equal(registry.allowed_mask("room", schema, []), masks[0])
    assert registry.rebuilds == before + 1 + len(ids) + 1 + 1
    registry.forget("room")
    assert "room" not in registry._rooms


def test_bad_grammar_raises(registry):
    with pytest.raises(GrammarError):
        registry.compile(("json_schema", "{not json"))
    with pytest.raises(ValueError):
        registry.compile(("regex", "("))


def test_sampler_obeys_the_grammar_over_bias_and_min_tokens(registry):
    sampler = Sampler(registry)
    logits = torch.zeros(2, VOCAB)
    logits[:, ord("z")] = 50.0  # the model wants 'z'; the grammar forbids it
    greedy = SamplingParams(temperature=0.0, grammar=ABC, logit_bias=((ord("z"), 100.0),))
    sampled = SamplingParams(temperature=1.0, seed=7, grammar=ABC)
    tokens, _ = sampler.sample(logits, [greedy, sampled], [3, 3], [([1, 2, 3], []), ([1, 2, 3], [])], ["g", "s"])
    assert tokens == [ord("a"), ord("a")]
    # complete output but min_tokens holds eos back: the grammar wins, the request ends
    done = SamplingParams(temperature=0.0, grammar=ABC, min_tokens=10,
                          stop_token_ids=(BUILTIN_EOS_ID, BUILTIN_END_ID))
    tokens, _ = sampler.sample(logits[:1], [done], [6], [([1, 2, 3], list(b"abc"))])
    assert tokens[0] in (BUILTIN_EOS_ID, BUILTIN_END_ID)


def test_a_grammar_needs_a_registry():
    with pytest.raises(ValueError, match="structured output"):
        Sampler().sample(torch.zeros(1, VOCAB), [SamplingParams(grammar=ABC)], [1], [([1], [])])


def test_top_logprobs_are_the_raw_distributions_top_k():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    params = [SamplingParams(temperature=0.0, top_logprobs=3), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, seed=1, top_logprobs=1, logit_bias=((5, 30.0),))]
    tokens, logprobs, tops = Sampler().sample_full(logits, params, [1, 1, 1], [([1], [])] * 3)
    ref = torch.log_softmax(logits, dim=-1)
    values, ids = torch.topk(ref, 3, dim=-1)
    assert [t for t, _ in tops[0]] == ids[0].tolist()
    assert [v for _, v in tops[0]] == pytest.approx(values[0].tolist())
    assert tops[1] is None and len(tops[2]) == 1
    assert tokens[2] == 5 and tops[2][0][0] == ids[2][0].item()  # raw, not the biased distribution
    assert logprobs[0] == pytest.approx(tops[0][0][1])  # greedy: the chosen token is the top one


# Six schemas in all, three per model: each model's grammar path is the same code, and a
# 300-token constrained generation is seconds of CPU per schema.
@pytest.mark.parametrize(("model", "seeds"), [("builtin", range(0, 3)), ("builtin-random", range(3, 6))])
def test_single_process_generation_validates_against_random_schemas(model, seeds):
    loaded = load_model(model)
    vocab = loaded.config.vocab_size
    folder = pathlib.Path(loaded.path) if loaded.path else None
    registry = GrammarRegistry(build_tokenizer(load_tokenizer(loaded.path or model), folder, vocab), vocab)
    schemas = [random_schema(seed) for seed in seeds]
    eos = loaded.config.eos_token_ids
    params = [SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i, max_tokens=300, stop_token_ids=eos,
                             grammar=("json_schema", json.dumps(s))) for i, s in zip(seeds, schemas, strict=True)]
    tok = load_tokenizer(loaded.path or model)
    prompt = tok.encode("Here is the record as JSON:", add_special_tokens=False)
    outs = generate_full(loaded.model, KVPool(loaded.config, 256, 16), [prompt] * len(schemas), params,
                         grammars=registry)
    for out, schema in zip(outs, schemas, strict=True):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(tok.decode(out.token_ids[:-1])), schema)
    assert len(registry) == 0  # every room forgotten
