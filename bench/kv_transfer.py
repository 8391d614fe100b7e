"""KV transfer benchmark: prefill -> decode over NIXL between two OS processes. Prints JSON.

    .venv/bin/python bench/kv_transfer.py                  # both layouts, production polling
    .venv/bin/python bench/kv_transfer.py --investigate    # + the raw-NIXL stall investigation

Part 1 (per request, through the real KVSender/KVReceiver and their ProgressPollers): for
prompts of 16 ... 8192 tokens, the time from posting the WRITE to the sender's DONE and to the
receiver's verified Success, the bandwidth, the number of NIXL descriptors, and an in-process
``copy_`` of the same bytes in the same run (ratio = transfer / copy). Layouts: the built-in
model (fp32) and a Llama-7B-shaped pool (fp16, 32 layers, 32 KV heads, head_dim 128; only the
pool is allocated). The bootstrap RPCs are replaced by direct calls (same code paths otherwise).

Part 2 (``--investigate``): raw NIXL WRITEs (no pdmesh code) of 4 KiB ... 64 MiB under NIXL's
default progress thread vs owner polling, receiver poll cadences and UCX transport settings.
Findings: docs/transfer.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import pickle
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PAGE_SIZE = 16


def _layouts():
    import torch

    from services.engine.builtin_model import builtin_config
    from services.engine.model_config import ModelConfig

    llama7b = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=128,
        max_position_embeddings=4096,
        name="llama-7b-shaped",
    )
    return {"builtin": (builtin_config(), torch.float32), "llama7b": (llama7b, torch.float16)}


def _page_nbytes(config, dtype) -> int:
    import torch

    return (
        config.num_hidden_layers
        * 2
        * PAGE_SIZE
        * config.num_key_value_heads
        * config.head_dim
        * torch.empty(0, dtype=dtype).element_size()
    )


def _mem_available() -> int:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _summ(xs: list[float]) -> dict:
    return {"p50": round(statistics.median(xs), 4), "p90": round(_pct(xs, 0.9), 4), "max": round(max(xs), 4)}


# --- part 1: receiver process ---------------------------------------------------------------------


async def _receiver_main(args) -> None:
    from services.engine.kv_pool import KVPool
    from services.transfer.nixl_agent import NixlAgent
    from services.transfer.poller import ProgressPoller
    from services.transfer.receiver import KVReceiver

    config, dtype = _layouts()[args.layout]
    pool = KVPool(config, args.pages, page_size=PAGE_SIZE, dtype=dtype, num_aux_slots=64)
    agent = NixlAgent.for_pool("bench-decode", pool)
    out = sys.stdout

    def emit(o):
        out.write(json.dumps(o) + "\n")
        out.flush()

    owned: dict[int, list[int]] = {}

    def on_terminal(r):
        emit(
            {
                "ev": "terminal",
                "room": r.room,
                "state": r.state.label,
                "reason": r.reason,
                "t": time.monotonic(),
            }
        )
        pool.allocator.free(owned.pop(r.room), owner=r.room)
        asyncio.get_running_loop().call_soon(rx.release, r.room)

    rx = KVReceiver(agent, pool, on_terminal=on_terminal)
    poller = ProgressPoller.attach(rx, interval=args.poll_interval)
    poller.start()
    lay = agent.layout
    emit(
        {
            "agent": agent.name,
            "epoch": agent.epoch,
            "metadata": agent.metadata().hex(),
            "layout": [
                lay.kv_base_addr,
                lay.page_nbytes,
                lay.num_pages,
                lay.kv_memory_kind.value,
                lay.kv_device_id,
                lay.aux_base_addr,
                lay.aux_row_nbytes,
                lay.num_aux_slots,
            ],
        }
    )
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = await reader.readline()
        if not line:
            break
        c = json.loads(line)
        if c["op"] == "quit":
            break
        room = c["room"]
        pages = pool.allocator.alloc(c["n_pages"], owner=room)
        owned[room] = pages
        rx.create_room(room, "bench")
        p = rx.prepare_attach(room, pages)
        rx.mark_attached(room, c["sender_agent"], c["sender_epoch"])
        emit({"room": room, "dst_pages": p.dst_pages, "aux_slot": p.dst_aux_slot})
    emit(
        {
            "ev": "bye",
            "polls": poller.polls,
            "whole": pool.allocator.is_whole() and pool.aux_allocator.is_whole(),
        }
    )
    os._exit(0)


# --- part 1: sender (this process) ----------------------------------------------------------------


async def _bench_layout(name: str, max_tokens: int, reps: int, poll_interval: float,
                        token_list: list[int] | None = None, rx_prefix: list[str] | None = None,
                        cut: dict | None = None) -> dict:
    """token_list: the prompt sizes (default 16, 32, ... max_tokens); rx_prefix: a command that
    wraps the receiver (another network namespace); cut: measure a partition during a WRITE
    (keys: links = services.launch.netns.Links args, src, dst, rate, tokens)."""
    import torch

    from services.engine.kv_pool import KVPool
    from services.transfer.nixl_agent import NixlAgent
    from services.transfer.poller import ProgressPoller
    from services.transfer.sender import KVSender
    from services.transfer.wire_format import MemoryKind, MemoryLayout

    config, dtype = _layouts()[name]
    max_pages = max_tokens // PAGE_SIZE
    pool = KVPool(config, max_pages, page_size=PAGE_SIZE, dtype=dtype, num_aux_slots=64)
    pool.kv.view(torch.uint8).fill_(0x5A)  # touch every page: no lazily mapped zero pages
    scratch = torch.empty_like(pool.kv)
    agent = NixlAgent.for_pool("bench-prefill", pool)
    done: dict[int, asyncio.Future] = {}
    loop = asyncio.get_running_loop()

    def on_terminal(r):
        f = done.get(r.room)
        if f is not None and not f.done():
            f.set_result(r)

    sender = KVSender(agent, pool, on_terminal=on_terminal)
    poller = ProgressPoller.attach(sender, interval=poll_interval)
    poller.start()
    proc = await asyncio.create_subprocess_exec(
        *(rx_prefix or []), sys.executable, __file__, "--_receiver", "--layout", name, "--pages", str(max_pages),
        "--poll-interval", str(poll_interval),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=1 << 26,
    )  # fmt: skip
    rx_events: dict[int, asyncio.Future] = {}
    replies: asyncio.Queue = asyncio.Queue()

    async def read_json():  # NIXL logs to stdout too: skip anything that is not our JSON
        while True:
            line = await proc.stdout.readline()
            if not line or line.startswith(b"{"):
                return json.loads(line) if line else None

    async def read_rx():
        while True:
            o = await read_json()
            if o is None:
                return
            if o.get("ev") == "terminal":
                f = rx_events.get(o["room"])
                if f is not None and not f.done():
                    f.set_result(o)
            else:
                await replies.put(o)

    hello = await read_json()
    reader_task = loop.create_task(read_rx())
    lay = hello["layout"]
    rlayout = MemoryLayout(lay[0], lay[1], lay[2], MemoryKind(lay[3]), lay[4], lay[5], lay[6], lay[7])
    sender.register_peer(
        "bench-decode", hello["agent"], hello["epoch"], bytes.fromhex(hello["metadata"]), rlayout
    )

    async def one(room: int, n_pages: int):
        src = pool.allocator.alloc(n_pages, owner=room)
        sender.create_room(room)
        proc.stdin.write(
            (json.dumps({"op": "attach", "room": room, "n_pages": n_pages,
                         "sender_agent": agent.name, "sender_epoch": agent.epoch}) + "\n").encode()
        )  # fmt: skip
        await proc.stdin.drain()
        rep = await replies.get()
        sender.attach(room, hello["agent"], hello["epoch"], rep["dst_pages"], rep["aux_slot"])
        done[room] = loop.create_future()
        rx_events[room] = loop.create_future()
        t_post = time.monotonic()
        sender.send(room, src, first_token=1, logprob=-0.5)
        r = await asyncio.wait_for(done[room], 120)
        ev = await asyncio.wait_for(rx_events[room], 120)
        del done[room], rx_events[room]
        pool.allocator.free(src, owner=room)
        sender.release(room)
        if r.state.label != "Success" or ev["state"] != "Success":
            raise RuntimeError(f"room {room} failed: {r.reason} / {ev.get('reason')}")
        return (r.done_at - r.posted_at) * 1e3, (ev["t"] - t_post) * 1e3, r.ndescs, r.nbytes

    room = 1
    await one(room, 1)  # warm-up: connection establishment
    rows = []
    sizes = token_list or [16 << i for i in range(32) if 16 << i <= max_tokens]
    for tokens in sizes:
        n_pages = tokens // PAGE_SIZE
        s_ms, r_ms = [], []
        for _ in range(reps):
            room += 1
            a, b, ndescs, nbytes = await one(room, n_pages)
            s_ms.append(a)
            r_ms.append(b)
        copies = {}
        for threads in (torch.get_num_threads(), 1):
            prev = torch.get_num_threads()
            torch.set_num_threads(threads)
            scratch[:n_pages].copy_(pool.kv[:n_pages])  # untimed warm-up
            ms = []
            for _ in range(reps):
                t0 = time.perf_counter()
                scratch[:n_pages].copy_(pool.kv[:n_pages])
                ms.append((time.perf_counter() - t0) * 1e3)
            torch.set_num_threads(prev)
            copies[threads] = ms
        c_ms, c1_ms = copies[torch.get_num_threads()], copies[1]
        p50 = statistics.median(s_ms)
        c50 = min(statistics.median(c_ms), statistics.median(c1_ms))  # the better copy_ baseline
        rows.append(
            {
                "tokens": tokens,
                "pages": n_pages,
                "bytes": nbytes,
                "descriptors": ndescs,
                "sender_post_to_done_ms": _summ(s_ms),
                "receiver_post_to_success_ms": _summ(r_ms),
                "transfer_GBps": round(nbytes / (p50 / 1e3) / 1e9, 3),
                "copy_ms": _summ(c_ms),
                "copy_1thread_ms": _summ(c1_ms),
                "copy_GBps": round(nbytes / (c50 / 1e3) / 1e9, 3),
                "transfer_over_copy": round(p50 / c50, 2),
            }
        )
        print(f"# {name} {tokens:5d} tok {nbytes / 2**20:9.2f} MiB: transfer {p50:8.3f} ms "
              f"(max {max(s_ms):7.3f}) copy_ {c50:8.3f} ms", file=sys.stderr, flush=True)  # fmt: skip
    partition = await _partition_during_write(sender, pool, proc, replies, hello, agent, done, cut) if cut else None
    proc.stdin.write(b'{"op": "quit"}\n')
    await proc.stdin.drain()
    await proc.wait()
    await reader_task
    await poller.stop()
    whole = pool.allocator.is_whole() and pool.aux_allocator.is_whole() and agent.num_live_handles == 0
    agent.close()
    return {
        "layout": name,
        "dtype": str(dtype).replace("torch.", ""),
        "page_nbytes": pool.page_nbytes,
        "poll_interval_s": poll_interval,
        "reps": reps,
        "sender_whole_after": whole,
        "requests": rows,
        **({"partition_during_write": partition} if partition else {}),
    }


async def _partition_during_write(sender, pool, proc, replies, hello, agent, done, cut: dict) -> dict:
    """Post one WRITE over a link capped to cut["rate"], drop every packet between the hosts
    0.5 s later, and time the sender's error (UCX_TCP_USER_TIMEOUT bounds it)."""
    from services.launch.netns import Links

    links = Links(**cut["links"])
    loop = asyncio.get_running_loop()
    room, n_pages = 10**9, cut["tokens"] // PAGE_SIZE
    src = pool.allocator.alloc(n_pages, owner=room)
    sender.create_room(room)
    proc.stdin.write((json.dumps({"op": "attach", "room": room, "n_pages": n_pages, "sender_agent": agent.name,
                                  "sender_epoch": agent.epoch}) + "\n").encode())
    await proc.stdin.drain()
    rep = await replies.get()
    sender.attach(room, hello["agent"], hello["epoch"], rep["dst_pages"], rep["aux_slot"])
    done[room] = loop.create_future()
    links.cap(cut["src"], cut["rate"])
    try:
        sender.send(room, src, first_token=1, logprob=-0.5)
        await asyncio.sleep(0.5)
        links.partition(cut["src"], cut["dst"])
        t_cut = time.monotonic()
        r = await asyncio.wait_for(done[room], 600)
        took = time.monotonic() - t_cut
    finally:
        links.heal()
        links.uncap(cut["src"])
    pool.allocator.free(src, owner=room)
    sender.release(room)
    print(f"# partition during a WRITE: sender {r.state.label} {took:.2f} s after the cut ({r.reason})",
          file=sys.stderr, flush=True)
    return {"bytes": n_pages * pool.page_nbytes, "rate": cut["rate"], "state": r.state.label,
            "reason": r.reason, "sender_error_after_cut_s": round(took, 2),
            "UCX_TCP_USER_TIMEOUT": os.environ.get("UCX_TCP_USER_TIMEOUT")}


