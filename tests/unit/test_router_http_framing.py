"""HTTP framing at the router's own server (services/router/connection_guard.py): a chunked
body's trailers are never taken as its headers; framing or trailers without end are refused with
431 once they pass --max-header-bytes beyond the body, while small chunks are served; bytes that
are not HTTP/1.1 get a 400 with an OpenAI error body, and the connection closes."""

from __future__ import annotations

import json
import socket

import pytest

from tests.unit.test_router_app import cluster_factory, completion  # noqa: F401 - cluster_factory is a fixture
from tests.unit.test_router_whole_response import read_responses

pytestmark = pytest.mark.timeout(60)

HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n")


def chunked(data: bytes, size: int) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(data[i:i + size]), data[i:i + size]) for i in range(0, len(data), size))


def test_trailers_do_not_become_headers(cluster_factory):  # noqa: F811
    cluster = cluster_factory()
    body = chunked(json.dumps(completion()).encode(), 16)
    with socket.create_connection(("127.0.0.1", cluster.port)) as sock:
        # one write: the whole request is parsed before the app reads its headers
        sock.sendall(HEAD + body + b"0\r\nX-Request-Id: from-the-trailer\r\n\r\n")
        (response,), closed = read_responses(sock, 1)
    assert response.startswith(b"HTTP/1.1 200 ") and not closed
    assert b"from-the-trailer" not in response


def test_framing_without_end_gets_431_and_the_connection_closes(cluster_factory):  # noqa: F811
    cluster = cluster_factory()
    limit = 64 * 1024
    with socket.create_connection(("127.0.0.1", cluster.port)) as sock:
        sock.settimeout(10)
        sock.sendall(HEAD + b"2\r\n{}\r\n")
        sent, got = 0, b""
        # chunk extensions are framing, not body: a client may not send them without end
        while sent < 4 * limit:
            try:
                sock.sendall(b"1;" + b"e" * 1000 + b"\r\n \r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += 1006
        while True:
            part = sock.recv(65536)
            if not part:
                break
            got += part
    assert got.startswith(b"HTTP/1.1 431 "), got[:200]
    error = json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "request_header_fields_too_large" and str(limit) in error["message"]


NOT_HTTP = {
    "h2-preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # HTTP/2 with prior knowledge
    "binary": b"\x00\x01\x02hello\r\n\r\n",
    "bad-content-length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    "length-and-chunked": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                           b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
    "two-lengths": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    "bad-chunk-size": HEAD + b"zz\r\n",  # not hex, once the request is under way
}


def test_bytes_that_are_not_http_get_an_openai_400_and_the_connection_closes(cluster_factory):  # noqa: F811
    cluster = cluster_factory()
    for name, data in NOT_HTTP.items():
        with socket.create_connection(("127.0.0.1", cluster.port)) as sock:
            sock.settimeout(10)
            sock.sendall(data)
            got = b""
            while part := sock.recv(65536):
                got += part
        head, body = got.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head, (name, got)
        error = json.loads(body)["error"]
        assert error["code"] == "invalid_http" and error["type"] == "invalid_request_error", (name, error)
    # the router serves on
    with socket.create_connection(("127.0.0.1", cluster.port)) as sock:
        sock.sendall(HEAD + chunked(json.dumps(completion()).encode(), 64) + b"0\r\n\r\n")
        (response,), _ = read_responses(sock, 1)
    assert response.startswith(b"HTTP/1.1 200 ")
