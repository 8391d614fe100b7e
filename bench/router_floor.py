"""The floor under pdmesh's router: the least a Python router on uvicorn + grpc.aio can do per request.

A bare ASGI app on the router's stack (uvicorn, uvloop, httptools, grpc.aio, one channel per
worker) that, per POST, reads the body, issues a Prefill RPC and a Decode stream with fixed ids
to the given workers, reads every chunk and answers a fixed JSON body — no parsing,
tokenization, orchestration, logging or metrics. Run it where `python -m services.router`
would run and measure both with the same load (bench/router_compare.py --floor does): what the
router costs above this is pdmesh's own code; this itself is the cost of the HTTP exchange and
two gRPC calls in one Python process.

With `--lane` the two calls go over the lane (one stream per worker, services/router/lane.py)
as the router sends them; without, one grpc.aio call each (what the router did before the lane).

Usage: python bench/router_floor.py --port P --prefill HOST:PORT --decode HOST:PORT [--lane]
"""

from __future__ import annotations

import argparse
import pathlib
import secrets
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
import uvicorn  # noqa: E402

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb  # noqa: E402
from services.common.generated.pdmesh.v1 import worker_pb2_grpc as wpb_grpc  # noqa: E402
from services.router.lane import LaneStub  # noqa: E402

BODY = b'{"choices":[{"index":0,"text":"x","finish_reason":"length"}]}'
IDS = list(range(1, 18))  # about the compare bench's prompt length


def make_app(prefill: str, decode: str, max_tokens: int, lane: bool = False):
    stubs: dict = {}
    params = wpb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            await receive()  # startup: the channels belong to the server's event loop
            stubs["p"] = wpb_grpc.PrefillStub(grpc.aio.insecure_channel(prefill))
            stubs["d"] = wpb_grpc.DecodeStub(grpc.aio.insecure_channel(decode))
            if lane:  # the calls over one stream per worker, as the router makes them
                stubs["p"], stubs["d"] = LaneStub(stubs["p"], prefill), LaneStub(stubs["d"], decode)
            await send({"type": "lifespan.startup.complete"})
            await receive()  # shutdown
            await send({"type": "lifespan.shutdown.complete"})
            return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        room = secrets.randbits(63)
        pre = stubs["p"].Prefill(wpb.PrefillRequest(room=room, token_ids=IDS, params=params), timeout=10)
        call = stubs["d"].Decode(wpb.DecodeRequest(room=room, prefill_addr=prefill, token_ids=IDS, params=params),
                                 timeout=10)
        while await call.read() is not grpc.aio.EOF:
            pass
        await pre
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": BODY})

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--lane", action="store_true", help="the two calls over the lane (services/router/lane.py)")
    args = ap.parse_args()
    app = make_app(args.prefill, args.decode, args.max_tokens, args.lane)
    # Server.run, as the router's main: uvicorn's "auto" loop and parser (uvloop, httptools)
    uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=args.port, log_config=None, log_level="warning",
                                  access_log=False)).run()


if __name__ == "__main__":
    main()
