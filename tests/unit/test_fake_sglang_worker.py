"""The fake SGLang worker bench/router_compare.py puts behind sglang-router answers as SGLang
does, on one kept-alive connection: its info routes, a JSON completion, and one SSE event per
token ending in [DONE]; the prefill role a one-token body."""

from __future__ import annotations

import json

import pytest

from bench.router_compare import Procs
from services.launch.ports import free_port
from tests.unit.test_bench_http_fronts import connect, post


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_the_fake_answers_its_routes_on_one_connection(role, tmp_path):
    procs = Procs(tmp_path, pin=False)
    try:
        port = free_port()
        proc = procs.start("fakes", "services.fakes.sglang_worker", ["--port", str(port), "--role", role], "0")
        conn = connect(port, proc, 30)
        try:
            conn.request("GET", "/server_info")
            response = conn.getresponse()
            assert response.status == 200 and json.loads(response.read())["served_model_name"] == "pdmesh-tiny"

            response, data = post(conn, {"model": "pdmesh-tiny", "prompt": "a fox", "max_tokens": 3})
            body = json.loads(data)
            assert response.status == 200
            assert body["choices"][0]["text"] == ("aaa" if role == "decode" else "a")

            response, data = post(conn, {"model": "pdmesh-tiny", "prompt": "a fox", "max_tokens": 3, "stream": True})
            events = [e for e in data.decode().split("\n\n") if e]
            tokens = 3 if role == "decode" else 1
            assert events[-1] == "data: [DONE]" and len(events) == tokens + 1, events
            assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
        finally:
            conn.close()
    finally:
        procs.close()
