"""A grammar's cost is bounded on the router and on the workers, and grammar caches by bytes.

- router (services/router/grammar_cost.py): a regex whose first mask costs a second is a 400
  before any worker sees it; cheap ones pass; a verdict is remembered by digest, and the same
  grammar in several requests at once is measured once;
- workers (services/engine/grammar.py): a row whose matcher work overruns the step budget allows
  only the end of sequence and is reported for its room alone; the other rows are untouched;
- caches (services/common/byte_lru.py): bounded by bytes, keyed by a digest, never the source.
Work is counted in CPU seconds of the thread doing it, so the verdicts hold on a loaded machine.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.common import grammar_spec
from services.common.builtin_tokenizer import BuiltinTokenizer
from services.common.byte_lru import KEY_BYTES, ByteLRU, source_key
from services.common.tokenizer import load_tokenizer, resolve_model_path
from services.engine.grammar import GrammarRegistry, build_tokenizer
from services.router.errors import APIError
from services.router.grammar_cost import GrammarCost

pytestmark = pytest.mark.timeout(120)
EXPENSIVE = ("regex", "((a{60}){60}){60}")  # ~1 ms to compile, ~0.3-0.5 s of CPU for its first mask
CHEAP = ("regex", "[a-z]{1,20}@example\\.com")
VOCAB = 300


@pytest.fixture(scope="module")
def cost():
    g = GrammarCost(load_tokenizer("builtin"), Path(resolve_model_path("builtin")), compile_budget=2.0,
                    mask_budget=0.05)
    yield g
    g.close()


def test_an_expensive_grammar_is_a_400_and_a_cheap_one_passes(cost):
    async def main():
        await cost.check(CHEAP)
        await cost.check(("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}'))
        with pytest.raises(APIError) as e:
            await cost.check(EXPENSIVE, "structured_outputs")
        return e.value

    error = asyncio.run(main())
    assert error.status == 400 and error.code == "grammar_too_expensive" and error.param == "structured_outputs"
    assert "--grammar-mask-budget" in error.message


def test_verdicts_are_remembered_and_concurrent_checks_measure_once(cost, monkeypatch):
    calls = []
    real = cost.measure
    monkeypatch.setattr(cost, "measure", lambda *g: calls.append(g) or real(*g))
    grammar = ("regex", "(b{50}){40}c")

    async def main():
        return await asyncio.gather(*(cost.check(grammar) for _ in range(6)), return_exceptions=True)

    first = asyncio.run(main())
    again = asyncio.run(main())
    assert len(calls) == 1  # six at once, then six more: one measurement
    assert [type(r) for r in first] == [type(r) for r in again]


def test_a_grammar_that_does_not_compile_over_the_tokenizer_is_a_400(cost):
    async def main():
        await cost.check(("lark", "start: nothing_defined_here"))

    with pytest.raises(APIError) as e:
        asyncio.run(main())
    assert e.value.status == 400


def test_a_row_over_the_step_budget_fails_its_room_alone():
    registry = GrammarRegistry(build_tokenizer(BuiltinTokenizer(), None, VOCAB), VOCAB, step_budget=0.05)
    rows = [("cheap", CHEAP, []), ("expensive", EXPENSIVE, []), ("other", ("regex", "[0-9]+"), [])]
    masks = registry.allowed_masks(rows)
    overruns = registry.take_overruns()
    assert set(overruns) == {"expensive"} and overruns["expensive"] > 0.05
    eos = set(registry.tokenizer.eos_tokens)
    assert {int(t) for t in masks[1].nonzero()} == eos  # the overrun row can only end
    assert masks[0][ord("a")] and masks[2][ord("7")]  # the others follow their grammars
    assert registry.take_overruns() == {}
    unbounded = GrammarRegistry(build_tokenizer(BuiltinTokenizer(), None, VOCAB), VOCAB, step_budget=0)
    unbounded.allowed_masks(rows[:1])
    assert unbounded.take_overruns() == {}


def test_byte_lru_stays_within_its_budget_and_keeps_the_recent():
    cache = ByteLRU(budget=10_000)
    for i in range(100):
        cache.put(source_key("regex", str(i)), i, cost=1000)
        assert cache.bytes <= 10_000
    assert len(cache) < 10
    assert cache.get(source_key("regex", "99")) == 99 and cache.get(source_key("regex", "0")) is None
    cache.put(b"huge", "x", cost=20_000)  # more than the whole budget: not kept, nothing evicted for it
    assert b"huge" not in cache and cache.get(source_key("regex", "99")) == 99
    assert source_key("a", "bc") != source_key("ab", "c")
    assert len(source_key("regex", "x" * 1_000_000)) == KEY_BYTES


def test_validation_cache_keeps_digests_not_sources():
    grammar_spec._validated.clear()
    for i in range(20):  # 20 distinct 200 kB schemas: the old cache kept 4 MB of sources
        schema = '{"type": "object", "description": "%s"}' % (str(i) * 200_000)
        assert grammar_spec.validate("json_schema", schema) is None
    assert len(grammar_spec._validated) == 20
    assert grammar_spec._validated.bytes < 20 * 1024


def test_compiled_grammars_are_bounded_by_bytes():
    registry = GrammarRegistry(build_tokenizer(BuiltinTokenizer(), None, VOCAB), VOCAB,
                               compiled_cache_bytes=2 * 1024 * 1024)
    for i in range(40):
        registry.compile(("regex", f"x{i}" + "a" * 20_000))
    assert registry.compiled.bytes <= 2 * 1024 * 1024
    assert 0 < len(registry.compiled) < 40
