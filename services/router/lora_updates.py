"""Runtime LoRA updates (vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter), under the
router's --allow-runtime-lora-updating.

With it the router's list of adapters (`ModelInfo.adapters`: --lora-modules, then what was loaded
or unloaded since) is what every worker serves:

- **load** asks every healthy worker at once to load the folder (each reads it from its own
  filesystem, each call bounded by LOAD_TIMEOUT_S; an ejected worker gets it by reconciliation,
  below, rather than holding the call until its timeout). A worker that finds the adapter invalid fails the load: it is unloaded again
  from the others and the client gets a 400 with that worker's reason. Otherwise, once at least one
  healthy decode (and, with prefill workers, one healthy prefill) serves it, the router lists it;
  a worker that did not answer gets it later (below).
- **unload** takes the name off the router's list first (a request naming it is a 404 from then
  on), then asks every worker to unload it; a worker keeps the weights until its requests already
  using the adapter end (services/engine/lora.py), so none changes weights halfway.
- **reconciliation**: after each worker's Load report (the pool's health probe), a worker that
  lacks an adapter of the list is asked to load it, and one that serves an adapter not on the list
  to unload it — a restarted worker, or one unreachable during an update, comes to serve the
  list within a probe interval. Meanwhile the orchestrator keeps a request of an adapter off the
  workers whose report lacks it (WorkerPool.lacking), while another serves it.

One update at a time (a lock); reconciliation waits while one runs. The router refuses the flag
with --processes above 1: each process would keep its own list.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import grpc

from services.common.logging_setup import get_logger
from services.router.errors import APIError, bad_request
from services.router.pool import WorkerHandle, WorkerPool
from services.router.protocol import ModelInfo

log = get_logger("router.lora")

LOAD_TIMEOUT_S = 60.0  # one worker reading and attaching one adapter
UNLOAD_TIMEOUT_S = 10.0


class LoraUpdates:
    def __init__(self, pool: WorkerPool, info: ModelInfo, model_names: Iterable[str], enabled: bool):
        self.pool = pool
        self.adapters: dict[str, str] = info.adapters  # type: ignore[assignment]  # the router's list, shared
        self.model_names = frozenset(model_names)
        self.enabled = enabled
        self._lock = asyncio.Lock()
        self._syncing: set[WorkerHandle] = set()
        self._tasks: set[asyncio.Task] = set()
        self._logged: dict[tuple[str, str], str] = {}  # (worker, adapter) -> the last failure logged
        if enabled:
            pool.on_load_report = self.reconcile

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise bad_request("Runtime LoRA updates are off: start the router with --allow-runtime-lora-updating "
                              "(and --enable-lora).", code="unsupported_value")

    def _workers(self) -> list[WorkerHandle]:
        return [w for w in self.pool.workers if w.transport is not None]

    async def load(self, name: str, path: str) -> None:
        """Load on every worker; raises APIError (400: refused, 503: no worker could load it)."""
        self._check_enabled()
        if name in self.model_names:
            raise bad_request(f"'{name}' is a name of the base model.", param="lora_name", code="invalid_value")
        async with self._lock:
            if name in self.adapters:
                raise bad_request(f"The lora adapter '{name}' has already been loaded.", param="lora_name",
                                  code="invalid_value")
            workers = [w for w in self._workers() if w.healthy]
            results = await asyncio.gather(*(self._load_one(w, name, path) for w in workers))
            loaded = [w for w, (ok, _) in zip(workers, results, strict=True) if ok]
            refused = [(w, why) for w, (ok, why) in zip(workers, results, strict=True)
                       if not ok and why.startswith("INVALID_ARGUMENT")]
            if refused:
                await self._unload_from(loaded, name)
                w, why = refused[0]
                raise bad_request(f"The LoRA adapter '{name}' could not be loaded ({w!r}: {why}).",
                                  param="lora_path", code="invalid_value")
            missing = [role for role, group in self._roles() if not any(w.healthy for w in group if w in loaded)]
            if missing:
                await self._unload_from(loaded, name)
                failures = "; ".join(f"{w!r}: {why}" for w, (ok, why) in zip(workers, results, strict=True) if not ok)
                raise APIError(503, f"No healthy {' or '.join(missing)} worker loaded the LoRA adapter '{name}': "
                                    f"{failures or 'none is known'}.", code="no_healthy_workers")
            self.adapters[name] = path
        log.info("lora adapter loaded", adapter=name, path=path, workers=len(loaded), of=len(workers))

    async def unload(self, name: str) -> None:
        """Off the router's list, then off every worker; raises APIError (404: not listed)."""
        self._check_enabled()
        async with self._lock:
            if name not in self.adapters:
                raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                               code="model_not_found")
            del self.adapters[name]
            await self._unload_from(self._workers(), name)
        log.info("lora adapter unloaded", adapter=name)

    def _roles(self) -> list[tuple[str, list[WorkerHandle]]]:
        roles = [("decode", self.pool.decodes)]
        return roles if self.pool.colocated else [("prefill", self.pool.prefills), *roles]

    async def _load_one(self, w: WorkerHandle, name: str, path: str) -> tuple[bool, str]:
        """(loaded, why not). One that holds a former adapter of the name (unloaded while it was
        out of reach) unloads it first: the name now means this folder."""
        for attempt in range(2):
            try:
                reply = await w.transport.load_lora_adapter(name, path, LOAD_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.ALREADY_EXISTS and attempt == 0:
                    await self._unload_one(w, name)
                    continue
                return False, f"{e.code().name}: {e.details() or ''}"
            except Exception as e:  # noqa: BLE001 - a worker without a channel, or one closing
                return False, repr(e)
            w.lora_adapters = frozenset(reply.adapters)
            return True, ""
        return False, "ALREADY_EXISTS"

    async def _unload_one(self, w: WorkerHandle, name: str) -> bool:
        try:
            reply = await w.transport.unload_lora_adapter(name, UNLOAD_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return True
            self._log_once(w, name, f"unload: {e.code().name}: {e.details() or ''}")
            return False
        except Exception as e:  # noqa: BLE001 - as above
            self._log_once(w, name, f"unload: {e!r}")
            return False
        w.lora_adapters = frozenset(reply.adapters)
        return True

    async def _unload_from(self, workers: list[WorkerHandle], name: str) -> None:
        await asyncio.gather(*(self._unload_one(w, name) for w in workers))

    def reconcile(self, w: WorkerHandle) -> None:
        """After a Load report: bring the worker to the router's list, in the background."""
        have = w.lora_adapters
        if have is None or w in self._syncing or self._lock.locked():
            return  # an update running now brings every worker along itself
        missing = [n for n in self.adapters if n not in have]
        extra = [n for n in have if n not in self.adapters]
        if not missing and not extra:
            return
        self._syncing.add(w)
        task = asyncio.ensure_future(self._sync(w, missing, extra))
        self._tasks.add(task)
        task.add_done_callback(lambda t: (self._tasks.discard(t), self._syncing.discard(w)))

    async def _sync(self, w: WorkerHandle, missing: list[str], extra: list[str]) -> None:
        async with self._lock:
            for name in missing:
                if name not in self.adapters:
                    continue  # unloaded meanwhile
                ok, why = await self._load_one(w, name, self.adapters[name])
                if ok:
                    self._logged.pop((w.addr, name), None)
                    log.info("lora adapter brought to a worker", adapter=name, role=w.role, target=w.addr)
                else:
                    self._log_once(w, name, why)
            for name in extra:
                if name not in self.adapters and await self._unload_one(w, name):
                    log.info("lora adapter the router does not list unloaded from a worker", adapter=name,
                             role=w.role, target=w.addr)

    def _log_once(self, w: WorkerHandle, name: str, why: str) -> None:
        """A failure that repeats at every probe is logged when it changes, not every time."""
        if self._logged.get((w.addr, name)) != why:
            self._logged[(w.addr, name)] = why
            log.warning("lora adapter not on a worker", adapter=name, role=w.role, target=w.addr, error=why)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