def _across_hosts(reps: int, sizes: list[int]) -> dict:
    """Sender and receiver in two network namespaces (own IPC/UTS: UCX sees two hosts) joined by
    veth through a bridge, next to loopback; llama7b layout (128 tokens = 64 MiB, 2048 = 1 GiB)."""
    from services.launch.netns import Topology, unsupported_reason

    why = unsupported_reason()
    if why:
        return {"skipped": why}
    topo = Topology.create(["prefill", "decode"])
    try:
        spec = {"sizes": sizes, "reps": reps, "rx_prefix": topo.wrap("decode", []),
                "cut": {"links": {"ns": topo.hosts, "addr": topo.addrs}, "src": "prefill", "dst": "decode",
                        "rate": "100mbit", "tokens": 128}}
        env = {**os.environ, "UCX_TCP_USER_TIMEOUT": os.environ.get("UCX_TCP_USER_TIMEOUT", "5s")}
        out = subprocess.run(topo.wrap("prefill", [sys.executable, __file__, "--_hosts-sender", json.dumps(spec)]),
                             env=env, capture_output=True, text=True, timeout=1200)
        sys.stderr.write(out.stderr[-4000:])
        if out.returncode != 0:
            return {"error": out.stderr[-2000:]}
        line = [x for x in out.stdout.splitlines() if x.startswith("{")][-1]
        return {"across_hosts": json.loads(line),
                "veth": "sender and receiver in two network + IPC + UTS namespaces, veth through a bridge"}
    finally:
        topo.destroy()


