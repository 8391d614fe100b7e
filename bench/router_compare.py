"""pdmesh's router against sglang-router, side by side in one run, printed as JSON.

- **sglang-router** (Rust, PyPI `sglang-router`, installed by this script into the bench-only
  environment bench/.venv-sglang, never a pdmesh dependency) in PD mode (`--pd-disaggregation`)
  in front of instant fake SGLang HTTP workers (services/fakes/sglang_worker.py, one process each).
- **pdmesh's router** (`python -m services.router`) in front of instant fake gRPC workers
  (services/fakes/workers.py's FakePrefill / FakeDecode, one process each). The fake decode puts
  the tokens it makes while a chunk is being written into the next chunk, as the real decode
  does (PDMESH_FAKE_COALESCE=0: one token per chunk); `decode_tokens_per_chunk` says how many
  a chunk carried on average.
- with `--floor`, **bench/router_floor.py**: uvicorn + grpc.aio doing only the HTTP exchange and
  the two calls per request (non-streamed cases), as two sides: `floor` with one gRPC call
  each, `floor_lane` with both over the lane as the router sends them — the least a router on
  this stack costs with each transport.
- The same load generator for both: **wrk** (Debian package `wrk`) with a Lua script that POSTs
  the same `/v1/completions` body, in its own process.

Cases: non-streamed `max_tokens` 1 at c = 1 and c = 32 (requests/s, p50/p99 latency), and
streamed `max_tokens` 64 at c = 32 (requests/s and tokens/s through the router). Each case
runs both routers back to back, `--rounds` times alternating which goes first; the JSON has
every run, the median per side, and ratios pdmesh / sglang (req/s: > 1 is pdmesh faster;
p50: < 1 is pdmesh faster). Both routers run with their default logging. Each run also records
the router's CPU time per request (`router_cpu_us_per_request`: user + system time of the
router process and its children over the run, over the requests wrk completed), and the ratio
`router_cpu_per_request` says how many cores pdmesh needs for the other side's requests/s on
one, when the router is what limits it (c = 32).

Fairness on a small machine: with `--pin` (default when there are at least 2 cores) the router
under test runs on core 0 alone (`taskset -c 0`), and wrk and the fake workers of both sides on
the other cores (`taskset -c 1-`), so each router gets one core and its load generator and
workers never compete with it. Both routers idle while the other is measured. The load average
(`os.getloadavg`) before and after is in the JSON: other work on the machine shifts absolute
numbers; the ratios from one run are the point.

Several router processes: `--processes 1,2` also measures pdmesh with `--processes 2` (side
`pdmesh_p2`), and `--router-cores K` gives the router under test cores 0..K-1 (each side in turn;
sglang-router's threads take all K as well) and wrk and the workers the rest. More processes only
help when the router has the cores for them: on this 2-core machine that needs `--no-pin` (the
router, wrk and the workers then share both cores).

HTTPS: `--tls` also measures pdmesh's router serving HTTPS itself (side `pdmesh_tls`: a
self-signed certificate made with the openssl command for the run; wrk keeps its connections,
so what it shows is the per-request cost of TLS, not the handshakes').

Without per-request logs: `--quiet` also measures both routers with their per-request log lines
off (sides `sglang_quiet`, sglang-router's `--log-level warn`, and `pdmesh_quiet`, pdmesh's
`--no-log-requests`): by default each writes two lines per request.

The lane's carrier: `--grpc-lane` also measures pdmesh's router with `--worker-lane-client grpc`
(side `pdmesh_grpc_lane`: the lane on a grpc.aio stream instead of the router's own HTTP/2).

Usage: python bench/router_compare.py [--seconds 5] [--rounds 2] [--stream-tokens 64] [--no-pin]
       [--only pdmesh|sglang] [--floor] [--baseline DIR] [--grpc-lane] [--tls] [--quiet] [--processes 1,2]
       [--router-cores K] [--sglang-cores K]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.launch.launcher import Launcher  # noqa: E402
from services.launch.ports import free_port  # noqa: E402
from services.launch.proc import Proc  # noqa: E402
from services.launch.spec import MeshSpec  # noqa: E402

SGLANG_ROUTER = "sglang-router==0.3.2"
SGLANG_VENV = ROOT / "bench" / ".venv-sglang"
MODEL = "pdmesh-tiny"
PROMPT = "The quick brown fox jumps over the lazy dog. Tell me a story about it."

# Each request's prompt starts with its own number, so nothing keyed on the body (a cache in front
# of either router, a memoised parse) can win; the body's text is split around that number.
LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
counter = 0
local head, tail = [[%s]], [[%s]]
request = function()
  counter = counter + 1
  return wrk.format(nil, nil, nil, head .. counter .. ": " .. tail)
end
done = function(summary, latency, requests)
  local errors = summary.errors.connect + summary.errors.read + summary.errors.write
    + summary.errors.status + summary.errors.timeout
  io.write(string.format('WRKJSON {"requests": %%d, "duration_us": %%d, "errors": %%d, "p50_us": %%d, "p90_us": %%d, "p99_us": %%d, "mean_us": %%.1f}\\n',
    summary.requests, summary.duration, errors, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.mean))
end
"""


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def ensure_sglang() -> pathlib.Path:
    py = SGLANG_VENV / "bin" / "python"
    if not py.exists():
        sh([sys.executable, "-m", "venv", str(SGLANG_VENV)])
    try:
        sh([str(py), "-c", "import sglang_router"])
    except subprocess.CalledProcessError:
        print(f"[compare] installing {SGLANG_ROUTER} into {SGLANG_VENV}", file=sys.stderr, flush=True)
        sh([str(py), "-m", "pip", "install", "-q", SGLANG_ROUTER])
    return py


