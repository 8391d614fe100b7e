"""json_codec.loads: what json.loads gives for every body — the same value (types included) or
the same exception — with orjson taking the texts it reads the same."""

import json
import random

import pytest

from services.router.json_codec import loads

EDGES = [
    b'{"a": 1, "a": 2}', b"-0.0", b"-0", b"1E400", b"-1e400", b"1e-400", b"4.9e-324", b"0.1", b"1.0", b"01",
    b"123456789012345678901234567890", b"18446744073709551615", b"18446744073709551616",
    b"-9223372036854775808", b"-9223372036854775809", b'{"seed": 99999999999999999999}',
    b'{"prompt": "1234567890123456789012345"}', b'"\\ud800"', b'"\\ud83d\\ude00"', b'"\xed\xa0\x80"',
    b"NaN", b"-Infinity", b'{"temperature": NaN}', b"\xef\xbb\xbf{}", b'"\xff"', b"[1,]", b"{}x", b"",
    b" {} ", b'{"x": "\\u0000"}', '{"é": "ü"}'.encode("utf-16"), '{"a": 1}'.encode("utf-32"),
    b"[" * 1100 + b"]" * 1100, b"[" * 900 + b"]" * 900, b'{"a": [true, false, null, 1.5e3, "t\\n"]}',
]


def outcome(fn, raw: bytes):
    try:
        return "value", repr(fn(raw))
    except RecursionError:
        return "error", "RecursionError"
    except (ValueError, UnicodeDecodeError) as e:
        return "error", f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("raw", EDGES, ids=range(len(EDGES)))
def test_the_standard_librarys_answer_on_edge_cases(raw):
    assert outcome(loads, raw) == outcome(json.loads, raw)


def test_the_standard_librarys_answer_on_random_texts():
    rng = random.Random(7)
    atoms = ['"a"', '"\\u00e9"', '"\\ud800"', "1", "-0", "2.5e10", "1e400", "12345678901234567890", "true",
             "null", "NaN", "[]", "{}", '""', '"é"']

    def value(depth: int) -> str:
        r = rng.random()
        if depth > 3 or r < 0.4:
            return rng.choice(atoms)
        if r < 0.7:
            return "[" + ",".join(value(depth + 1) for _ in range(rng.randint(0, 4))) + "]"
        return "{" + ",".join(f'"k{rng.randint(0, 3)}":{value(depth + 1)}' for _ in range(rng.randint(0, 4))) + "}"

    for _ in range(3000):
        text = value(0).encode()
        if rng.random() < 0.2:  # damaged: a byte dropped or changed
            i = rng.randrange(len(text))
            text = text[:i] + (b"" if rng.random() < 0.5 else bytes([rng.randrange(256)])) + text[i + 1:]
        assert outcome(loads, text) == outcome(json.loads, text), text