# --- part 2: raw NIXL investigation ---------------------------------------------------------------

RAW_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 16 << 20, 64 << 20]


def _raw_peer(args) -> None:
    """A bare NIXL agent (numpy buffer, no torch, no pdmesh code)."""
    import numpy as np
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})  # before UCX starts threads
    n = RAW_SIZES[-1]
    buf = np.full(n, 1 if args.raw_peer == "send" else 0, dtype=np.uint8)
    agent = nixl_agent(
        f"raw-{args.raw_peer}-{os.getpid()}", nixl_agent_config(enable_prog_thread=args.pt, backends=["UCX"])
    )
    addr = buf.ctypes.data
    agent.register_memory([(addr, n, 0, "")], "DRAM")
    md = pathlib.Path(args.dir) / "md"
    if args.raw_peer == "recv":
        tmp = md.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps((agent.get_agent_metadata(), addr)))
        tmp.rename(md)
        deadline = time.time() + 120
        while time.time() < deadline:
            if any(b"END" in v for v in agent.get_new_notifs().values()):
                return
            if args.recv_sleep > 0:
                time.sleep(args.recv_sleep)
        return
    while not md.exists():
        time.sleep(0.005)
    meta, raddr = pickle.loads(md.read_bytes())
    peer = agent.add_remote_agent(meta)

    def write(size: int, tag: bytes) -> float:
        src = agent.get_xfer_descs([(addr, size, 0)], "DRAM")
        dst = agent.get_xfer_descs([(raddr, size, 0)], "DRAM")
        h = agent.initialize_xfer("WRITE", src, dst, peer, tag)
        t0 = time.perf_counter()
        st = agent.transfer(h)
        while st == "PROC":
            st = agent.check_xfer_state(h)
        dt = time.perf_counter() - t0
        agent.release_xfer_handle(h)
        if st != "DONE":
            raise RuntimeError(st)
        return dt * 1e3

    write(8, b"warm")
    res = {}
    for size in RAW_SIZES:
        ms = [write(size, b"x") for _ in range(args.reps)]
        res[size] = {**_summ(ms), "GBps_p50": round(size / (statistics.median(ms) / 1e3) / 1e9, 3)}
    write(8, b"END")
    r = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"sizes": res, "sender_cpu_s": round(r.ru_utime + r.ru_stime, 2)}), flush=True)