def ensure_wrk() -> str:
    wrk = shutil.which("wrk")
    if wrk is None:
        sys.exit("wrk not found: install Debian's package (apt-get install -y wrk)")
    return wrk


# the bench's own routers over HTTPS (--tls), with a certificate made for the run: not checked
LOCAL_TLS = ssl._create_unverified_context()


def tls_context_for(url: str) -> ssl.SSLContext | None:
    return LOCAL_TLS if url.startswith("https:") else None


def self_signed(folder: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """A key and a self-signed certificate for 127.0.0.1 (the openssl command), for --tls."""
    key, cert = folder / "bench.key", folder / "bench.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return key, cert


def wait_http(url: str, seconds: float, what: str, post: bytes | None = None) -> None:
    until = time.monotonic() + seconds
    last: Exception | None = None
    while time.monotonic() < until:
        try:
            req = urllib.request.Request(url, data=post, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=2, context=tls_context_for(url)) as r:
                if r.status == 200:
                    return
        except Exception as e:  # noqa: BLE001 - retried until the deadline
            last = e
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready at {url}: {last!r}")


class Procs:
    """Every process of the run through services/launch, pinned with `taskset` when asked."""

    def __init__(self, tmp: pathlib.Path, pin: bool):
        self.pin = pin
        self.launcher = Launcher(MeshSpec((), stop_grace=10), log_dir=tmp)

    def _prefix(self, core: str) -> tuple[str, ...]:
        return ("taskset", "-c", core) if self.pin else ()

    def start(self, role: str, module: str, args: list[str], core: str, cwd: pathlib.Path = ROOT,
              python: str = "") -> Proc:
        return self.launcher.spawn(role, args, 0, None, module=module, cwd=cwd, prefix=self._prefix(core),
                                   python=python)

    def close(self) -> None:
        self.launcher.stop()


def tree_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) so far of a process and every descendant still alive (the
    supervisor's router processes, sglang-router's threads are in its own count)."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            fields = pathlib.Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            tasks = os.listdir(f"/proc/{p}/task")
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (stat fields 14 and 15)
        for t in tasks:
            try:
                stack += [int(c) for c in pathlib.Path(f"/proc/{p}/task/{t}/children").read_text().split()]
            except FileNotFoundError:
                continue
    return total / os.sysconf("SC_CLK_TCK")


def body(max_tokens: int, stream: bool) -> str:
    return json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": stream})


def lua_script(max_tokens: int, stream: bool) -> str:
    head, tail = body(max_tokens, stream).split(PROMPT, 1)
    return LUA % (head, PROMPT + tail)


