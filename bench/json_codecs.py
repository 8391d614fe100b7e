"""The router's JSON work with three codecs, side by side in one run, printed as JSON.

What the router encodes and decodes per request: the request body (a chat request; a 100 KB
prompt), a non-streamed completion (with and without 64 tokens of top-5 logprobs), and one SSE
chunk of a chat stream. Each codec runs every payload interleaved with the others (`--rounds`
rounds of `--number` calls, best round kept), so a busy machine slows them alike: read the
ratios. The router uses the winner (services/router/json_codec.py); `--check` verifies that
every codec reads and writes the same values.

Usage: python bench/json_codecs.py [--rounds 5] [--number 2000]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import timeit

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import msgspec  # noqa: E402
import orjson  # noqa: E402


def stdlib_dumps(v) -> bytes:
    return json.dumps(v, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


_msgspec_enc = msgspec.json.Encoder()
_msgspec_dec = msgspec.json.Decoder()

CODECS = {
    "stdlib": (stdlib_dumps, json.loads),
    "orjson": (orjson.dumps, orjson.loads),
    "msgspec": (_msgspec_enc.encode, _msgspec_dec.decode),
}


def payloads() -> dict[str, tuple[str, object]]:
    """name -> ("encode" | "decode", value): the shapes the router writes and reads."""
    usage = {"prompt_tokens": 812, "completion_tokens": 64, "total_tokens": 876,
             "prompt_tokens_details": {"cached_tokens": 768}}
    text = "The quick brown fox jumps over the lazy dog, then — naïvely — naps. " * 4
    completion = {"id": "cmpl-5f0c2b1e9a7d4c3b", "object": "text_completion", "created": 1764633600,
                  "model": "pdmesh-tiny", "system_fingerprint": None,
                  "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                               "stop_reason": None}], "usage": usage}
    tokens = [f"tok{i}" for i in range(64)]
    with_logprobs = json.loads(json.dumps(completion))
    with_logprobs["choices"][0]["logprobs"] = {
        "tokens": tokens, "token_logprobs": [-0.25 - i / 100 for i in range(64)],
        "text_offset": list(range(0, 64 * 4, 4)),
        "top_logprobs": [{f"alt{i}-{k}": -1.5 - k / 7 for k in range(5)} for i in range(64)]}
    chunk = {"id": "chatcmpl-5f0c2b1e9a7d4c3b", "object": "chat.completion.chunk", "created": 1764633600,
             "model": "pdmesh-tiny", "choices": [{"index": 0, "delta": {"content": " fox"},
                                                  "logprobs": None, "finish_reason": None}]}
    chat_request = {"model": "pdmesh-tiny", "messages": [
        {"role": "system", "content": "You are a careful assistant. " * 8},
        {"role": "user", "content": "Summarise the following notes. " * 20},
        {"role": "assistant", "content": "Here is a summary. " * 12},
        {"role": "user", "content": "Now list three follow-ups."}],
        "max_tokens": 256, "temperature": 0.7, "top_p": 0.95, "stream": True,
        "stream_options": {"include_usage": True}, "seed": 1234}
    long_prompt = {"model": "pdmesh-tiny", "prompt": "lorem ipsum dolor sit amet " * 3800, "max_tokens": 16}
    return {
        "encode_completion": ("encode", completion),
        "encode_completion_logprobs": ("encode", with_logprobs),
        "encode_sse_chunk": ("encode", chunk),
        "decode_chat_request": ("decode", stdlib_dumps(chat_request)),
        "decode_100kb_prompt": ("decode", stdlib_dumps(long_prompt)),
    }


def check() -> None:
    for name, (kind, value) in payloads().items():
        outs = []
        for codec, (dumps, loads) in CODECS.items():
            outs.append((codec, json.loads(dumps(value)) if kind == "encode" else loads(value)))
        first = outs[0][1]
        for codec, out in outs[1:]:
            assert out == first, f"{name}: {codec} differs from stdlib"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--number", type=int, default=2000)
    ap.add_argument("--check", action="store_true", help="only verify the codecs agree")
    args = ap.parse_args()
    check()
    if args.check:
        print(json.dumps({"check": "ok"}))
        return
    best: dict[str, dict[str, float]] = {}
    for name, (kind, value) in payloads().items():
        best[name] = {}
        for _ in range(args.rounds):
            for codec, (dumps, loads) in CODECS.items():
                fn = dumps if kind == "encode" else loads
                t = timeit.timeit(lambda fn=fn, value=value: fn(value), number=args.number) / args.number * 1e6
                best[name][codec] = min(best[name].get(codec, t), t)
    out = {"unit": "us per call (best round)", "rounds": args.rounds, "number": args.number, "results": {}}
    for name, per in best.items():
        out["results"][name] = {**{k: round(v, 2) for k, v in per.items()},
                                "speedup_over_stdlib": {k: round(per["stdlib"] / v, 2)
                                                        for k, v in per.items() if k != "stdlib"}}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
