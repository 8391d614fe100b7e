"""The router's front door against hostile clients, on real prefill + decode + router processes.

Raw sockets play the clients a well-behaved HTTP library never would:
- 300 connections that send their headers and never the body they declare, 20 that stop halfway
  through their headers, and one that sends its body a byte at a time: normal requests still get
  200 at once, each hostile one gets 408 and its connection closed within its bound, and none of
  them ever held an admission slot;
- idle connections past --max-connections: the longest-idle one is closed, a new client served;
- a streaming client that stops reading (a small receive buffer, nothing read): cut off after
  --client-write-timeout, or sooner when the router holds --max-buffered-tokens for it; its room
  is aborted on decode and its slots freed;
- admission counts choices: n above the whole budget is a 400, n that fills it makes the next
  request a 429;
- a JSON body nested 1,000 deep is a 400 with an OpenAI error body;
- headers past --max-header-bytes (many of them, one huge value, a huge URL, a chunked body's
  endless trailer) get 431 with an OpenAI error body as soon as the bound is passed, however much
  more the client sends; headers under it, pipelined requests with large bodies on one
  connection, and a body in 16-byte chunks with trailers, are served;
- n > 1 streamed, the client leaving as soon as one choice ends on its stop string: every other
  choice's room is aborted on decode, none decodes on for nobody.
After each: admission slots all free, queue gauges 0, every KV pool whole (Mesh.assert_invariants).
One prefill and one decode for the module, and two routers in front of them.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.launch.proc import run_service
from tests.integration.mesh import Mesh, in_background, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

MODEL = "pdmesh-tiny"
BUDGET = 8  # --max-concurrent-requests of the `front` router, in choices
HEADER_TIMEOUT, BODY_TIMEOUT, WRITE_TIMEOUT = 6.0, 8.0, 2.0
FRONT_FLAGS = (
    "--max-concurrent-requests", str(BUDGET), "--header-timeout", str(HEADER_TIMEOUT),
    "--body-timeout", str(BODY_TIMEOUT), "--client-write-timeout", str(WRITE_TIMEOUT),
    "--max-connections", "400", "--request-timeout", "60",
)
# a router that buffers little for a stream and waits long on a blocked write: only the buffer cuts
BUFFER_FLAGS = ("--max-buffered-tokens", "8", "--client-write-timeout", "600", "--request-timeout", "60")
NORMAL = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
# A stream that fills the socket buffers (on loopback the kernel takes ~3 MB before the router's
# writes block) within seconds: n choices of big events (chat: 20 alternatives per token, each
# with its bytes).
STALLED_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a long story"}],
                "max_tokens": 4000, "ignore_eos": True, "logprobs": True, "top_logprobs": 20, "n": BUDGET,
                "stream": True}
LONG_STREAM = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": 2000, "ignore_eos": True,
               "n": BUDGET, "stream": True}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    m = Mesh(tmp_path_factory.mktemp("front-door"))
    try:
        (p,), (d,) = m.start_workers(1, 1)
        front = m.start_router([p], [d], *FRONT_FLAGS)
        buffer = m.start_router([p], [d], *BUFFER_FLAGS)
        yield m, d, front, buffer
    finally:
        m.close()


def all_free(m: Mesh, *routers) -> None:
    """Admission slots all free on every router, queue gauges 0 and KV pools whole on every worker."""
    m.assert_invariants(timeout=20)
    for r in routers:
        wait_for(lambda r=r: r.metrics().get("pdmesh:router_num_running_reqs", 1) == 0, 20,
                 f"router :{r.http_port} to hold no admission slot")


def cutoffs(r, reason: str) -> float:
    """The router's router_client_cutoffs_total for one reason."""
    text = httpx.get(r.http_url + "/metrics", timeout=5).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "pdmesh:router_client_cutoffs_total" and s.labels.get("reason") == reason)


def normal_request(r) -> float:
    t = time.monotonic()
    resp = httpx.post(r.http_url + "/v1/completions", json=NORMAL, timeout=30)
    assert resp.status_code == 200, resp.text
    return time.monotonic() - t


