"""Test helper process: one endpoint of the KV transfer with the REAL NIXL agent.

    python -m tests.integration.transfer_peer --role sender|receiver [--worker-id ID] ...

The process owns a KV pool shaped like the built-in model's (optionally the model itself), a
NixlAgent, and either a KVSender + gRPC KVBootstrap server (role sender, the prefill side) or a
KVReceiver + KVReceiveCoordinator with heartbeats (role receiver, the decode side), all on one
asyncio loop, like the workers. It is driven by JSON commands on stdin, one per line, each with
an "id"; it answers on stdout with lines starting with "@@" (everything else on stdout, e.g.
NIXL's own logging, is ignored by tests/integration/transfer_fixtures.py):

    {"id": 1, "ok": true, ...}                 reply to command 1
    {"ev": "terminal", "room": 5, ...}         a room reached Success/Failed
    {"ev": "ready", ...}                       startup done (sender: bootstrap port)

Data check: without a model, the sender fills page i of room R with bytes from a generator
seeded by (R, i) and the receiver regenerates and compares them bit for bit. With --model, the
sender runs a real prefill of the prompt and the receiver continues decoding from the received
pages.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import sys
import threading
import time
import traceback

import grpc
import torch

from services.engine.kv_pool import KVPool
from services.transfer.bootstrap import KVReceiveCoordinator, add_bootstrap_servicer
from services.transfer.nixl_agent import NixlAgent
from services.transfer.poller import ProgressPoller
from services.transfer.receiver import KVReceiver, ReceiverRoom
from services.transfer.sender import KVSender, SenderRoom
from services.transfer.state import RoomState


def emit(obj) -> None:
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


def pattern(room: int, index: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed((room * 1_000_003 + index) % (1 << 62))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def page_bytes(pool: KVPool, page: int) -> torch.Tensor:
    return pool.kv[page].view(torch.uint8).reshape(-1)


def sha(pool: KVPool, pages: list[int]) -> list[str]:
    return [hashlib.sha256(page_bytes(pool, p).numpy().tobytes()).hexdigest()[:16] for p in pages]


class Endpoint:
    def __init__(self, args):
        self.args = args
        from services.engine.loader import load_model

        # Every peer's pool has the default model's layout, with or without the model, so that a
        # data-only receiver can attach to a sender that runs the model.
        loaded = load_model(None)
        config = loaded.config
        self.model = loaded.model if args.model else None
        self.config = config
        self.pool = KVPool(config, args.pages, page_size=16)
        self.agent = NixlAgent.for_pool(args.role, self.pool)
        self.terminal_times: dict[int, float] = {}

    def status(self) -> dict:
        self.pool.allocator.check_integrity()
        self.pool.aux_allocator.check_integrity()
        return {
            "pages_used": self.pool.allocator.num_used,
            "aux_used": self.pool.aux_allocator.num_used,
            "live_handles": self.agent.num_live_handles,
            "agent": self.agent.name,
            "epoch": self.agent.epoch,
        }


class SenderEndpoint(Endpoint):
    async def start(self):
        self.sender = KVSender(
            self.agent,
            self.pool,
            on_terminal=self._on_terminal,
            stall_before_post=self.args.stall_before_post,
        )
        self._orig_apply = self.sender._apply_attach
        self.sender._apply_attach = self._apply_attach  # the "scheduler": run attached rooms
        self.poller = ProgressPoller.attach(self.sender)
        self.poller.start()
        self.server = grpc.aio.server()
        add_bootstrap_servicer(self.server, self.sender)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.work: dict[int, dict] = {}  # room -> pages, token, logprob, auto
        emit({"ev": "ready", "port": self.port, **self.status()})

    def _apply_attach(self, r: SenderRoom, a) -> None:
        self._orig_apply(r, a)
        w = self.work.get(r.room)
        if w is not None and w["auto"]:
            asyncio.get_running_loop().call_soon(self._send, r.room)

    def _send(self, room: int) -> None:
        w = self.work.get(room)
        r = self.sender.rooms.get(room)
        if w is None or r is None or r.state != RoomState.WAITING_FOR_INPUT:
            return
        self.sender.send(room, w["pages"], w["token"], w["logprob"])

    def _on_terminal(self, r: SenderRoom) -> None:
        w = self.work.pop(r.room, None)
        if w is not None:
            self.pool.allocator.free(w["pages"], owner=("req", r.room))
        ev = {
            "ev": "terminal",
            "side": "sender",
            "room": r.room,
            "state": r.state.label,
            "reason": r.reason,
            "nbytes": r.nbytes,
            "ndescs": r.ndescs,
            "post_to_done_ms": (r.done_at - r.posted_at) * 1e3 if r.done_at and r.posted_at else None,
            "t": time.monotonic(),
        }
        asyncio.get_running_loop().call_soon(self.sender.release, r.room)
        emit(ev)

    async def cmd_prefill(self, c):
        room = c["room"]
        self.sender.create_room(room)
        if "prompt" in c:
            from services.common.sampling_params import SamplingParams
            from services.engine.runner import ModelRunner, PrefillItem
            from services.engine.sampler import Sampler

            prompt = c["prompt"]
            pages = self.pool.allocator.alloc(self.pool.pages_for_tokens(len(prompt)), owner=("req", room))
            logits = ModelRunner(self.model, self.pool).prefill([PrefillItem(prompt, 0, pages)])
            toks, lps = Sampler().sample(logits, [SamplingParams(temperature=0.0)], [len(prompt)])
            token, logprob = int(toks[0]), float(lps[0])
        else:
            pages = self.pool.allocator.alloc(c["n_pages"], owner=("req", room))
            for i, p in enumerate(pages):
                page_bytes(self.pool, p).copy_(pattern(room, i, self.pool.page_nbytes))
            token, logprob = room % 1000, -1.0 / (1 + room % 7)
        self.work[room] = {"pages": pages, "token": token, "logprob": logprob, "auto": c.get("auto", True)}
        r = self.sender.rooms.get(room)
        if r.state == RoomState.WAITING_FOR_INPUT and c.get("auto", True):
            self._send(room)
        return {"src_sha": sha(self.pool, pages), "pages": pages, "token": token, "logprob": logprob}

    async def cmd_send(self, c):
        self._send(c["room"])
        r = self.sender.rooms.get(c["room"])
        return {"state": r.state.label if r else None}

    async def cmd_room(self, c):
        r = self.sender.rooms.get(c["room"])
        if r is None:
            o = self.sender.rooms.outcome(c["room"])
            return {"state": o.label if o else None, "live": False}
        xfer_state = None
        if r.xfer is not None:
            xfer_state = self.agent.check(r.xfer) if not r.xfer.released else "released"
        return {"state": r.state.label, "live": True, "xfer": xfer_state, "age": r.age(time.monotonic())}

    async def cmd_abort(self, c):
        return {"known": self.sender.abort(c["room"], c.get("reason", "test abort"))}

    async def cmd_status(self, c):
        return {
            **self.status(),
            "rooms": len(self.sender.rooms),
            "pending_attach": self.sender.num_pending_attach,
            "peers": sorted(p.agent_name for p in self.sender.peers),
            "stats": self.sender.stats,
            "polls": self.poller.polls,
        }

    async def cmd_reference(self, c):
        from services.common.sampling_params import SamplingParams
        from services.engine.local_generate import generate

        pool = KVPool(self.config, 64, page_size=16)
        params = [SamplingParams(temperature=0.0, max_tokens=c["max_tokens"], ignore_eos=True)] * len(
            c["prompts"]
        )
        return {"tokens": generate(self.model, pool, c["prompts"], params)}


class ReceiverEndpoint(Endpoint):
    async def start(self):
        self.receiver = KVReceiver(self.agent, self.pool, on_terminal=self._on_terminal)
        self.poller = ProgressPoller.attach(self.receiver)
        self.poller.start()
        self.coord = KVReceiveCoordinator(
            self.receiver,
            self.args.worker_id,
            rpc_timeout=2.0,
            heartbeat_interval=self.args.heartbeat_interval,
            heartbeat_max_failures=3,
        )
        self.coord.start_heartbeats()
        self.work: dict[int, dict] = {}
        emit({"ev": "ready", **self.status()})

    def _on_terminal(self, r: ReceiverRoom) -> None:
        w = self.work.get(r.room)
        ev = {
            "ev": "terminal",
            "side": "receiver",
            "room": r.room,
            "state": r.state.label,
            "reason": r.reason,
        }
        if w is not None:
            n_src = w["n_src"]
            pages = w["pages"][:n_src]
            ev["sha"] = sha(self.pool, pages)
            ev["attach_to_done_ms"] = (time.monotonic() - w["t0"]) * 1e3
            if r.state == RoomState.SUCCESS:
                ev["token"], ev["logprob"] = r.result.token, r.result.logprob
                if w["check_pattern"]:
                    ev["pattern_ok"] = all(
                        torch.equal(page_bytes(self.pool, p), pattern(r.room, i, self.pool.page_nbytes))
                        for i, p in enumerate(pages)
                    )
            if not (w["keep"] and r.state == RoomState.SUCCESS):
                self._free(r.room)
        emit(ev)

    def _free(self, room: int) -> None:
        w = self.work.pop(room, None)
        if w is not None:
            self.pool.allocator.free(w["pages"], owner=("req", room))
        asyncio.get_running_loop().call_soon(self.receiver.release, room)

    async def cmd_recv(self, c):
        room, addr = c["room"], c["bootstrap"]
        self.receiver.create_room(room, addr)
        pages = self.pool.allocator.alloc(c["n_pages"], owner=("req", room))
        self.work[room] = {
            "pages": pages,
            "n_src": c.get("n_src", c["n_pages"]),
            "keep": c.get("keep", False),
            "check_pattern": c.get("check_pattern", True),
            "t0": time.monotonic(),
        }
        ok = await self.coord.attach(room, addr, pages)
        r = self.receiver.rooms.get(room)
        return {"attached": ok, "state": r.state.label if r else None, "reason": r.reason if r else None}

    async def cmd_decode(self, c):
        from services.common.sampling_params import SamplingParams
        from services.engine.runner import DecodeItem, ModelRunner
        from services.engine.sampler import Sampler

        room = c["room"]
        w, row = self.work[room], self.receiver.result(room)
        runner, sampler, params = (
            ModelRunner(self.model, self.pool),
            Sampler(),
            SamplingParams(temperature=0.0),
        )
        tokens, pos = [row.token], c["prompt_len"]
        while len(tokens) < c["max_tokens"]:
            logits = runner.decode([DecodeItem(tokens[-1], pos, w["pages"])])
            toks, _ = sampler.sample(logits, [params], [pos + 1])
            tokens.append(int(toks[0]))
            pos += 1
        self._free(room)
        return {"tokens": tokens}

    async def cmd_status(self, c):
        return {
            **self.status(),
            "rooms": len(self.receiver.rooms),
            "counts": self.receiver.counts(),
            "stats": self.receiver.stats,
            "polls": self.poller.polls,
        }


async def main_async(args) -> None:
    ep = SenderEndpoint(args) if args.role == "sender" else ReceiverEndpoint(args)
    await ep.start()
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue = asyncio.Queue()

    def reader():
        for line in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, line)
        loop.call_soon_threadsafe(lines.put_nowait, None)

    threading.Thread(target=reader, daemon=True).start()

    async def run(c):
        try:
            res = await getattr(ep, "cmd_" + c["cmd"])(c)
            emit({"id": c.get("id"), "ok": True, **(res or {})})
        except Exception as e:
            emit(
                {
                    "id": c.get("id"),
                    "ok": False,
                    "error": f"{type(e).__name__}: {e}",
                    "tb": traceback.format_exc(),
                }
            )

    tasks = set()
    while True:
        line = await lines.get()
        if line is None:
            break
        line = line.strip()
        if not line:
            continue
        c = json.loads(line)
        if c.get("cmd") == "quit":
            emit({"id": c.get("id"), "ok": True})
            break
        t = loop.create_task(run(c))
        tasks.add(t)
        t.add_done_callback(tasks.discard)
    os._exit(0)  # the tests check state via `status` before quitting; skip slow teardown


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["sender", "receiver"], required=True)
    ap.add_argument("--worker-id", default="decode-test")
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--model", action="store_true", help="load the built-in model (real prefill/decode)")
    ap.add_argument("--stall-before-post", type=float, default=0.0, help="TEST fault knob of KVSender")
    ap.add_argument("--heartbeat-interval", type=float, default=0.5)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
