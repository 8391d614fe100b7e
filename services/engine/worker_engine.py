"""What a worker process holds of the engine: model, KV pool, runner, sampler, engine thread.

Forwards run on one dedicated thread so the asyncio loop (queues, watchdog, gRPC, metrics)
stays responsive while a long prefill computes; torch releases the GIL inside its kernels.

`run()` is the one door to that thread, so it is also where the forward faults apply (both
workers alike, see services/common/faults.py) and where the start of the current forward is
recorded: `forward_age()` lets a timer on the loop notice a forward that never returns
(`--forward-timeout`, services/common/worker_lifecycle.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import pathlib
import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import structlog
import torch

from services.common.faults import Faults
from services.common.lora_modules import LoraError, parse_lora_modules
from services.common.sampling_params import SamplingParams
from services.common.tokenizer import load_tokenizer, resolve_model_path
from services.engine.grammar import DEFAULT_STEP_BUDGET, GrammarError, GrammarRegistry, build_tokenizer
from services.engine.kv_budget import size_pool
from services.engine.kv_pool import KVPool
from services.engine.loader import LoadedModel, load_model
from services.engine.lora import DEFAULT_MAX_RANK, LoraAdapters
from services.engine.prefix_cache import PrefixCache
from services.engine.runner import ModelRunner
from services.engine.sampler import Sampler

T = TypeVar("T")
log = structlog.get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ForwardFault(RuntimeError):
    """Raised inside a forward by the fail_forward fault."""


class WorkerEngine:
    def __init__(
        self, model_path: str, device: str, dtype: str, num_pages: int, page_size: int, faults: Faults | None = None,
        *, kv_cache_memory_bytes: int = 0, gpu_memory_utilization: float = 0.9, max_model_len: int = 0,
        chunk_tokens: int = 512, prefix_cache: bool = False, grammar_step_budget: float = DEFAULT_STEP_BUDGET,
        tokenizer_path: str = "", enable_lora: bool = False, lora_modules: Sequence[str] = (),
        max_lora_rank: int = DEFAULT_MAX_RANK,
    ):
        """num_pages 0: the pool is sized from the budget (services/engine/kv_budget.py); max_model_len
        0: the model's max_position_embeddings; tokenizer_path "" : the model folder's tokenizer;
        lora_modules: --lora-modules' values (services/engine/lora.py), which need enable_lora."""
        modules = parse_lora_modules(lora_modules)
        if modules and not enable_lora:
            raise LoraError("--lora-modules needs --enable-lora (as vLLM's)")
        if faults is not None and faults.slow_load:
            time.sleep(faults.slow_load)  # runs in the worker's load thread: its HTTP side keeps answering
        self.loaded: LoadedModel = load_model(model_path, device, None if dtype == "auto" else _DTYPES[dtype])
        self.config = _with_max_model_len(self.loaded.config, max_model_len)
        budget = size_pool(self.config, page_size, self.loaded.dtype, torch.device(self.loaded.device),
                           num_pages=num_pages, kv_cache_memory_bytes=kv_cache_memory_bytes,
                           gpu_memory_utilization=gpu_memory_utilization, chunk_tokens=chunk_tokens)
        self.pool = KVPool(self.config, budget.pages, page_size, self.loaded.device, self.loaded.dtype)
        tokens = budget.pages * page_size
        log.info("kv cache sized", pages=budget.pages, page_size=page_size, tokens=tokens, bytes=budget.nbytes,
                 source=budget.source, max_model_len=self.config.max_model_len,
                 max_concurrency=round(tokens / self.config.max_model_len, 2))
        if tokens < self.config.max_model_len:
            log.warning("kv cache holds fewer tokens than the max model length: longer requests are refused",
                        tokens=tokens, max_model_len=self.config.max_model_len)
        # the LoRA adapters this worker computes requests with (None: LoRA off)
        self.adapters = LoraAdapters(self.loaded.model, modules, max_lora_rank) if enable_lora else None
        if modules:
            log.info("lora adapters loaded", adapters=self.adapters.paths, max_lora_rank=max_lora_rank)
        self.runner = ModelRunner(self.loaded.model, self.pool, self.adapters)
        # full pages found again by their token ids (--prefix-cache); None: every page is a room's own
        self.prefix_cache = PrefixCache(self.pool.allocator, page_size) if prefix_cache else None
        self.grammars = _grammar_registry(tokenizer_path, self.loaded, model_path, self.config.vocab_size,
                                          grammar_step_budget)
        self.sampler = Sampler(self.grammars)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.faults = faults or Faults()
        self._fault_rng = random.Random(self.faults.fault_seed)  # fail_forward draws: repeatable
        self._hang_pending = self.faults.hang_forward > 0  # hang_forward hits the first forward only
        self._forward_started: float | None = None  # monotonic start of the running forward
        self.forward_seq = 0  # forwards started so far: tells one stuck forward from the next

    @classmethod
    def from_settings(cls, settings: Any, faults: Faults | None = None) -> WorkerEngine:
        """The engine a worker's settings (PrefillSettings / DecodeSettings) describe."""
        return cls(settings.model, settings.device, settings.dtype, settings.num_pages, settings.page_size, faults,
                   kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
                   gpu_memory_utilization=settings.gpu_memory_utilization, max_model_len=settings.max_model_len,
                   chunk_tokens=settings.chunked_prefill_size, prefix_cache=settings.prefix_cache,
                   grammar_step_budget=settings.grammar_step_budget, tokenizer_path=settings.tokenizer,
                   enable_lora=settings.enable_lora, lora_modules=settings.lora_modules,
                   max_lora_rank=settings.max_lora_rank)

    @property
    def model_name(self) -> str:
        return self.config.name

    @property
    def capacity_tokens(self) -> int:
        """Tokens the KV pool holds in all."""
        return self.pool.num_pages * self.pool.page_size

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run one forward (fn) on the engine thread; the event loop keeps serving meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._forward, fn, args)

    def check_grammar(self, params: SamplingParams) -> None:
        """Compile a request's grammar before it queues, so a bad one is INVALID_ARGUMENT at once
        (ValueError) rather than a failed forward later."""
        if params.grammar is None:
            return
        if self.grammars is None:
            raise ValueError("this worker cannot serve structured output (its tokenizer did not load)")
        try:
            self.grammars.compile(params.grammar)
        except (GrammarError, ValueError) as e:
            raise ValueError(f"invalid grammar: {e}") from None

    def check_lora(self, params: SamplingParams) -> None:
        """A request naming an adapter this worker does not serve is INVALID_ARGUMENT (ValueError)."""
        name = params.lora_name
        if name and (self.adapters is None or name not in self.adapters):
            served = ", ".join(self.adapters.names) if self.adapters and self.adapters.names else "none"
            raise ValueError(f"LoRA adapter {name!r} is not served by this worker (its adapters: {served})")

    def detach_retired_loras(self, live_jobs: Iterable[Any]) -> None:
        """Detach the unloaded LoRA adapters none of `live_jobs` (the worker's jobs table) uses:
        called when an adapter is unloaded and whenever a job leaves the table."""
        adapters = self.adapters
        if adapters is None or not adapters.retired:
            return
        gone = adapters.detach_unused({job.params.lora_name for job in live_jobs})
        if gone:
            log.info("lora adapters detached", adapters=gone)

    def forget_room(self, room: int) -> None:
        """The room's per-request engine state (its grammar matcher) is no longer needed."""
        if self.grammars is not None:
            self.grammars.forget(room)

    def forward_age(self) -> float:
        """Seconds the current forward has been running on the engine thread; 0 when idle."""
        started = self._forward_started
        return 0.0 if started is None else max(0.0, time.monotonic() - started)

    def _forward(self, fn: Callable[..., T], args: tuple) -> T:
        # engine thread. The clock starts here, not at submission: a forward queued behind
        # another is not itself stuck.
        self.forward_seq += 1  # only this thread writes; the loop only reads
        self._forward_started = time.monotonic()
        try:
            self._apply_faults()
            return fn(*args)
        finally:
            self._forward_started = None

    def _apply_faults(self) -> None:
        f = self.faults
        if self._hang_pending:
            self._hang_pending = False
            time.sleep(f.hang_forward)  # fault injection: a forward stuck for this long
        if f.delay_forward:
            time.sleep(f.delay_forward)  # fault injection: a slow forward
        if f.fail_forward and self._fault_rng.random() < f.fail_forward:
            raise ForwardFault("fault injection: fail_forward")

    def pool_health(self) -> dict[str, Any]:
        alloc = self.pool.allocator
        try:
            (self.prefix_cache or alloc).check_integrity()
            ok = True
        except Exception:  # noqa: BLE001 - reported, not raised, so /health shows it
            ok = False
        return {
            # pages no request holds: free, or cached with no holder (evicted when needed); equal
            # to the total once the worker has drained
            "kv_pages_free": alloc.num_available,
            "kv_pages_total": alloc.num_total,
            "kv_pages_cached": alloc.num_cached,
            "kv_pool_ok": ok,
            "aux_slots_free": self.pool.aux_allocator.num_free,
            "aux_slots_total": self.pool.aux_allocator.num_total,
        }

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _with_max_model_len(config, max_model_len: int):
    """The config with the length this worker serves (vLLM's --max-model-len: at most the model's
    max_position_embeddings)."""
    if max_model_len < 0:
        raise ValueError(f"--max-model-len must be positive, got {max_model_len}")
    if max_model_len > config.max_position_embeddings:
        raise ValueError(f"--max-model-len {max_model_len} is more than the model's max_position_embeddings "
                         f"({config.max_position_embeddings})")
    return dataclasses.replace(config, max_model_len=max_model_len or config.max_position_embeddings)


def _grammar_registry(tokenizer_path: str, loaded: LoadedModel, model_path: str, vocab_size: int,
                      step_budget: float = DEFAULT_STEP_BUDGET) -> GrammarRegistry | None:
    """Structured output needs the tokenizer's bytes per token (--tokenizer's folder, else the
    model's); a worker whose tokenizer cannot load still serves everything else (and refuses
    grammars with a clear message)."""
    try:
        if tokenizer_path:
            tokenizer = load_tokenizer(model_path, tokenizer_path)
            folder = pathlib.Path(resolve_model_path(tokenizer_path))
        else:
            tokenizer = load_tokenizer(loaded.path or model_path)
            folder = pathlib.Path(loaded.path) if loaded.path else None
        return GrammarRegistry(build_tokenizer(tokenizer, folder, vocab_size), vocab_size, step_budget)
    except Exception:  # noqa: BLE001 - logged, and the worker serves without grammars
        log.exception("structured output disabled: the tokenizer did not load")
        return None