def _idle_cpu(pt: bool, seconds: float = 2.0) -> float:
    code = (
        "import time,resource,os\n"
        "from nixl_cu12._api import nixl_agent, nixl_agent_config\n"
        f"a = nixl_agent('idle-'+str(os.getpid()), nixl_agent_config(enable_prog_thread={pt}, backends=['UCX']))\n"
        "r0 = resource.getrusage(resource.RUSAGE_SELF)\n"
        f"time.sleep({seconds})\n"
        "r1 = resource.getrusage(resource.RUSAGE_SELF)\n"
        "print((r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return round(float(out.stdout.strip().splitlines()[-1]) / seconds, 3)


RAW_CONFIGS = [
    # name, sender progress thread, receiver progress thread, receiver poll sleep (s), extra env
    # (+ optional CPU pinning "sender_cpus/receiver_cpus", e.g. "0/0": both on CPU 0)
    ("nixl_default_progress_thread_both", True, True, 0.001, {}),
    ("progress_thread_both_pinned_same_cpu", True, True, 0.001, {}, "0/0"),
    ("owner_polling_recv_busy_pinned_same_cpu", False, False, 0.0, {}, "0/0"),
    ("owner_polling_recv_busy_pinned_own_cpus", False, False, 0.0, {}, "0/1"),
    ("owner_polling_recv_1ms_pinned_same_cpu", False, False, 0.001, {}, "0/0"),
    ("progress_thread_sender_only", True, False, 0.001, {}),
    ("progress_thread_receiver_only", False, True, 0.001, {}),
    ("owner_polling_both_recv_1ms", False, False, 0.001, {}),
    ("owner_polling_both_recv_busy", False, False, 0.0, {}),
    ("owner_polling_both_recv_10ms", False, False, 0.010, {}),
    ("progress_thread_both_UCX_TLS=tcp", True, True, 0.001, {"UCX_TLS": "tcp"}),
    ("progress_thread_both_UCX_TLS=sm,tcp", True, True, 0.001, {"UCX_TLS": "sm,tcp"}),
    ("progress_thread_both_RNDV_THRESH=inf_ZCOPY_THRESH=inf", True, True, 0.001,
     {"UCX_RNDV_THRESH": "inf", "UCX_ZCOPY_THRESH": "inf"}),
    ("owner_polling_both_recv_1ms_UCX_TLS=tcp", False, False, 0.001, {"UCX_TLS": "tcp"}),
    ("owner_polling_both_recv_1ms_UCX_TLS=sm,tcp", False, False, 0.001, {"UCX_TLS": "sm,tcp"}),
]  # fmt: skip


def _investigate(reps: int) -> dict:
    out = {
        "idle_cpu_cores_per_agent": {
            "progress_thread_on": _idle_cpu(True),
            "progress_thread_off": _idle_cpu(False),
        }
    }
    runs = []
    for name, spt, rpt, rsleep, env_extra, *pin in RAW_CONFIGS:
        env = dict(os.environ, **env_extra)
        s_cpus, r_cpus = pin[0].split("/") if pin else ("", "")
        if pin and max(int(c) for c in (s_cpus + "," + r_cpus).split(",")) >= (os.cpu_count() or 1):
            runs.append({"config": name, "skipped": "not enough CPUs for this pinning"})
            continue
        with tempfile.TemporaryDirectory() as d:
            common = [sys.executable, __file__, "--_raw-dir", d, "--reps", str(reps)]
            recv = subprocess.Popen(
                [*common, "--_raw-peer", "recv", "--_recv-sleep", str(rsleep), "--_cpus", r_cpus]
                + (["--_pt"] if rpt else []),
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            try:
                snd = subprocess.run(
                    [*common, "--_raw-peer", "send", "--_cpus", s_cpus] + (["--_pt"] if spt else []),
                    env=env, capture_output=True, text=True, timeout=300,
                )  # fmt: skip
            finally:
                try:
                    recv.wait(30)
                except subprocess.TimeoutExpired:
                    recv.kill()
        line = next((x for x in snd.stdout.splitlines() if x.startswith("{")), None)
        if line is None:
            runs.append({"config": name, "error": snd.stderr[-2000:]})
            continue
        res = json.loads(line)
        runs.append(
            {
                "config": name,
                "sender_progress_thread": spt,
                "receiver_progress_thread": rpt,
                "receiver_poll_sleep_s": rsleep,
                "env": env_extra,
                "cpus_sender_receiver": pin[0] if pin else "any",
                "write_ms_by_size": {str(k): v for k, v in res["sizes"].items()},
                "sender_cpu_s": res["sender_cpu_s"],
            }
        )
        p50s = " ".join(f"{int(k) >> 10}K:{v['p50']:.2f}/{v['max']:.1f}" for k, v in res["sizes"].items())
        print(f"# {name}: p50/max ms {p50s}", file=sys.stderr, flush=True)
    out["raw_writes"] = runs
    return out


# --- entry ----------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="builtin,llama7b")
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--poll-intervals",
        default="0.0005",
        help="ProgressPoller intervals (s) to run, comma separated; 0 = spin (yield to the loop only)",
    )
    ap.add_argument("--investigate", action="store_true", help="also run the raw NIXL stall investigation")
    ap.add_argument("--only-investigate", action="store_true")
    ap.add_argument("--hosts", action="store_true",
                    help="also run 64 MiB and 1 GiB transfers across two network namespaces (root), next to loopback")
    ap.add_argument("--only-hosts", action="store_true")
    ap.add_argument("--_hosts-sender", dest="hosts_sender", help=argparse.SUPPRESS)
    ap.add_argument("--_receiver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layout", help=argparse.SUPPRESS)
    ap.add_argument("--pages", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--poll-interval", type=float, default=0.0005, help=argparse.SUPPRESS)
    ap.add_argument("--_raw-peer", dest="raw_peer", help=argparse.SUPPRESS)
    ap.add_argument("--_raw-dir", dest="dir", help=argparse.SUPPRESS)
    ap.add_argument("--_pt", dest="pt", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_cpus", dest="cpus", default="", help=argparse.SUPPRESS)
    ap.add_argument("--_recv-sleep", dest="recv_sleep", type=float, default=0.001, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._receiver:
        asyncio.run(_receiver_main(args))
        return
    if args.raw_peer:
        _raw_peer(args)
        return
    if args.hosts_sender:
        spec = json.loads(args.hosts_sender)
        res = asyncio.run(_bench_layout("llama7b", max(spec["sizes"]), spec["reps"], 0.0005, spec["sizes"],
                                        spec["rx_prefix"], spec["cut"]))
        print(json.dumps(res))
        return

    import torch

    result: dict = {
        "bench": "kv_transfer",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        },
        "page_size_tokens": PAGE_SIZE,
        "layouts": [],
    }
    if args.hosts or args.only_hosts:
        sizes = [128, 2048]  # 64 MiB and 1 GiB of llama7b-shaped fp16 KV
        if 3.3 * 2048 // PAGE_SIZE * _page_nbytes(*_layouts()["llama7b"]) > _mem_available():
            sizes = [128, 1024]
        loop_res = asyncio.run(_bench_layout("llama7b", max(sizes), args.reps, 0.0005, sizes))
        result["hosts"] = {"loopback": loop_res, **_across_hosts(args.reps, sizes)}
    if not (args.only_investigate or args.only_hosts):
        for name in [x for x in args.layouts.split(",") if x]:
            config, dtype = _layouts()[name]
            max_tokens = args.max_tokens
            # sender pool + copy scratch + receiver pool, with headroom
            while (
                max_tokens > 16
                and 3.3 * (max_tokens // PAGE_SIZE) * _page_nbytes(config, dtype) > _mem_available()
            ):
                max_tokens //= 2
            for interval in [float(x) for x in args.poll_intervals.split(",")]:
                res = asyncio.run(_bench_layout(name, max_tokens, args.reps, interval))
                if max_tokens < args.max_tokens:
                    res["note"] = f"capped at {max_tokens} tokens to fit in memory"
                result["layouts"].append(res)
    if args.investigate or args.only_investigate:
        result["investigation"] = _investigate(max(3, args.reps + 4))
    result["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
