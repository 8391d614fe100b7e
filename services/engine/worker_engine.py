"""What a worker process holds of the engine: model, KV pool, runner, sampler, engine thread.

Forwards run on one dedicated thread so the asyncio loop (queues, watchdog, gRPC, metrics)
stays responsive while a long prefill computes; torch releases the GIL inside its kernels.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from services.engine.kv_pool import KVPool
from services.engine.loader import LoadedModel, load_model
from services.engine.runner import ModelRunner
from services.engine.sampler import Sampler

T = TypeVar("T")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WorkerEngine:
    def __init__(self, model_path: str, device: str, dtype: str, num_pages: int, page_size: int):
        self.loaded: LoadedModel = load_model(model_path, device, None if dtype == "auto" else _DTYPES[dtype])
        self.config = self.loaded.config
        self.pool = KVPool(self.config, num_pages, page_size, self.loaded.device, self.loaded.dtype)
        self.runner = ModelRunner(self.loaded.model, self.pool)
        self.sampler = Sampler()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    @property
    def model_name(self) -> str:
        return self.config.name

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn on the engine thread; the event loop keeps serving meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def pool_health(self) -> dict[str, Any]:
        alloc = self.pool.allocator
        try:
            alloc.check_integrity()
            ok = True
        except Exception:  # noqa: BLE001 - reported, not raised, so /health shows it
            ok = False
        return {
            "kv_pages_free": alloc.num_free,
            "kv_pages_total": alloc.num_total,
            "kv_pool_ok": ok,
            "aux_slots_free": self.pool.aux_allocator.num_free,
            "aux_slots_total": self.pool.aux_allocator.num_total,
        }

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