def connect(port: int, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: it sets the window
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    return s


def head(port: int, length: int, path: str = "/v1/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def answer(s: socket.socket, until: float) -> bytes:
    """Everything the router sends on `s` until it closes the connection (bounded by `until`)."""
    got = b""
    while time.monotonic() < until:
        s.settimeout(max(0.05, until - time.monotonic()))
        try:
            part = s.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            return got
        if not part:
            return got
        got += part
    raise AssertionError(f"the router kept the connection open past the bound; sent {got[:200]!r}")


# --- slow and silent senders ------------------------------------------------------------------------


def test_stalled_headers_and_bodies_hold_no_slot_and_are_closed_in_time(mesh):
    m, d, r, _ = mesh
    port = r.http_port
    before = {k: cutoffs(r, k) for k in ("header_timeout", "body_timeout")}
    body = json.dumps(NORMAL).encode()
    t0 = time.monotonic()
    no_body = []
    for _ in range(300):
        s = connect(port)
        s.sendall(head(port, len(body)))  # headers complete, the body never comes
        no_body.append(s)
    half_headers = []
    for _ in range(20):
        s = connect(port)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
        half_headers.append(s)

    trickle = connect(port)
    trickle.sendall(head(port, len(body)))
    stop = threading.Event()

    def send_slowly() -> None:  # one byte every half second: it would take a minute
        for byte in body:
            if stop.wait(0.5):
                return
            try:
                trickle.sendall(bytes([byte]))
            except OSError:
                return  # the router closed it

    sender = threading.Thread(target=send_slowly, daemon=True)
    sender.start()
    try:
        # every hostile connection is in; well-behaved clients are still served, at once
        latencies = [normal_request(r) for _ in range(4)]
        assert time.monotonic() - t0 < BODY_TIMEOUT, "the normal requests ran after the hostile ones ended"
        assert max(latencies) < 3.0, latencies
        until = t0 + BODY_TIMEOUT + 15
        for s in [*no_body, trickle]:
            assert answer(s, until).startswith(b"HTTP/1.1 408 ")
        for s in half_headers:
            assert answer(s, until).startswith(b"HTTP/1.1 408 ")
    finally:
        stop.set()
        for s in [*no_body, *half_headers, trickle]:
            s.close()
        sender.join(5)
    assert cutoffs(r, "body_timeout") - before["body_timeout"] >= 301
    assert cutoffs(r, "header_timeout") - before["header_timeout"] >= 20
    normal_request(r)
    all_free(m, r)


def test_idle_connections_are_bounded(mesh):
    m, d, r, _ = mesh
    before = cutoffs(r, "connection_limit")
    idle = [connect(r.http_port) for _ in range(400)]  # the limit: nothing sent on any of them
    try:
        normal_request(r)  # one more connection: the longest-idle one makes room
        assert answer(idle[0], time.monotonic() + 10) == b""
        assert cutoffs(r, "connection_limit") - before >= 1
    finally:
        for s in idle:
            s.close()
    all_free(m, r)


# --- a client that stops reading -------------------------------------------------------------------


def stop_reading(r) -> socket.socket:
    """A streaming request on a socket with a small receive buffer, read up to its first event."""
    body = json.dumps(STALLED_CHAT).encode()
    s = connect(r.http_port, rcvbuf=4096)
    s.sendall(head(r.http_port, len(body), "/v1/chat/completions") + body)
    got = b""
    while b"data: " not in got:
        part = s.recv(1024)
        assert part, got
        got += part
    assert got.startswith(b"HTTP/1.1 200 "), got[:300]
    return s  # from here nothing is read


@pytest.mark.parametrize("which, reason", [("front", "write_timeout"), ("buffer", "buffer")])
def test_a_client_that_stops_reading_is_cut_off(mesh, which, reason):
    m, d, front, buffer = mesh
    r = front if which == "front" else buffer
    before, aborted = cutoffs(r, reason), d.metrics().get("pdmesh:num_aborted_requests_total", 0.0)
    s = stop_reading(r)
    try:
        wait_for(lambda: cutoffs(r, reason) > before, 30, f"the router to cut the stalled reader off ({reason})")
        # its room is aborted on decode (not decoded to max_tokens for nobody) and its slot freed
        wait_for(lambda: d.metrics().get("pdmesh:num_aborted_requests_total", 0.0) > aborted, 10,
                 "decode to abort the stalled reader's room")
        all_free(m, r)
        assert d.metrics().get("pdmesh:num_running_reqs", 1) == 0
        normal_request(r)
    finally:
        s.close()


# --- admission counts choices -----------------------------------------------------------------------


def test_admission_counts_choices(mesh):
    m, d, r, _ = mesh
    resp = httpx.post(r.http_url + "/v1/completions", json={**NORMAL, "n": BUDGET + 1}, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "n"

    body = LONG_STREAM

    def hold() -> int:  # a stream of BUDGET choices, read until told to stop
        with httpx.Client(timeout=60) as client, client.stream("POST", r.http_url + "/v1/completions",
                                                                json=body) as resp:
            assert resp.status_code == 200
            for _ in resp.iter_lines():
                if done.is_set():
                    break
        return resp.status_code

    done = threading.Event()
    thread, box = in_background(hold)
    try:
        wait_for(lambda: r.metrics().get("pdmesh:router_num_running_reqs", 0) == BUDGET, 20, "the n-choice stream admitted")
        t = time.monotonic()
        refused = httpx.post(r.http_url + "/v1/completions", json=NORMAL, timeout=30)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert time.monotonic() - t < 2.0
    finally:
        done.set()
        thread.join(30)
    assert box.get("out") == 200
    all_free(m, r)
    normal_request(r)


# --- bodies no parser should choke on ----------------------------------------------------------------


HEADER_LIMIT = 64 * 1024  # --max-header-bytes' default


def chunked_head(port: int) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Transfer-Encoding: chunked\r\n\r\n").encode()


def send_until_answered(port: int, start: bytes, more) -> tuple[bytes, int]:
    """Send `start`, then the chunks of `more` until the router answers (or stops taking them);
    (what the router sent until it closed, bytes sent). Each chunk gives the router up to half a
    second to answer: a router that buffered everything would let the whole of `more` through."""
    s = connect(port)
    sent = 0
    try:
        s.sendall(start)
        for chunk in more:
            s.sendall(chunk)
            sent += len(chunk)
            if select.select([s], [], [], 0.5)[0]:
                break
        return answer(s, time.monotonic() + 15), sent
    except (BrokenPipeError, ConnectionResetError):
        return answer(s, time.monotonic() + 15), sent
    finally:
        s.close()


def test_oversized_headers_get_431_and_the_connection_closes(mesh):
    m, d, r, _ = mesh
    port = r.http_port
    before = cutoffs(r, "header_size")
    line = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode()
    cases = {
        "many headers": (line, (b"X-Pad-%d: %s\r\n" % (i, b"a" * 50_000) for i in range(60))),
        "one huge value": (line + b"X-Pad: ", (b"a" * 50_000 for _ in range(60))),
        "huge url": (b"GET /health?q=", (b"a" * 50_000 for _ in range(60))),
        # a chunked body's trailers are headers too, and buffered alike
        "endless trailer": (chunked_head(port) + b"5\r\nhello\r\n0\r\nX-Trailer: ",
                            (b"a" * 50_000 for _ in range(60))),
    }
    for name, (start, more) in cases.items():
        got, sent = send_until_answered(port, start, more)
        assert got.startswith(b"HTTP/1.1 431 "), (name, got[:200])
        error = json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "request_header_fields_too_large" and str(HEADER_LIMIT) in error["message"], error
        assert sent < 3_000_000, f"{name}: the router took {sent} bytes before answering"
    assert cutoffs(r, "header_size") - before == len(cases)
    # under the bound: served
    s = connect(port)
    s.sendall(line + b"X-Pad: " + b"a" * (HEADER_LIMIT - 1024) + b"\r\n\r\n")
    assert s.recv(64).startswith(b"HTTP/1.1 200 ")
    s.close()
    # large bodies, pipelined on one keep-alive connection: body bytes never count as headers
    body = json.dumps({**NORMAL, "user": "u" * 300_000}).encode()
    s = connect(port)
    s.sendall(head(port, len(body)) + body + head(port, len(body)) + body + head(port, len(body)) + body)
    got = b""
    deadline = time.monotonic() + 30
    while got.count(b"HTTP/1.1 ") < 3 and time.monotonic() < deadline:
        got += s.recv(65536)
    s.close()
    assert got.count(b"HTTP/1.1 200 ") == 3, got[:500]
    # chunked in 16-byte chunks, with trailers: the framing (~7 bytes a chunk) is no header
    data = json.dumps({**NORMAL, "user": "u" * 200_000}).encode()
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(data[i:i + 16]), data[i:i + 16]) for i in range(0, len(data), 16))
    s = connect(port)
    s.sendall(chunked_head(port) + chunks + b"0\r\nX-Trailer: 1\r\n\r\n")
    assert s.recv(64).startswith(b"HTTP/1.1 200 ")
    s.close()
    normal_request(r)
    all_free(m, r)


def test_headers_over_the_bound_in_the_read_that_ends_them_get_431(mesh):
    """The bound holds however the bytes arrive: headers sent whole, in the one write (and so
    mostly the one read) that also ends them, are refused as ones that trickle in are."""
    m, d, r, _ = mesh
    port = r.http_port
    before = cutoffs(r, "header_size")
    over = HEADER_LIMIT + 8 * 1024
    line = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode()
    cases = {
        "one huge value": line + b"X-Pad: " + b"a" * over + b"\r\n\r\n",
        "many headers": line + b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000) for i in range(over // 1000)) + b"\r\n",
        "huge url": b"GET /health?q=" + b"a" * over + f" HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode(),
        "huge trailer": chunked_head(port) + b"2\r\n{}\r\n0\r\nX-Trailer: " + b"a" * over + b"\r\n\r\n",
    }
    for name, data in cases.items():
        s = connect(port)
        try:
            s.sendall(data)
            got = answer(s, time.monotonic() + 15)
        finally:
            s.close()
        assert got.startswith(b"HTTP/1.1 431 "), (name, got[:200])
        error = json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "request_header_fields_too_large" and str(HEADER_LIMIT) in error["message"], error
    assert cutoffs(r, "header_size") - before == len(cases)
    # just under the bound, whole in one write: served
    s = connect(port)
    s.sendall(line + b"X-Pad: " + b"a" * (HEADER_LIMIT - 1024) + b"\r\n\r\n")
    assert s.recv(64).startswith(b"HTTP/1.1 200 ")
    s.close()
    normal_request(r)
    all_free(m, r)


def test_deeply_nested_json_is_a_400(mesh):
    m, d, r, _ = mesh
    deep = "[" * 1000 + "]" * 1000
    bodies = [
        deep,
        json.dumps(NORMAL)[:-1] + ', "prompt": ' + deep + "}",
        '{"model": "pdmesh-tiny", "messages": [{"role": "user", "content": ' + deep + "}]}",
        '{"a": ' * 100_000 + "1" + "}" * 100_000,
    ]
    for path in ("/v1/completions", "/v1/chat/completions"):
        for raw in bodies:
            resp = httpx.post(r.http_url + path, content=raw, headers={"content-type": "application/json"},
                              timeout=30)
            assert resp.status_code == 400, (path, raw[:60], resp.status_code, resp.text[:300])
            error = resp.json()["error"]
            assert error["type"] == "invalid_request_error" and error["message"]
    normal_request(r)
    all_free(m, r)


# --- n > 1: a client that leaves as a choice ends --------------------------------------------------


def test_a_disconnect_as_one_choice_ends_aborts_every_choice(mesh):
    m, d, r, _ = mesh
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3000, "n": 4, "seed": 7,
            "stop": ["e"], "ignore_eos": True, "stream": True}
    for _ in range(3):
        aborted = d.metrics().get("pdmesh:num_aborted_requests_total", 0.0)
        with httpx.Client(timeout=30) as client, client.stream("POST", r.http_url + "/v1/completions",
                                                                json=body) as resp:
            assert resp.status_code == 200
            ended = set()
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    if choice["finish_reason"]:
                        ended.add(choice["index"])
                if ended:
                    break  # gone the moment the first choice ends
        if len(ended) == 4:
            continue  # every choice ended in the same write: nothing left to abort, try again
        # the choices still running when the client left are aborted, not decoded to max_tokens
        left = 4 - len(ended)
        wait_for(lambda a=aborted, k=left: d.metrics().get("pdmesh:num_aborted_requests_total", 0.0) - a >= k,
                 15, "decode to abort the choices the client left")
        all_free(m, r)
        return
    pytest.skip("every choice ended on the same write three times")


@pytest.mark.parametrize("flag", ["--header-timeout", "--max-connections", "--max-header-bytes"])
def test_a_bound_that_is_not_positive_is_refused_at_start(flag):
    out = run_service("router", ["--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2", "--log-format", "json",
                                 flag, "0"])
    assert out.returncode == 2 and flag in out.stderr, out.stderr[-2000:]
