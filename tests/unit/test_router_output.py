"""Router text output: incremental detokenization + stop strings trimmed across token boundaries."""

from __future__ import annotations

import random

import pytest

from services.common.builtin_tokenizer import BUILTIN_EOS_ID, BuiltinTokenizer
from services.router.orchestrator import Chunk
from services.router.output import OutputText, StopMatcher, TokenStrings
from services.router.protocol import GenerateSpec
from services.router.render import ResponseState

TOK = BuiltinTokenizer()


def run(text: str, stops, split=None) -> tuple[str, list[str], bool]:
    """Feed `text` byte by byte (builtin tokens); returns (released text, pieces, stopped)."""
    out = OutputText(TOK, [1], stops)
    pieces = []
    for b in text.encode("utf-8"):
        piece = out.add(b)
        pieces.append(piece)
        for p in pieces:
            assert "\ufffd" not in p  # never a broken character
        if out.stopped:
            break
    else:
        pieces.append(out.finish())
    return out.text, pieces, out.stopped


def reference(text: str, stops) -> tuple[str, bool]:
    hits = [text.find(s) for s in stops if s and s in text]
    if not hits:
        return text, False
    return text[: min(hits)], True


@pytest.mark.parametrize(
    "text,stops,expected,stopped",
    [
        ("Hello world", ["lo w"], "Hel", True),
        ("Hello world", ["xyz"], "Hello world", False),
        ("aaab", ["aab"], "a", True),  # overlapping prefix
        ("abcabd", ["abd"], "abc", True),
        ("one\n\ntwo", ["\n\n", "two"], "one", True),  # earliest stop wins
        ("café au lait", ["é a"], "caf", True),  # stop straddles a multi-byte character
        ("日本語のテキスト", ["のテ"], "日本語", True),
        ("emoji 🤖 end", ["🤖"], "emoji ", True),
        ("stop at end", ["end"], "stop at ", True),
        ("ends with partial st", ["stop"], "ends with partial st", False),  # held back, released at finish
    ],
)
def test_stop_strings(text, stops, expected, stopped):
    got, pieces, was_stopped = run(text, stops)
    assert got == expected and "".join(pieces) == expected and was_stopped == stopped


def test_text_is_held_back_only_while_it_could_be_a_stop():
    out = OutputText(TOK, [1], ["STOP"])
    assert out.add(ord("a")) == "a"
    assert out.add(ord("S")) == ""  # could begin "STOP"
    assert out.add(ord("T")) == ""
    assert out.add(ord("x")) == "STx"  # it was not
    assert not out.stopped


def test_split_utf8_is_never_emitted_half():
    out = OutputText(TOK, [1])
    data = "é🤖".encode()
    got = [out.add(b) for b in data]
    assert got == ["", "é", "", "", "", "🤖"]


def test_random_against_reference():
    rng = random.Random(7)
    alphabet = "ab é\n日"
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        got, pieces, stopped = run(text, stops)
        want, want_stopped = reference(text, stops)
        assert (got, stopped) == (want, want_stopped), (text, stops)
        assert "".join(pieces) == want


def test_stop_matcher_holdback():
    m = StopMatcher(["abc", "xy"])
    assert m.holdback("zzab", 0) == 2
    assert m.holdback("zzx", 0) == 1
    assert m.holdback("zzz", 0) == 0
    assert m.holdback("ab", 2) == 0  # only the unreleased part counts
    assert m.find("..xy.abc", 0) == 2


def spec(**kw) -> GenerateSpec:
    base = dict(kind="completion", model="m", prompt_ids=[1, 104, 105], max_tokens=16)
    return GenerateSpec(**{**base, **kw})


def test_response_state_counts_and_hides_the_stop_token():
    state = ResponseState(spec(logprobs=1), TOK, TokenStrings(TOK), "r")
    text, entries = state.feed(Chunk([104, 105], [-0.1, -0.2], ""))
    assert text == "hi" and len(entries) == 2
    text, entries = state.feed(Chunk([BUILTIN_EOS_ID], [-0.3], "stop"))
    assert text == "" and state.finish_reason == "stop"
    assert state.usage() == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    body = state.body()
    assert body["choices"][0]["text"] == "hi"
    lp = body["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [-0.1, -0.2, -0.3] and lp["tokens"][:2] == ["h", "i"]
    assert lp["top_logprobs"][0] == {"h": -0.1} and lp["text_offset"] == [0, 1, 2]  # the chosen token only


def test_response_state_stop_token_id_that_is_plain_text_is_hidden():
    state = ResponseState(spec(stop_token_ids=[ord("!")]), TOK, TokenStrings(TOK), "r")
    state.feed(Chunk([104], [0.0], ""))
    state.feed(Chunk([ord("!")], [0.0], "stop"))
    assert state.body()["choices"][0]["text"] == "h"


def test_response_state_stop_string_ends_output_mid_chunk():
    state = ResponseState(spec(stop=["cd"]), TOK, TokenStrings(TOK), "r")
    text, _ = state.feed(Chunk(list(b"abcdef"), [0.0] * 6, ""))
    assert text == "ab" and state.finish_reason == "stop" and state.completion_tokens == 4


def test_chat_logprobs_shape_and_nonfinite_clamped():
    state = ResponseState(spec(kind="chat", logprobs=2), TOK, TokenStrings(TOK), "r")
    state.feed(Chunk([0xC3, 0xA9], [float("-inf"), -1.0], "length"))
    body = state.body()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "é", "refusal": None}
    content = body["choices"][0]["logprobs"]["content"]
    assert content[0]["logprob"] == -9999.0 and content[0]["bytes"] == [0xC3]
    assert content[1]["top_logprobs"] == []  # the workers sent no alternatives


