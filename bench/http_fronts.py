"""HTTP fronts for the router, side by side in one run: uvicorn + httptools + uvloop (the router's
today), granian with ASGI, granian with RSGI (its native interface, no ASGI message dicts), and
`raw`: httptools' parser on a bare asyncio protocol under uvloop, with no interface at all (no
ASGI messages, no request objects, no timeouts or limits) — the least any Python HTTP/1.1 front
on this stack can cost, so the bound a different front could reach.

Each front serves the same router-shaped handler: read the POST body, parse it as JSON (orjson,
as the router's codec), build an OpenAI completion (or, with "stream": true, 16 SSE chunks and
[DONE]) and write it. No workers, no gRPC: what is measured is the HTTP server's own cost per
request, the part of the router's 91 µs floor (docs/router.md) that a front can change. Each
front runs alone on core 0 (`taskset -c 0`), wrk on the other cores with a Lua script that
varies the prompt per request; CPU per request is the server's user + system time over the
requests wrk completed.

Usage: python bench/http_fronts.py [--seconds 5] [--conns 1,32] [--fronts uvicorn,granian-asgi,granian-rsgi,raw]
Prints one JSON object; `--check` runs each front for one second at c = 1 (a smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import orjson

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.router_compare import Procs, ensure_wrk, tree_cpu_seconds, wait_http  # noqa: E402
from services.fakes.raw_http import RawHttpConnection  # noqa: E402
from services.launch.ports import free_port  # noqa: E402

CHUNKS = 16
# A body per request: wrk's `request` hook writes a new prompt each time, so nothing keyed on
# the body (a cache in front, a memoised parse) can win.
LUA = r"""
counter = 0
request = function()
  counter = counter + 1
  local body = '{"model":"pdmesh-tiny","max_tokens":16,"stream":%s,"prompt":"request ' .. counter ..
    ': the quick brown fox jumps over the lazy dog"}'
  return wrk.format("POST", "/v1/completions", {["Content-Type"] = "application/json"}, body)
end
done = function(summary, latency, requests)
  local errors = summary.errors.connect + summary.errors.read + summary.errors.write
    + summary.errors.status + summary.errors.timeout
  io.write(string.format('WRKJSON {"requests": %%d, "duration_us": %%d, "errors": %%d, "p50_us": %%d, "p99_us": %%d}\n',
    summary.requests, summary.duration, errors, latency:percentile(50), latency:percentile(99)))
