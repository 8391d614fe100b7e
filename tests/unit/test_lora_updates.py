"""The router's runtime LoRA updates (services/router/lora_updates.py) over fake workers: a load
reaches every worker or none, an invalid adapter rolls back, a role with no healthy worker that
loaded it is a 503, unload takes the name off first, and a worker's Load report brings it to the
router's list (what it lacks loaded, what the router does not list unloaded)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.tokenizer import load_tokenizer
from services.router.errors import APIError
from services.router.lora_updates import LoraUpdates
from services.router.pool import WorkerHandle
from services.router.protocol import ModelInfo


class Refused(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FakeTransport:
    def __init__(self, adapters=(), refuse: dict[str, grpc.StatusCode] | None = None):
        self.adapters = list(adapters)
        self.refuse = refuse or {}
        self.calls: list[tuple[str, str]] = []

    async def load_lora_adapter(self, name, path, timeout):
        self.calls.append(("load", name))
        if name in self.refuse:
            raise Refused(self.refuse[name], f"cannot load {name}")
        if name in self.adapters:
            raise Refused(grpc.StatusCode.ALREADY_EXISTS, "already")
        self.adapters.append(name)
        return wpb.LoraAdapterReply(adapters=self.adapters)

    async def unload_lora_adapter(self, name, timeout):
        self.calls.append(("unload", name))
        if name not in self.adapters:
            raise Refused(grpc.StatusCode.NOT_FOUND, "not found")
        self.adapters.remove(name)
        return wpb.LoraAdapterReply(adapters=self.adapters)


def worker(role: str, n: int, **kw) -> WorkerHandle:
    w = WorkerHandle(role, f"127.0.0.1:{5000 + n}", healthy=True)
    w.transport = FakeTransport(**kw)
    w.lora_adapters = frozenset(w.transport.adapters)
    return w


def updates(prefills, decodes, adapters=None, enabled=True):
    pool = SimpleNamespace(prefills=prefills, decodes=decodes, colocated=not prefills,
                           workers=[*prefills, *decodes], on_load_report=None)
    info = ModelInfo(name="base", tokenizer=load_tokenizer("builtin"), context_length=64,
                     adapters=dict(adapters or {}))
    return LoraUpdates(pool, info, {"base"}, enabled), info, pool


def test_load_reaches_every_worker_and_lists_the_adapter():
    p, d = worker("prefill", 1), worker("decode", 2, adapters=["stale"])
    lu, info, pool = updates([p], [d])
    asyncio.run(lu.load("sql", "/a/sql"))
    assert info.adapters == {"sql": "/a/sql"}
    assert "sql" in p.lora_adapters and "sql" in d.lora_adapters
    with pytest.raises(APIError) as err:
        asyncio.run(lu.load("sql", "/a/sql"))
    assert err.value.status == 400 and "already been loaded" in err.value.message
    with pytest.raises(APIError):
        asyncio.run(lu.load("base", "/a/x"))  # the model's own name


@pytest.mark.parametrize("code,status,says", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "cannot load sql"),  # the adapter itself is bad
    (grpc.StatusCode.UNAVAILABLE, 503, "No healthy decode"),  # the only decode could not be reached
])
def test_a_load_the_decode_refuses_is_rolled_back(code, status, says):
    p = worker("prefill", 1)
    d = worker("decode", 2, refuse={"sql": code})
    lu, info, _ = updates([p], [d])
    with pytest.raises(APIError) as err:
        asyncio.run(lu.load("sql", "/a/sql"))
    assert err.value.status == status and says in err.value.message
    assert "sql" not in info.adapters and p.transport.adapters == [] and ("unload", "sql") in p.transport.calls


def test_an_ejected_worker_is_not_waited_for():
    p, d, out = worker("prefill", 1), worker("decode", 2), worker("decode", 3)
    out.healthy = False
    lu, info, _ = updates([p], [d, out])
    asyncio.run(lu.load("sql", "/a/sql"))
    assert "sql" in info.adapters and out.transport.calls == []  # reconciliation brings it there later


def test_unload_takes_the_name_off_first():
    p, d = worker("prefill", 1, adapters=["sql"]), worker("decode", 2, adapters=["sql"])
    lu, info, _ = updates([p], [d], {"sql": "/a"})
    asyncio.run(lu.unload("sql"))
    assert info.adapters == {} and p.transport.adapters == [] and d.transport.adapters == []
    with pytest.raises(APIError) as err:
        asyncio.run(lu.unload("sql"))
    assert err.value.status == 404


def test_a_load_report_brings_the_worker_to_the_list():
    d = worker("decode", 2, adapters=["gone"])
    lu, info, pool = updates([], [d], {"sql": "/a/sql"})
    assert pool.on_load_report == lu.reconcile

    async def main():
        lu.reconcile(d)
        await asyncio.gather(*lu._tasks)

    asyncio.run(main())
    assert d.transport.adapters == ["sql"] and d.lora_adapters == frozenset({"sql"})


def test_off_without_the_flag():
    lu, _, pool = updates([], [worker("decode", 2)], enabled=False)
    assert pool.on_load_report is None
    with pytest.raises(APIError) as err:
        asyncio.run(lu.load("sql", "/a"))
    assert err.value.status == 400 and "--allow-runtime-lora-updating" in err.value.message
