"""An instant fake SGLang HTTP worker (prefill or decode role), for bench/router_compare.py.

sglang-router in PD mode (`--pd-disaggregation`) probes its workers over HTTP (`/health`,
server and model info) and sends each generation request to a prefill and a decode worker at
once, with `bootstrap_host`/`bootstrap_port`/`bootstrap_room` added to the JSON body; it relays
decode's response (for a stream: decode's SSE events) to the client. This worker answers every
one of those at once, in SGLang's / OpenAI's response shapes, doing no model work:

- POST /v1/completions, /v1/chat/completions, /generate: a JSON body, or with `"stream": true`
  one SSE event per token (`max_tokens` of them) then `data: [DONE]`, chunked, as SGLang does.
  The prefill role answers with a one-token body (the router drains and drops it).
- GET anything else (health, server info, model info, /v1/models): 200 with a small JSON body.

Paths it does not know are answered 200 `{}` and counted; `--log-paths` prints each new one,
which is how the calls sglang-router makes were found. Raw asyncio + httptools (+ uvloop when
installed), so the worker costs the router under test as little CPU as possible.

Usage: python -m services.fakes.sglang_worker --port P --role prefill|decode [--log-paths]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from services.fakes.raw_http import RawHttpConnection

MODEL = "pdmesh-tiny"
INFO = {
    "model_path": MODEL, "tokenizer_path": MODEL, "served_model_name": MODEL, "is_generation": True,
    "disaggregation_mode": "", "max_total_num_tokens": 1 << 20, "version": "fake",
}


def _head(status: int, ctype: bytes, length: int | None) -> bytes:
    reason = b"OK" if status == 200 else b"ERR"
    size = b"Transfer-Encoding: chunked\r\n" if length is None else b"Content-Length: %d\r\n" % length
    return b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\n%sConnection: keep-alive\r\n\r\n" % (status, reason, ctype, size)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class FakeSglangConnection(RawHttpConnection):
    """One HTTP connection to the fake SGLang worker (an asyncio protocol per client socket)."""

    role = "decode"
    log_paths = False
    seen: set[str] = set()

    def on_request(self, method: bytes, path: str, body: bytes) -> None:
        if self.log_paths and path not in self.seen:
            self.seen.add(path)
            print(f"[fake-sglang {self.role}] {method.decode()} {path}", file=sys.stderr, flush=True)
        if method == b"POST" and path in ("/v1/completions", "/v1/chat/completions", "/generate"):
            self.generate(path, body)
        else:
            out = json.dumps(INFO if "info" in path else ({"object": "list", "data": [{"id": MODEL}]}
                                                            if path.startswith("/v1/models") else {})).encode()
            self.transport.write(_head(200, b"application/json", len(out)) + out)

    def generate(self, path: str, raw: bytes) -> None:
        try:
            req = json.loads(raw or b"{}")
        except ValueError:
            req = {}
        n = 1 if self.role == "prefill" else int(req.get("max_tokens") or req.get("sampling_params", {}).get(
            "max_new_tokens") or 16)
        chat = path == "/v1/chat/completions"
        if req.get("stream"):
            out = [_head(200, b"text/event-stream", None)]
            for i in range(n):
                finish = "length" if i == n - 1 else None
                choice = ({"index": 0, "delta": {"content": "a"}, "logprobs": None, "finish_reason": finish} if chat
                          else {"index": 0, "text": "a", "logprobs": None, "finish_reason": finish})
                event = {"id": "cmpl-fake", "object": "chat.completion.chunk" if chat else "text_completion",
                         "created": 0, "model": MODEL, "choices": [choice]}
                out.append(_chunk(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"))
            out.append(_chunk(b"data: [DONE]\n\n"))
            out.append(b"0\r\n\r\n")
            self.transport.write(b"".join(out))
            return
        choice = ({"index": 0, "message": {"role": "assistant", "content": "a" * n}, "logprobs": None,
                   "finish_reason": "length"} if chat
                  else {"index": 0, "text": "a" * n, "logprobs": None, "finish_reason": "length"})
        body = json.dumps({
            "id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion", "created": 0,
            "model": MODEL, "choices": [choice],
            "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n},
        }, separators=(",", ":")).encode()
        self.transport.write(_head(200, b"application/json", len(body)) + body)


async def serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(FakeSglangConnection, "127.0.0.1", port, backlog=1024)
    print(f"fake sglang {FakeSglangConnection.role} on 127.0.0.1:{port}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--role", choices=("prefill", "decode"), required=True)
    ap.add_argument("--log-paths", action="store_true", help="print each new method + path to stderr")
    args = ap.parse_args()
    FakeSglangConnection.role, FakeSglangConnection.log_paths = args.role, args.log_paths
    try:
        import uvloop
        uvloop.run(serve(args.port))
    except ImportError:
        asyncio.run(serve(args.port))


if __name__ == "__main__":
    main()
