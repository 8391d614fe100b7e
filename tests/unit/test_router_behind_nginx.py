"""The router behind a real nginx reverse proxy (Debian's nginx-light), as deployments put it:
streams go through unbuffered, one that falls silent through a stalled decode and its migration
survives nginx's read timeout thanks to the keep-alive comments (and is cut without them), so does
one whose first token comes after that timeout (a 504 from nginx without them), and a browser's
cross-origin preflight is answered through it."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from services.fakes.workers import Behaviour
from services.launch.ports import free_port
from tests.unit.test_router_app import wait_for
from tests.unit.test_router_failover import PROMPT, expected, make  # noqa: F401 - fixture

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(shutil.which("nginx") is None,
                       reason="nginx is not installed (Debian package nginx-light; scripts/ensure_test_tools.sh)"),
]

READ_TIMEOUT = 1.0  # nginx's proxy_read_timeout here: a stream silent for longer is cut


def nginx_config(root: Path, port: int, upstream: str) -> str:
    temp = "\n".join(f"  {kind}_temp_path {root / kind};" for kind in ("client_body", "proxy", "fastcgi",
                                                                        "uwsgi", "scgi"))
    return f"""
daemon off;
master_process off;
user root;
pid {root / "nginx.pid"};
error_log stderr warn;
events {{ worker_connections 64; }}
http {{
  access_log off;
{temp}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://{upstream};
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_read_timeout {int(READ_TIMEOUT * 1000)}ms;
    }}
  }}
}}
"""


@pytest.fixture
def nginx_in_front(tmp_path):
    started: list[subprocess.Popen] = []

    def start(upstream_url: str) -> str:
        port = free_port()
        conf = tmp_path / f"nginx-{port}.conf"
        conf.write_text(nginx_config(tmp_path, port, upstream_url.removeprefix("http://")))
        proc = subprocess.Popen(["nginx", "-p", str(tmp_path), "-c", str(conf)], stderr=subprocess.PIPE)
        started.append(proc)
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert proc.poll() is None, proc.stderr.read().decode()
            try:
                return httpx.get(url + "/ping", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, what="nginx in front of the router")
        return url

    yield start
    for proc in started:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stream_through(url: str, max_tokens: int) -> tuple[list[tuple[float, str]], bool]:
    """Each line of the stream with the seconds since the request, and whether it ended properly."""
    t0 = time.monotonic()
    lines: list[tuple[float, str]] = []
    with httpx.Client(timeout=10) as client, client.stream(
            "POST", url + "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": max_tokens, "stream": True}) as s:
        assert s.status_code == 200
        try:
            for line in s.iter_lines():
                lines.append((time.monotonic() - t0, line))
        except httpx.RemoteProtocolError:  # nginx cut the chunked body short
            return lines, False
    return lines, bool(lines) and lines[-1][1] == "" and any(line == "data: [DONE]" for _, line in lines)


def text_of(lines: list[tuple[float, str]]) -> str:
    return "".join(json.loads(line[6:])["choices"][0]["text"] for _, line in lines
                   if line.startswith("data: {"))


def test_tokens_arrive_through_nginx_as_they_are_made(make, nginx_in_front):  # noqa: F811
    c = make()
    c.decodes[0].behaviour.token_delay = 0.2
    lines, ended = stream_through(nginx_in_front(c.url), 6)
    assert ended and text_of(lines) == expected(c, 6)
    data = [t for t, line in lines if line.startswith("data: {")]
    assert data[-1] - data[0] > 0.8  # not buffered into one piece by nginx (X-Accel-Buffering: no)
    c.all_rpcs_ended()


def test_a_stall_and_migration_longer_than_nginx_read_timeout(make, nginx_in_front):  # noqa: F811
    # decode 0 goes silent after 3 tokens; the router gives up on it after 2.5 s and migrates
    for keepalive, survives in ((0.3, True), (0, False)):
        c = make(n_decode=2, stream_stall_timeout=2.5, health_check_interval=30, stream_keepalive_interval=keepalive)
        c.decodes[0].behaviour = Behaviour(mode="hang_after", after=3)
        lines, ended = stream_through(nginx_in_front(c.url), 8)
        if survives:
            assert ended and text_of(lines) == expected(c, 8), lines
            assert sum(line == ": keep-alive" for _, line in lines) >= 5
            assert c.metric("pdmesh:router_migrations_total", reason="decode_stalled") == 1
        else:
            # without the comments nginx closes the silent stream: the client never sees the end
            assert not ended and text_of(lines) == expected(c, 3), lines
        wait_for(lambda c=c: c.router.active == 0, what="the request ended in the router")
        c.all_rpcs_ended()


def test_a_first_token_later_than_nginx_read_timeout(make, nginx_in_front):  # noqa: F811
    # a long prefill (or a wait for a free pair): nothing to send for 2.5 s
    for keepalive, survives in ((0.3, True), (0, False)):
        c = make(stream_keepalive_interval=keepalive)
        c.decodes[0].behaviour = Behaviour(delay=2.5)
        url = nginx_in_front(c.url)
        if survives:
            lines, ended = stream_through(url, 4)
            assert ended and text_of(lines) == expected(c, 4), lines
            assert lines[0][1] == ": keep-alive" and sum(line == ": keep-alive" for _, line in lines) >= 5
        else:  # the headers wait for the token, and nginx gives up first
            r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "stream": True},
                           timeout=10)
            assert r.status_code == 504, r.text
        wait_for(lambda c=c: c.router.active == 0, what="the request ended in the router")
        c.all_rpcs_ended()


def test_a_browser_preflight_through_nginx(make, nginx_in_front):  # noqa: F811
    c = make()
    url = nginx_in_front(c.url)
    r = httpx.options(url + "/v1/chat/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"}, timeout=10)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