end
"""


def completion(body: bytes) -> bytes:
    req = orjson.loads(body)
    return orjson.dumps({
        "id": "cmpl-bench", "object": "text_completion", "created": int(time.time()), "model": req["model"],
        "choices": [{"index": 0, "text": " x" * req.get("max_tokens", 16), "finish_reason": "length",
                     "logprobs": None}],
        "usage": {"prompt_tokens": len(req["prompt"]) // 4, "completion_tokens": req.get("max_tokens", 16)},
    })


def chunks(body: bytes):
    req = orjson.loads(body)
    for i in range(CHUNKS):
        yield b"data: " + orjson.dumps({"id": "cmpl-bench", "object": "text_completion", "model": req["model"],
                                        "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}) + b"\n\n"
    yield b"data: [DONE]\n\n"


async def asgi_app(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    if b'"stream":true' in body:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        for c in chunks(body):
            await send({"type": "http.response.body", "body": c, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    out = completion(body)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})


async def rsgi_app(scope, proto):
    body = await proto()
    if b'"stream":true' in body:
        transport = proto.response_stream(200, [("content-type", "text/event-stream"), ("cache-control", "no-cache")])
        for c in chunks(body):
            await transport.send_bytes(c)
        return
    proto.response_bytes(200, [("content-type", "application/json")], completion(body))


class RawProtocol(RawHttpConnection):
    """One connection: the handler answers each whole request, keep-alive as the parser says; each
    SSE chunk is its own write, as an ASGI `send` each is."""

    def on_request(self, method: bytes, path: str, body: bytes) -> None:
        write = self.transport.write
        keep = self.parser.should_keep_alive()
        connection = b"keep-alive" if keep else b"close"
        if b'"stream":true' in body:
            write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
                  b"transfer-encoding: chunked\r\nconnection: " + connection + b"\r\n\r\n")
            for c in chunks(body):
                write(b"%x\r\n%s\r\n" % (len(c), c))
            write(b"0\r\n\r\n")
        else:
            out = completion(body)
            write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                  b"connection: %s\r\n\r\n%s" % (len(out), connection, out))
        if not keep:
            self.transport.close()


def serve_raw(port: int) -> None:
    import uvloop

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(RawProtocol, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    uvloop.run(main())


def serve(front: str, port: int) -> None:
    if front == "raw":
        serve_raw(port)
        return
    if front == "uvicorn":
        import uvicorn

        uvicorn.run("bench.http_fronts:asgi_app", host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                    log_level="warning", access_log=False)
        return
    from granian import Granian

    interface = front.split("-", 1)[1]
    Granian(f"bench.http_fronts:{interface}_app", address="127.0.0.1", port=port, interface=interface,
            workers=1, runtime_threads=1, loop="uvloop", log_enabled=False, working_dir=ROOT).serve()


def start_front(procs: Procs, front: str, port: int, core: str = "0"):
    """One front serving the handler on `port` in a process of its own (on `core` when pinned)."""
    return procs.start(front, "bench.http_fronts", ["--serve", front, "--port", str(port)], core)


def run_wrk(wrk: str, url: str, script: pathlib.Path, conns: int, seconds: int, core: str) -> dict:
    cmd = ["taskset", "-c", core, wrk, "-t", "1", "-c", str(conns), "-d", f"{seconds}s", "--timeout", "10s",
           "-s", str(script), url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60).stdout
    m = re.search(r"WRKJSON (\{.*\})", out)
    if not m:
        raise RuntimeError(f"wrk printed no summary:\n{out}")
    s = json.loads(m.group(1))
    return {"rps": round(s["requests"] / (s["duration_us"] / 1e6), 1), "requests": s["requests"],
            "errors": s["errors"], "p50_ms": round(s["p50_us"] / 1000, 3), "p99_ms": round(s["p99_us"] / 1000, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--conns", default="1,32")
    ap.add_argument("--fronts", default="uvicorn,granian-asgi,granian-rsgi,raw")
    ap.add_argument("--check", action="store_true", help="one second per front at c = 1")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return 0
    if args.check:
        args.seconds, args.conns = 1, "1"
    if (os.cpu_count() or 1) < 2:
        sys.exit("needs 2 cores: the front on core 0, wrk on the rest")
    wrk = ensure_wrk()
    others = f"1-{os.cpu_count() - 1}"
    results: dict = {}
    with tempfile.TemporaryDirectory() as td:
        tmp = pathlib.Path(td)
        for stream in (False, True):
            (tmp / f"s{int(stream)}.lua").write_text(LUA % ("true" if stream else "false"))
        for front in args.fronts.split(","):
            procs = Procs(tmp, pin=True)
            try:
                port = free_port()
                p = start_front(procs, front, port)
                url = f"http://127.0.0.1:{port}/v1/completions"
                wait_http(url, 30, front, post=b'{"model":"m","prompt":"warm up","max_tokens":1}')
                row: dict = {}
                for stream in (False, True):
                    for conns in (int(c) for c in args.conns.split(",")):
                        script = tmp / f"s{int(stream)}.lua"
                        run_wrk(wrk, url, script, conns, 1, others)  # warm-up
                        cpu0 = tree_cpu_seconds(p.popen.pid)
                        res = run_wrk(wrk, url, script, conns, args.seconds, others)
                        cpu = tree_cpu_seconds(p.popen.pid) - cpu0
                        res["cpu_us_per_request"] = round(cpu / max(1, res["requests"]) * 1e6, 1)
                        row[f"{'stream' if stream else 'plain'}_c{conns}"] = res
                results[front] = row
            finally:
                procs.close()
    base = results.get("uvicorn")
    ratios = {}
    if base:
        for front, row in results.items():
            if front != "uvicorn":
                ratios[front] = {k: round(v["rps"] / base[k]["rps"], 2) for k, v in row.items() if base[k]["rps"]}
    print(json.dumps({"bench": "http_fronts", "seconds": args.seconds, "chunks_per_stream": CHUNKS,
                      "pinning": f"front on core 0, wrk on {others}", "results": results,
                      "rps_vs_uvicorn": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