def run_wrk(wrk: str, url: str, script: pathlib.Path, conns: int, seconds: float, core: str, pin: bool) -> dict:
    cmd = [wrk, "-t", "1", "-c", str(conns), "-d", f"{max(1, round(seconds))}s", "--timeout", "10s", "-s", str(script), url]
    if pin:
        cmd = ["taskset", "-c", core, *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60).stdout
    m = re.search(r"WRKJSON (\{.*\})", out)
    if not m:
        raise RuntimeError(f"wrk printed no summary:\n{out}")
    s = json.loads(m.group(1))
    dur = s["duration_us"] / 1e6
    return {
        "rps": round(s["requests"] / dur, 1), "requests": s["requests"], "errors": s["errors"],
        "p50_ms": round(s["p50_us"] / 1000, 3), "p90_ms": round(s["p90_us"] / 1000, 3),
        "p99_ms": round(s["p99_us"] / 1000, 3), "mean_ms": round(s["mean_us"] / 1000, 3),
    }


def stream_tokens(url: str, n: int) -> int:
    """SSE events with text in one streamed response (a check that each side sends one per token)."""
    req = urllib.request.Request(url, data=body(n, True).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10, context=tls_context_for(url)) as r:
        events = [json.loads(ln[6:]) for ln in r.read().decode().split("\n") if ln.startswith("data: {")]
    return sum(1 for e in events if e["choices"] and e["choices"][0].get("text"))


def serve_fake_grpc(role: str, port: int) -> None:
    """`--serve-fake-grpc ROLE PORT`: one instant fake gRPC worker in this process."""
    import asyncio

    from services.common.tokenizer import load_tokenizer
    from services.fakes.workers import FakeDecode, FakePrefill

    script = load_tokenizer("builtin").encode("Hello, world! ", add_special_tokens=False)

    async def main() -> None:
        # decode: ids that each decode to whole printable text with the built-in tokenizer, so every
        # token is one SSE event, as from the SGLang fake
        w = FakePrefill() if role == "prefill" else FakeDecode(script=script)
        if role == "decode":
            w.coalesce = os.environ.get("PDMESH_FAKE_COALESCE", "1") == "1"
        w.port = port
        await w.start()
        print(f"fake {role} on {w.addr}", flush=True)
        # SIGUSR1: how many chunks and tokens decode has sent so far (the bench's tokens per chunk)
        asyncio.get_running_loop().add_signal_handler(
            signal.SIGUSR1, lambda: print(f"CHUNKS {w.seen.chunks} {w.seen.tokens}", flush=True))
        await asyncio.Event().wait()

    asyncio.run(main())


def chunks_sent(proc: Proc) -> tuple[int, int]:
    """(chunks, tokens) the fake decode has sent so far: it prints them on SIGUSR1."""
    before = proc.log().count("CHUNKS")
    proc.popen.send_signal(signal.SIGUSR1)
    until = time.monotonic() + 5
    while time.monotonic() < until:
        lines = [ln for ln in proc.log().splitlines() if ln.startswith("CHUNKS")]
        if len(lines) > before:
            _, chunks, tokens = lines[-1].split()
            return int(chunks), int(tokens)
        time.sleep(0.05)
    raise RuntimeError("the fake decode did not report its chunks")