def test_top_logprobs_alternatives_chat_and_completions():
    top = [[(ord("a"), -0.1), (ord("b"), -2.5)], [(ord("c"), -0.3), (ord("d"), -1.5)]]
    state = ResponseState(spec(kind="chat", logprobs=2), TOK, TokenStrings(TOK), "r")
    state.feed(Chunk([ord("a"), ord("d")], [-0.1, -1.5], "length", top))
    content = state.body()["choices"][0]["logprobs"]["content"]
    assert [[t["token"] for t in c["top_logprobs"]] for c in content] == [["a", "b"], ["c", "d"]]
    assert content[1]["top_logprobs"][1] == {"token": "d", "logprob": -1.5, "bytes": [ord("d")]}
    state = ResponseState(spec(logprobs=1), TOK, TokenStrings(TOK), "r")
    state.feed(Chunk([ord("a"), ord("d")], [-0.1, -1.5], "length", [t[:1] for t in top]))
    # completions: a dict per position that always holds the chosen token (vLLM's rule)
    assert state.body()["choices"][0]["logprobs"]["top_logprobs"] == [{"a": -0.1}, {"c": -0.3, "d": -1.5}]


def test_echo_prepends_prompt_once():
    state = ResponseState(spec(echo=True, echo_text="hi"), TOK, TokenStrings(TOK), "r")
    assert state.feed(Chunk([33], [0.0], ""))[0] == "hi!"
    assert state.feed(Chunk([33], [0.0], "length"))[0] == "!"
    assert state.body()["choices"][0]["text"] == "hi!!"


def test_stream_chunk_shapes():
    state = ResponseState(spec(kind="chat", stream=True, include_usage=True), TOK, TokenStrings(TOK), "abc")
    role = state.role_chunk()
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""} and role["usage"] is None
    text, entries = state.feed(Chunk([104], [0.0], "length"))
    last = state.delta_chunk(text, entries, state.finish_reason)
    assert last["choices"][0]["delta"] == {"content": "h"} and last["choices"][0]["finish_reason"] == "length"
    usage = state.usage_chunk()
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 1
    assert usage["id"] == "chatcmpl-abc" and usage["object"] == "chat.completion.chunk"


def test_feed_each_keeps_each_tokens_alternatives():
    top = [[(ord("a"), -0.1)], [(ord("b"), -0.2)], [(ord("c"), -0.3)]]
    whole = ResponseState(spec(kind="chat", logprobs=1, stream=True), TOK, TokenStrings(TOK), "r")
    parts = whole.feed_each(Chunk(list(b"abc"), [-0.1, -0.2, -0.3], "length", top))
    assert [e[0][3] for _, e, _ in parts] == top
    one = ResponseState(spec(kind="chat", logprobs=1, stream=True), TOK, TokenStrings(TOK), "r")
    for i, t in enumerate(b"abc"):
        one.feed(Chunk([t], [[-0.1, -0.2, -0.3][i]], "length" if i == 2 else "", top[i : i + 1]))
    assert whole.body() == one.body() | {"created": whole.created}


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("stop", [[], ["lo w"], ["o", "zz"]])
def test_feed_each_gives_what_one_token_chunks_give(kind, stop):
    """feed_each of a many-token chunk (the plain-text path too) equals feeding its tokens one
    chunk each: texts, finish reasons, usage and body, with split characters and stop strings."""
    rng = random.Random(7)
    text = "hello wörld ☃ lo w again lo".encode()
    for trial in range(80):
        # cut anywhere (mid-character, inside a stop string's prefix); the token that stops decode
        # is hidden whichever it is
        reason = rng.choice(["stop", "length"])
        ids = list(text[: rng.randint(2, len(text))]) + ([rng.choice([BUILTIN_EOS_ID, ord("X")])]
                                                        if reason == "stop" else [])
        cuts = sorted(rng.sample(range(1, len(ids)), min(len(ids) - 1, rng.randint(1, 8))))
        chunks = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]
        many = ResponseState(spec(kind=kind, stop=stop, stream=True), TOK, TokenStrings(TOK), "r")
        single = ResponseState(spec(kind=kind, stop=stop, stream=True), TOK, TokenStrings(TOK), "r")
        got, want = [], []
        for k, part in enumerate(chunks):
            finish = reason if k == len(chunks) - 1 else ""
            if not many.finished:
                got += many.feed_each(Chunk(part, [0.0] * len(part), finish, cached_tokens=2))
            for i, t in enumerate(part):
                if single.finished:
                    break
                last = finish if i == len(part) - 1 else ""
                want.append((*single.feed(Chunk([t], [0.0], last, cached_tokens=2)), single.finish_reason))
        assert got == want, (trial, chunks)
        assert many.body() == single.body() | {"created": many.created}
