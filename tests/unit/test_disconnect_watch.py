"""A request's wait for its client to leave, on the router's own server: a callback of the
connection (services/router/connection_guard.py `watch_disconnect`) instead of a task per request
waiting on `receive()`; a pipelined request still being answered when its client goes is
cancelled as the newest one is; under another server the watcher task still does it."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from services.fakes.workers import Behaviour
from services.router.sse import ClientDisconnected, run_until_disconnect
from tests.unit.test_router_app import cluster, cluster_factory, completion, wait_for  # noqa: F401 - fixtures

pytestmark = pytest.mark.timeout(60)


def raw_request(body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)


def watch_tasks(c) -> list[asyncio.Task]:
    async def tasks() -> list[asyncio.Task]:
        return [t for t in asyncio.all_tasks() if "run_until_disconnect" in repr(t.get_coro())]
    return c.call(tasks())


def test_a_held_request_has_no_watch_task_and_its_disconnect_cancels_both_calls(cluster_factory):  # noqa: F811
    c = cluster_factory(request_timeout=30)
    c.decodes[0].behaviour = Behaviour(mode="hang")
    c.prefills[0].behaviour = Behaviour(mode="hang")
    with socket.create_connection(("127.0.0.1", c.port)) as s:
        s.sendall(raw_request(completion()))
        wait_for(lambda: c.decodes[0].seen.active == 1 and c.prefills[0].seen.active == 1, what="both calls")
        assert watch_tasks(c) == []
    c.all_rpcs_ended()
    assert c.decodes[0].seen.cancelled == 1 and c.prefills[0].seen.cancelled == 1
    assert c.metric("pdmesh:router_requests_total", status="499") == 1


def test_a_pipelined_request_being_answered_is_cancelled_when_its_client_leaves(cluster_factory):  # noqa: F811
    # uvicorn marks only the newest request of a connection disconnected; the one being answered
    # here is the older one, which would otherwise wait for the 30 s deadline
    c = cluster_factory(request_timeout=30)
    c.decodes[0].behaviour = Behaviour(mode="hang")
    c.prefills[0].behaviour = Behaviour(mode="hang")
    with socket.create_connection(("127.0.0.1", c.port)) as s:
        s.sendall(raw_request(completion()) + raw_request(completion()))
        wait_for(lambda: c.decodes[0].seen.active == 1, what="the first request's calls")
    c.all_rpcs_ended()
    assert c.decodes[0].seen.cancelled == 1 and len(c.decodes[0].seen.rooms) == 1  # the second never ran


def test_the_watch_ends_with_the_request_and_its_connection_serves_the_next(cluster):  # noqa: F811
    with socket.create_connection(("127.0.0.1", cluster.port)) as s:
        s.settimeout(10)
        for _ in range(3):
            s.sendall(raw_request(completion()))
            got = b""
            while b'"finish_reason"' not in got:
                got += s.recv(65536)
            assert got.startswith(b"HTTP/1.1 200")
        connection = next(iter(cluster.call(_connections(cluster))))
        assert connection._gone_watchers == {}
    cluster.all_rpcs_ended()


async def _connections(c):
    return list(c.server.server_state.connections)


def test_without_the_router_server_a_watcher_task_sees_the_disconnect():
    async def scenario() -> None:
        sent = [{"type": "http.disconnect"}]
        released = asyncio.Event()

        async def receive() -> dict:
            await released.wait()
            return sent.pop()

        async def work() -> None:
            await asyncio.sleep(30)

        running = asyncio.ensure_future(run_until_disconnect(work(), receive, {"type": "http"}))
        await asyncio.sleep(0)
        released.set()
        with pytest.raises(ClientDisconnected):
            await asyncio.wait_for(running, 5)

    asyncio.run(scenario())


def test_two_watches_on_one_request_are_each_called_and_each_stopped_alone(cluster_factory):  # noqa: F811
    c = cluster_factory(request_timeout=30)
    c.decodes[0].behaviour = Behaviour(mode="hang")
    c.prefills[0].behaviour = Behaviour(mode="hang")
    called: list[str] = []

    async def watch_the_held_request():
        connection = next(iter(c.server.server_state.connections))
        cycle = connection.cycle
        stop_a = connection.watch_disconnect(cycle, lambda: called.append("a"))
        connection.watch_disconnect(cycle, lambda: called.append("b"))
        stop_a()

    with socket.create_connection(("127.0.0.1", c.port)) as s:
        s.sendall(raw_request(completion()))
        wait_for(lambda: c.decodes[0].seen.active == 1, what="the request's calls")
        c.call(watch_the_held_request())
    wait_for(lambda: called == ["b"], what="the watch left to be called")
    c.all_rpcs_ended()