def median_of(runs: list[dict]) -> dict:
    keys = ("rps", "p50_ms", "p90_ms", "p99_ms", "mean_ms", "tokens_per_s", "decode_tokens_per_chunk",
            "router_cpu_us_per_request")
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in keys if k in runs[0]} | {
        "errors": sum(r["errors"] for r in runs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=5, help="duration of each wrk run")
    ap.add_argument("--rounds", type=int, default=2, help="runs per case and side, alternating the order")
    ap.add_argument("--stream-tokens", type=int, default=64)
    ap.add_argument("--no-pin", action="store_true", help="do not pin processes to cores with taskset")
    ap.add_argument("--only", choices=("pdmesh", "sglang"), help="measure one side only")
    ap.add_argument("--baseline", type=pathlib.Path, metavar="DIR",
                    help="also measure the router and fake workers of another pdmesh checkout (e.g. main's, "
                         "with its generated code), as the side 'baseline', in the same run")
    ap.add_argument("--grpc-lane", action="store_true",
                    help="also measure pdmesh's router with --worker-lane-client grpc (the lane on a grpc.aio "
                         "stream instead of the router's own HTTP/2), as the side 'pdmesh_grpc_lane'")
    ap.add_argument("--tls", action="store_true",
                    help="also pdmesh's router serving HTTPS itself (side pdmesh_tls; needs the openssl command)")
    ap.add_argument("--quiet", action="store_true",
                    help="also both routers without per-request log lines (sides sglang_quiet, pdmesh_quiet)")
    ap.add_argument("--floor", action="store_true",
                    help="also measure bench/router_floor.py (HTTP + two gRPC calls, nothing else) in the "
                         "non-streamed cases")
    ap.add_argument("--processes", default="1",
                    help="pdmesh router --processes values to measure, comma-separated (the first is side "
                         "'pdmesh', each other N a side 'pdmesh_pN')")
    ap.add_argument("--router-cores", type=int, default=1,
                    help="with pinning: cores 0..K-1 for the router under test, the rest for wrk and the workers")
    ap.add_argument("--sglang-cores", type=int, default=None,
                    help="with pinning: cores 0..K-1 for sglang-router (default: --router-cores), e.g. 1 against "
                         "pdmesh's --router-cores 5 --processes 1,5 to see what parity takes")
    ap.add_argument("--serve-fake-grpc", nargs=2, metavar=("ROLE", "PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_fake_grpc:
        serve_fake_grpc(args.serve_fake_grpc[0], int(args.serve_fake_grpc[1]))
        return 0

    ncpu = os.cpu_count() or 1
    pin = not args.no_pin and ncpu >= 2 and shutil.which("taskset") is not None
    k = max(1, min(args.router_cores, ncpu - 1))
    router_core, other_cores = (f"0-{k - 1}" if k > 1 else "0"), f"{k}-{ncpu - 1}"
    processes = [int(x) for x in args.processes.split(",") if x.strip()]
    ks = max(1, min(args.sglang_cores or k, k))
    sglang_core = f"0-{ks - 1}" if ks > 1 else "0"
    wrk = ensure_wrk()
    sides = ["sglang", "pdmesh"] if args.only is None else [args.only]
    if args.only != "sglang":
        sides += [f"pdmesh_p{n}" for n in processes[1:]]
    if args.grpc_lane:
        sides.append("pdmesh_grpc_lane")
    if args.tls:
        sides.append("pdmesh_tls")
    if args.quiet:
        sides += [side + "_quiet" for side in ("sglang", "pdmesh") if side in sides]
    if args.baseline:
        sides.append("baseline")
    if args.floor:
        sides += ["floor", "floor_lane"]
    sgl_py = ensure_sglang() if "sglang" in sides else None
    load_before = [round(x, 2) for x in os.getloadavg()]

    with tempfile.TemporaryDirectory(prefix="router-compare-") as tmpdir:
        tmp = pathlib.Path(tmpdir)
        procs = Procs(tmp, pin)
        urls: dict[str, str] = {}
        routers: dict[str, int] = {}  # side → the router's pid, for its CPU time per request
        fake_decode: Proc | None = None  # pdmesh's, asked for its chunk counts
        try:
            for side, extra in (("sglang", []), ("sglang_quiet", ["--log-level", "warn"])):
                if side not in sides:
                    continue
                sp, sd, sr = free_port(), free_port(), free_port()
                for role, port in (("prefill", sp), ("decode", sd)):
                    procs.start("fakes", "services.fakes.sglang_worker", ["--port", str(port), "--role", role],
                                other_cores)
                router = procs.start("sglang-router", "sglang_router.launch_router", [
                    "--pd-disaggregation", "--prefill", f"http://127.0.0.1:{sp}", "none",
                    "--decode", f"http://127.0.0.1:{sd}", "--policy", "round_robin",
                    "--host", "127.0.0.1", "--port", str(sr), "--prometheus-port", str(free_port()), *extra],
                    sglang_core, python=str(sgl_py))
                urls[side] = f"http://127.0.0.1:{sr}"
                routers[side] = router.popen.pid

            def grpc_side(side: str, router_module: str, router_args: list[str], root: pathlib.Path = ROOT,
                          scheme: str = "http") -> Proc:
                """Two instant fake gRPC workers (one process each, this bench's --serve-fake-grpc in
                `root`'s tree) and `router_module` in front of them; the fake decode's process."""
                p, d, r = free_port(), free_port(), free_port()
                fakes = [procs.start("fakes", "bench.router_compare", ["--serve-fake-grpc", role, str(port)],
                                     other_cores, root) for role, port in (("prefill", p), ("decode", d))]
                router = procs.start("router", router_module, [*router_args, "--port", str(r), "--prefill",
                                                               f"127.0.0.1:{p}", "--decode", f"127.0.0.1:{d}"],
                                     router_core, root)
                urls[side] = f"{scheme}://127.0.0.1:{r}"
                routers[side] = router.popen.pid
                return fakes[1]

            pdmesh_router = ["--policy", "round_robin"]
            if "pdmesh" in sides:
                fake_decode = grpc_side("pdmesh", "services.router", [*pdmesh_router, "--processes", str(processes[0])])
            for n in processes[1:]:
                if f"pdmesh_p{n}" in sides:
                    grpc_side(f"pdmesh_p{n}", "services.router", [*pdmesh_router, "--processes", str(n)])
            if "pdmesh_quiet" in sides:
                grpc_side("pdmesh_quiet", "services.router", [*pdmesh_router, "--no-log-requests"])
            if "pdmesh_grpc_lane" in sides:
                grpc_side("pdmesh_grpc_lane", "services.router", [*pdmesh_router, "--worker-lane-client", "grpc"])
            if "pdmesh_tls" in sides:
                key, cert = self_signed(tmp)
                grpc_side("pdmesh_tls", "services.router", [*pdmesh_router, "--ssl-keyfile", str(key),
                                                            "--ssl-certfile", str(cert)], scheme="https")
            if "baseline" in sides:  # the same processes, from the other checkout's files
                grpc_side("baseline", "services.router", pdmesh_router, args.baseline.resolve())
            for floor in ("floor", "floor_lane"):
                if floor in sides:
                    grpc_side(floor, "bench.router_floor", ["--lane"] if floor == "floor_lane" else [])
            for side, url in urls.items():
                wait_http(url + "/v1/completions", 60, f"{side} router", post=body(1, False).encode())
                if side.startswith("floor"):
                    continue
                got = stream_tokens(url + "/v1/completions", args.stream_tokens)
                if got != args.stream_tokens:
                    raise RuntimeError(f"{side}: a streamed response had {got} tokens, not {args.stream_tokens}")

            cases = [("nonstream_c1", 1, 1, False), ("nonstream_c32", 32, 1, False),
                     (f"stream{args.stream_tokens}_c32", 32, args.stream_tokens, True)]
            results: dict = {}
            for name, conns, max_tokens, stream in cases:
                script = tmp / f"{name}.lua"
                script.write_text(lua_script(max_tokens, stream))
                measured = [side for side in urls if not (stream and side.startswith("floor"))]  # floors: JSON only
                runs: dict[str, list[dict]] = {s: [] for s in measured}
                for side in measured:  # warm-up: connections and lazily built paths
                    run_wrk(wrk, urls[side] + "/v1/completions", script, conns, 1, other_cores, pin)
                for r in range(args.rounds):
                    order = measured if r % 2 == 0 else list(reversed(measured))
                    for side in order:
                        sent = chunks_sent(fake_decode) if side == "pdmesh" else None
                        cpu0 = tree_cpu_seconds(routers[side])
                        res = run_wrk(wrk, urls[side] + "/v1/completions", script, conns, args.seconds,
                                      other_cores, pin)
                        if res["requests"]:
                            used = tree_cpu_seconds(routers[side]) - cpu0
                            res["router_cpu_us_per_request"] = round(used * 1e6 / res["requests"], 1)
                        if stream:
                            res["tokens_per_s"] = round(res["rps"] * max_tokens, 1)
                        if sent is not None:
                            after = chunks_sent(fake_decode)
                            chunks, tokens = after[0] - sent[0], after[1] - sent[1]
                            res["decode_tokens_per_chunk"] = round(tokens / chunks, 2) if chunks else None
                        runs[side].append(res)
                        print(f"[compare] {name} {side}: {res}", file=sys.stderr, flush=True)
                case = {"concurrency": conns, "max_tokens": max_tokens, "stream": stream}
                for side in measured:
                    case[side] = {"median": median_of(runs[side]), "runs": runs[side]}
                pairs = [("pdmesh", "sglang"), ("baseline", "sglang"), ("pdmesh_grpc_lane", "sglang"),
                         ("pdmesh_tls", "sglang"), ("pdmesh_tls", "pdmesh"),
                         ("pdmesh_quiet", "sglang_quiet"), ("pdmesh_quiet", "pdmesh"), ("sglang_quiet", "sglang"),
                         ("pdmesh", "pdmesh_grpc_lane"), ("floor", "sglang"),
                         ("floor_lane", "sglang"), ("pdmesh", "baseline"), ("pdmesh", "floor"),
                         ("pdmesh", "floor_lane")]
                pairs += [(f"pdmesh_p{n}", other) for n in processes[1:] for other in ("sglang", "pdmesh")]
                for a, b in pairs:
                    if a in case and b in case:
                        p, s = case[a]["median"], case[b]["median"]
                        case[f"ratio_{a}_over_{b}"] = {
                            "rps": round(p["rps"] / s["rps"], 3) if s["rps"] else None,
                            "p50_ms": round(p["p50_ms"] / s["p50_ms"], 3) if s["p50_ms"] else None,
                            # > 1: pdmesh's router spends that many times the CPU on a request, so it needs
                            # that many cores (--processes) for the other's requests/s on one
                            "router_cpu_per_request": round(p["router_cpu_us_per_request"]
                                                            / s["router_cpu_us_per_request"], 3)
                            if p.get("router_cpu_us_per_request") and s.get("router_cpu_us_per_request") else None,
                        }
                results[name] = case
        finally:
            procs.close()

    out = {
        "cases": results,
        "setup": {
            "sglang": f"{SGLANG_ROUTER} --pd-disaggregation --policy round_robin, instant fake SGLang HTTP "
                      "workers (services/fakes/sglang_worker.py), one process each",
            "pdmesh": f"python -m services.router --policy round_robin --processes {processes[0]} (pdmesh_pN: "
                      "--processes N), instant fake gRPC workers "
                      "(services/fakes/workers.py), one process each; the fake decode coalesces tokens as the "
                      f"real one does: {os.environ.get('PDMESH_FAKE_COALESCE', '1') == '1'}",
            "baseline": f"the router and fake workers of {args.baseline}" if args.baseline else None,
            "pdmesh_grpc_lane": "pdmesh's router with --worker-lane-client grpc" if args.grpc_lane else None,
            "quiet": "sglang_quiet: sglang-router with --log-level warn; pdmesh_quiet: pdmesh's router with "
                     "--no-log-requests (neither writes a line per request)" if args.quiet else None,
            "pdmesh_tls": "pdmesh's router serving HTTPS itself (--ssl-keyfile/--ssl-certfile, a self-signed "
                          "certificate; wrk's connections kept)" if args.tls else None,
            "floor": "bench/router_floor.py: uvicorn + grpc.aio, Prefill + Decode per request and nothing else, "
                     "one gRPC call each, in front of its own instant fake gRPC workers (non-streamed cases only)",
            "floor_lane": "bench/router_floor.py --lane: the same with both calls over the lane (one stream per "
                          "worker, as the router sends them)",
            "load_generator": "wrk -t 1, Lua POST body, its own process",
            "pinning": (f"taskset: router under test on cores {router_core} (sglang-router: {sglang_core}); wrk "
                        f"and fake workers on cores {other_cores}") if pin else "none",
            "cpus": ncpu, "seconds": args.seconds, "rounds": args.rounds, "prompt_chars": len(PROMPT),
            "load_avg_before": load_before, "load_avg_after": [round(x, 2) for x in os.getloadavg()],
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        },
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
