"""A request body the router's server already holds whole is taken at once, with no body timer
(connection_guard.take_whole_body); a body still arriving is read through `receive()` under
--body-timeout as before. Either way the limits and the framing of the next request hold."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from services.router.request_body import BodyReader
from tests.unit.test_router_app import cluster, cluster_factory, completion, wait_for  # noqa: F401 - fixtures
from tests.unit.test_router_whole_response import read_whole_responses

pytestmark = pytest.mark.timeout(60)


def head(length: int | None, extra: bytes = b"") -> bytes:
    framing = b"Transfer-Encoding: chunked\r\n" if length is None else b"Content-Length: %d\r\n" % length
    return b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + framing + extra + b"\r\n"


def encoded(body: dict) -> bytes:
    return json.dumps(body).encode()


def read_responses(s: socket.socket, count: int) -> list[tuple[bytes, dict]]:
    """`count` whole responses off one keep-alive connection: (status line, JSON body) each."""
    out = []
    for response in read_whole_responses(s, count):
        head, body = response.split(b"\r\n\r\n", 1)
        out.append((head.split(b"\r\n", 1)[0], json.loads(body)))
    return out


@pytest.fixture
def timed_reads(monkeypatch) -> list[int]:
    """How many bodies went through the timed read (`BodyReader._read_in_time`)."""
    calls = [0]
    original = BodyReader._read_in_time

    async def counted(self, request):
        calls[0] += 1
        return await original(self, request)

    monkeypatch.setattr(BodyReader, "_read_in_time", counted)
    return calls


def test_a_body_sent_with_its_headers_is_taken_without_a_timer(cluster, timed_reads):  # noqa: F811
    data = encoded(completion())
    with socket.create_connection(("127.0.0.1", cluster.port)) as s:
        s.sendall(head(len(data)) + data)
        [(status, body)] = read_responses(s, 1)
    assert status == b"HTTP/1.1 200 OK" and body["usage"]["completion_tokens"] == 5
    assert timed_reads == [0]
    cluster.all_rpcs_ended()


def test_a_body_still_arriving_is_read_under_the_body_timeout(cluster, timed_reads):  # noqa: F811
    data = encoded(completion())
    with socket.create_connection(("127.0.0.1", cluster.port)) as s:
        s.sendall(head(len(data)) + data[:10])
        wait_for(lambda: timed_reads == [1], what="the router to wait for the rest of the body")
        s.sendall(data[10:])
        [(status, body)] = read_responses(s, 1)
    assert status == b"HTTP/1.1 200 OK" and body["usage"]["completion_tokens"] == 5
    cluster.all_rpcs_ended()


def test_a_whole_chunked_body_over_the_limit_is_refused(cluster_factory):  # noqa: F811
    c = cluster_factory(max_body_bytes=1000)
    data = encoded(completion(prompt="x" * 2000))
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data)
    with socket.create_connection(("127.0.0.1", c.port)) as s:
        s.sendall(head(None) + chunked)
        [(status, body)] = read_responses(s, 1)
    assert status.startswith(b"HTTP/1.1 413") and body["error"]["code"] == "request_too_large"
    assert c.total_rooms() == 0
    c.all_rpcs_ended()  # no admission slot or lease left behind


def test_pipelined_requests_each_get_their_own_body(cluster):  # noqa: F811
    prompts = ["a", "a longer prompt than the first", "mid length"]
    bodies = [encoded(completion(prompt=p, max_tokens=2)) for p in prompts]
    with socket.create_connection(("127.0.0.1", cluster.port)) as s:
        s.sendall(b"".join(head(len(b)) + b for b in bodies))
        replies = read_responses(s, 3)
    alone = [httpx.post(cluster.url + "/v1/completions", content=b, timeout=10).json() for b in bodies]
    assert [r[1]["usage"]["prompt_tokens"] for r in replies] == [a["usage"]["prompt_tokens"] for a in alone]
    assert len({a["usage"]["prompt_tokens"] for a in alone}) == 3
    cluster.all_rpcs_ended()


def test_a_whole_body_sent_with_expect_100_continue_needs_no_interim_response(cluster):  # noqa: F811
    # RFC 9110 10.1.1: a server may omit the 100 once it has received some or all of the content
    data = encoded(completion())
    with socket.create_connection(("127.0.0.1", cluster.port)) as s:
        s.sendall(head(len(data), b"Expect: 100-continue\r\n") + data)
        [(status, body)] = read_responses(s, 1)
    assert status == b"HTTP/1.1 200 OK" and body["usage"]["completion_tokens"] == 5
    cluster.all_rpcs_ended()


def test_a_client_waiting_for_100_continue_gets_it_and_then_sends_its_body(cluster):  # noqa: F811
    data = encoded(completion())
    with socket.create_connection(("127.0.0.1", cluster.port)) as s:
        s.settimeout(10)
        s.sendall(head(len(data), b"Expect: 100-continue\r\n"))
        interim = b""
        while b"\r\n\r\n" not in interim:
            interim += s.recv(1)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(data)
        [(status, body)] = read_responses(s, 1)
    assert status == b"HTTP/1.1 200 OK" and body["usage"]["completion_tokens"] == 5
    cluster.all_rpcs_ended()
