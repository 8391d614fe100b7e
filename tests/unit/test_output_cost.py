"""Output work per token is O(1), and a big JSON body never holds the event loop.

Work is counted, not timed: the ids the detokenizer decodes per token, and the turns the event
loop gets while a body of n × 8,000 tokens with top_logprobs is built.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from services.common.builtin_tokenizer import BuiltinTokenizer
from services.common.detokenizer import MAX_PENDING_TOKENS, PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer
from services.router.orchestrator import Chunk
from services.router.output import OutputText, TokenStrings
from services.router.protocol import GenerateSpec
from services.router.render import BODY_SLICE, ResponseState

TOK = BuiltinTokenizer()
TOKENS = 8000


class CountingTokenizer(BuiltinTokenizer):
    """Counts the ids and characters every decode() call handles."""

    def __init__(self):
        super().__init__()
        self.ids = self.chars = self.calls = 0

    def decode(self, ids, skip_special_tokens=True):
        text = super().decode(ids, skip_special_tokens)
        self.ids += len(ids)
        self.chars += len(text)
        self.calls += 1
        return text


@pytest.mark.parametrize("stream", [
    [0xFF] * TOKENS,  # a byte that is never UTF-8: each token decodes to U+FFFD alone
    [0xE2, 0x82] * (TOKENS // 2),  # a character's start, again and again, never completed
    [0x80] * TOKENS,  # lone continuation bytes
])
def test_detokenizer_work_per_token_is_bounded_when_tokens_decode_to_replacement_chars(stream):
    tok = CountingTokenizer()
    detok = IncrementalDetokenizer(tok, [104, 105, 33])
    worst = 0
    pieces = []
    for t in stream:
        before = tok.ids
        pieces.append(detok.add(t))
        worst = max(worst, tok.ids - before)
    pieces.append(detok.flush())
    # two decodes per token, of a window of at most the context plus the pending ids
    assert worst <= 2 * (PROMPT_CONTEXT_TOKENS + 2 * MAX_PENDING_TOKENS)
    assert tok.ids <= 2 * (PROMPT_CONTEXT_TOKENS + 2 * MAX_PENDING_TOKENS) * (len(stream) + 1)
    assert "".join(pieces) == TOK.decode(stream)  # the same text as one decode of the whole output


def test_detokenizer_is_exact_on_ordinary_text():
    rng = random.Random(7)
    text = "".join(rng.choice(["a", "é", "€", "𝄞", " ", "\n", "中"]) for _ in range(3000))
    ids = list(text.encode("utf-8"))
    tok = CountingTokenizer()
    detok = IncrementalDetokenizer(tok, [1])
    out = "".join(detok.add(t) for t in ids) + detok.flush()
    assert out == text
    assert tok.ids <= 2 * (PROMPT_CONTEXT_TOKENS + 2 * MAX_PENDING_TOKENS) * (len(ids) + 1)


def test_output_text_work_does_not_grow_with_what_was_released():
    out = OutputText(CountingTokenizer(), [1], stop=["STOP!"])
    for _ in range(TOKENS):
        out.add(ord("S"))
    assert len(out._pending) < len("STOP!")  # only a possible stop prefix is ever held
    assert out.released_chars == len(out.text) > TOKENS - 5


def _big_state(kind: str, index: int, logprobs: int) -> ResponseState:
    spec = GenerateSpec(kind=kind, model="m", prompt_ids=[1, 104], max_tokens=TOKENS, logprobs=logprobs, n=4)
    state = ResponseState(spec, TOK, TokenStrings(TOK), "r", index=index)
    rng = random.Random(index)
    for start in range(0, TOKENS, 500):
        ids = [rng.randrange(32, 127) for _ in range(500)]
        top = [[(rng.randrange(32, 127), -1.0 - k) for k in range(logprobs)] for _ in ids]
        state.feed(Chunk(ids, [-0.5] * len(ids), "length" if start + 500 >= TOKENS else "", top))
    return state


@pytest.mark.parametrize("kind,logprobs", [pytest.param("chat", 20, marks=pytest.mark.long), ("chat", 2),
                                           ("completion", 5), ("completion", 0)])
def test_a_big_body_is_built_with_the_loop_served_between_slices(kind, logprobs):
    states = [_big_state(kind, i, logprobs) for i in range(4)]

    async def main():
        turns = 0
        done = False

        async def ticker():
            nonlocal turns
            while not done:
                turns += 1
                await asyncio.sleep(0)

        task = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        start = turns
        body = await states[0].body_json(states)
        done = True
        await task
        return body, turns - start

    body, turns = asyncio.run(main())
    assert json.loads(body) == json.loads(json.dumps(states[0].body(states)))
    slices = 4 * TOKENS // BODY_SLICE
    assert turns >= slices  # the loop ran between every slice of entries


def test_small_bodies_are_encoded_at_once_and_equal():
    state = ResponseState(GenerateSpec(kind="chat", model="m", prompt_ids=[1], max_tokens=4, logprobs=2), TOK,
                          TokenStrings(TOK), "r")
    state.feed(Chunk([104, 105], [-0.1, -0.2], "length", [[(104, -0.1)], [(105, -0.2)]]))
    assert json.loads(asyncio.run(state.body_json())) == state.body()
