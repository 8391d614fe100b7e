"""bench/http_fronts.py's fronts each serve the bench's handler as the bench measures it: a JSON
completion and a stream of CHUNKS SSE events ending in [DONE], one after the other on one
kept-alive connection. Without wrk (which the bench needs and the tests do not install): a front
that no longer starts (the bench's own start_front), or answers something else, would otherwise
only show as a failed bench run."""

from __future__ import annotations

import http.client
import json

import pytest

from bench.http_fronts import CHUNKS, start_front
from bench.router_compare import Procs
from services.launch.ports import free_port
from services.launch.probes import wait_for

FRONTS = ("uvicorn", "granian-asgi", "granian-rsgi", "raw")


def connect(port: int, proc, seconds: float) -> http.client.HTTPConnection:
    """A connection to the process's port once it listens (its log in the failure if it exited)."""
    def attempt() -> http.client.HTTPConnection:
        assert proc.popen.poll() is None, proc.log()[-2000:]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            conn.connect()
        except OSError:
            conn.close()
            raise
        return conn

    return wait_for(attempt, seconds, f"port {port} to listen")


def post(conn: http.client.HTTPConnection, body: dict) -> tuple[http.client.HTTPResponse, bytes]:
    conn.request("POST", "/v1/completions", json.dumps(body, separators=(",", ":")),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response, response.read()


@pytest.mark.parametrize("front", FRONTS)
def test_the_front_answers_json_and_a_stream_on_one_connection(front, tmp_path):
    procs = Procs(tmp_path, pin=False)
    try:
        port = free_port()
        proc = start_front(procs, front, port)
        conn = connect(port, proc, 30)
        try:
            response, data = post(conn, {"model": "m", "prompt": "request 1: a fox", "max_tokens": 3})
            assert response.status == 200 and response.getheader("content-type") == "application/json"
            body = json.loads(data)
            assert body["model"] == "m" and body["choices"][0]["text"] == " x" * 3
            assert body["usage"]["completion_tokens"] == 3

            response, data = post(conn, {"model": "m", "prompt": "request 2", "stream": True})
            assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
            events = [e for e in data.decode().split("\n\n") if e]
            assert events[-1] == "data: [DONE]" and len(events) == CHUNKS + 1, events
            texts = [json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in events[:-1]]
            assert texts == [f" t{i}" for i in range(CHUNKS)]

            response, data = post(conn, {"model": "again", "prompt": "request 3"})  # the same connection still
            assert response.status == 200 and json.loads(data)["model"] == "again"
        finally:
            conn.close()
    finally:
        procs.close()
