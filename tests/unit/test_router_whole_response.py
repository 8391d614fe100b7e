"""A non-streamed answer goes out in one write (services/router/connection_guard.py `write_whole`)
with the bytes uvicorn's two ASGI sends would write: compared on the wire, byte for byte, with the
fast path turned off; keep-alive, pipelined requests, HTTP/1.0 and a refusal that closes the
connection behave as uvicorn's own."""

from __future__ import annotations

import json
import re
import socket

import pytest

from services.router import connection_guard, fastpath
from tests.unit.test_router_app import Cluster, cluster_factory, completion  # noqa: F401 - cluster_factory is a fixture

pytestmark = pytest.mark.timeout(60)


def request(body: dict, version: str = "1.1", extra: str = "") -> bytes:
    data = json.dumps(body).encode()
    return (f"POST /v1/completions HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"X-Request-Id: fixed-id\r\nContent-Length: {len(data)}\r\n{extra}\r\n").encode() + data


def read_responses(sock: socket.socket, count: int) -> tuple[list[bytes], bool]:
    """`count` whole responses (by their content-length), and whether the server then closed."""
    out = read_whole_responses(sock, count)
    sock.settimeout(2)
    try:
        closed = sock.recv(1) == b""
    except TimeoutError:
        closed = False
    return out, closed


def read_whole_responses(sock: socket.socket, count: int) -> list[bytes]:
    """`count` whole responses (head and body, by their content-length) off one connection."""
    buf, out = b"", []
    sock.settimeout(10)
    while len(out) < count:
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            assert chunk, f"closed after {len(out)} responses"
            buf += chunk
        head, rest = buf.split(b"\r\n\r\n", 1)
        length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
        while len(rest) < length:
            chunk = sock.recv(65536)
            assert chunk
            rest += chunk
        out.append(head + b"\r\n\r\n" + rest[:length])
        buf = rest[length:]
    return out


def exchange(c: Cluster, data: bytes, count: int = 1) -> tuple[list[bytes], bool]:
    with socket.create_connection(("127.0.0.1", c.port)) as sock:
        sock.sendall(data)
        return read_responses(sock, count)


def normal(response: bytes) -> bytes:
    """Without what differs from one response to the next (the date, the created time)."""
    response = re.sub(rb"date: [^\r]*\r\n", b"", response)
    return re.sub(rb'"created":\d+', b'"created":0', response)


def test_one_write_sends_what_the_two_asgi_sends_would(cluster_factory, monkeypatch):  # noqa: F811
    cluster = cluster_factory()
    writes = []
    real = connection_guard.write_whole

    def counting(*args):
        writes.append(real(*args))
        return writes[-1]

    monkeypatch.setattr(fastpath, "write_whole", counting)
    cases = [request(completion()), request({"model": "nope", "prompt": "hi"}), request(completion(max_tokens=-1))]
    fast = [exchange(cluster, data) for data in cases]
    assert writes == [True, True, True]
    monkeypatch.setattr(fastpath, "write_whole", lambda *args: False)
    slow = [exchange(cluster, data) for data in cases]
    for (f, f_closed), (s, s_closed) in zip(fast, slow, strict=True):
        assert normal(f[0]) == normal(s[0]) and f_closed == s_closed is False
    assert fast[0][0][0].startswith(b"HTTP/1.1 200 OK\r\n") and fast[1][0][0].startswith(b"HTTP/1.1 404")


def test_pipelined_requests_are_answered_in_order_on_one_connection(cluster_factory):  # noqa: F811
    cluster = cluster_factory()
    data = b"".join(request(completion(prompt=p)) for p in ("a", "bb", "ccc"))
    responses, closed = exchange(cluster, data, 3)
    assert not closed
    tokens = [json.loads(r.split(b"\r\n\r\n", 1)[1])["usage"]["prompt_tokens"] for r in responses]
    assert tokens == [tokens[0], tokens[0] + 1, tokens[0] + 2]  # one byte token more each, in order


def test_http_1_0_gets_connection_close_and_the_connection_ends(cluster_factory):  # noqa: F811
    cluster = cluster_factory()
    responses, closed = exchange(cluster, request(completion(), version="1.0"))
    assert b"\r\nconnection: close\r\n" in responses[0].lower() and closed


def test_a_refusal_before_the_body_is_in_closes_the_connection(cluster_factory):  # noqa: F811
    cluster = cluster_factory()
    data = request(completion(), extra="Authorization: Bearer x\r\n").replace(
        b"Content-Length: ", b"Content-Length: 9999999999")  # over the body limit: 413 before reading it
    responses, closed = exchange(cluster, data)
    assert responses[0].startswith(b"HTTP/1.1 413") and closed
