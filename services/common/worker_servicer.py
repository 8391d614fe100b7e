"""What the prefill and decode servicers answer alike: the checks a room passes before it is
submitted (draining, --max-model-len, sampling parameters and grammar, KV capacity, a room
already held), and the Abort, Load, ResetPrefixCache and LoRA adapter RPCs.

Every refusal carries its code (services/common/refusal.py): the router decides by that code
whether another worker may take the call, so both roles refuse alike."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.lane_server import LaneServicerMixin, refusing
from services.common.logging_setup import bound_room
from services.common.lora_modules import LoraError, LoraModule
from services.common.mesh_protocol import MIN_PEER_VERSION, PROTOCOL_VERSION, incompatibility
from services.common.refusal import Refusal, length_refusal, refuse
from services.common.sampling_params import SamplingParams
from services.common.wire import parse_request
from services.transfer.state import DuplicateRoom


class WorkerServicer(LaneServicerMixin):
    """Base of both workers' servicers; `worker` is a PrefillWorker or a DecodeWorker, `log` the
    role's logger."""

    log: Any

    def __init__(self, worker: Any, log_requests: bool = True):
        self.worker = worker
        self.log_requests = log_requests
        self._lora_lock = asyncio.Lock()  # runtime LoRA loads, one at a time  # --log-requests: a line as each request arrives and as it ends

    def load_fields(self) -> dict[str, Any]:
        """What this role adds to its LoadReply (its transfer side's epoch, at least)."""
        raise NotImplementedError

    async def admit(self, request, context, ids: list[int], pages_for: int, submit: Callable[[SamplingParams], Any],
                    check: Callable[[], None] = lambda: None) -> Any:
        """The room's job, submitted (`submit(params)`) once the room passed every check a worker
        makes before it takes one; otherwise the call ends refused. `pages_for`: the tokens the
        room's KV pages must hold from the start; `check`: the role's own checks of the request
        (ValueError: invalid)."""
        if refusing():  # stopping: the router fails this over at once
            await refuse(context, grpc.StatusCode.UNAVAILABLE, Refusal.DRAINING, refusing())
        engine = self.worker.engine
        too_long = length_refusal(len(ids), request.params.max_tokens, engine.config.max_model_len)
        if too_long:  # this worker's --max-model-len; another worker's may be longer: the router tries it
            await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, Refusal.TOO_LONG, too_long)
        try:
            params = parse_request(request.params, ids, engine.config)
            engine.check_lora(params)
            if params.grammar is not None:  # a big grammar compiles for seconds: off the event loop
                await asyncio.to_thread(engine.check_grammar, params)
            check()
        except ValueError as e:
            await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, Refusal.INVALID, str(e))
        if not engine.pool.can_ever_hold(pages_for):  # another worker's pool may: the router tries it (by this code)
            await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, Refusal.KV_CAPACITY,
                         f"prompt of {len(ids)} tokens needs more KV pages than this worker has")
        try:
            return submit(params)
        except DuplicateRoom as e:
            await refuse(context, grpc.StatusCode.ALREADY_EXISTS, Refusal.DUPLICATE_ROOM, str(e))

    async def Abort(self, request, context):
        with bound_room(request.room):
            found = self.worker.abort(request.room, f"aborted: {request.reason or 'no reason given'}")
            self.log.info("abort", found=found, reason=request.reason)
            return wpb.AbortRoomReply(found=found)

    async def Load(self, request, context):
        problem = incompatibility("the router", request.protocol_version, request.min_protocol_version)
        if problem:
            self.log.error("router refused: incompatible protocol version", reason=problem)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        queued, running = self.worker.load()
        engine = self.worker.engine
        return wpb.LoadReply(queued=queued, running=running, token_usage=engine.pool.token_usage,
                             protocol_version=PROTOCOL_VERSION, min_protocol_version=MIN_PEER_VERSION,
                             kv_capacity_tokens=engine.capacity_tokens, max_model_len=engine.config.max_model_len,
                             prefix_cache_page_size=engine.pool.page_size if engine.prefix_cache else 0,
                             lora_adapters=engine.adapters.names if engine.adapters is not None else (),
                             **self.load_fields())

    async def LoadLoraAdapter(self, request, context):
        """Load a LoRA adapter under a name (the router's runtime LoRA updates); serialized, so
        two loads never attach to one layer at once. INVALID_ARGUMENT names what is wrong."""
        adapters = self.worker.engine.adapters
        if adapters is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "LoRA is off on this worker (--enable-lora)")
        async with self._lora_lock:
            try:
                # reading the folder takes time: off the loop; a new name is read by no running forward
                await asyncio.to_thread(adapters.load, LoraModule(request.name, request.path))
            except LoraError as e:
                code = grpc.StatusCode.ALREADY_EXISTS if request.name in adapters else grpc.StatusCode.INVALID_ARGUMENT
                await context.abort(code, str(e))
        self.log.info("lora adapter loaded", adapter=request.name, path=request.path)
        return wpb.LoraAdapterReply(adapters=adapters.names)

    async def UnloadLoraAdapter(self, request, context):
        """Stop serving an adapter: new requests naming it are refused from now on, and its weights
        go once the requests already using it end."""
        adapters = self.worker.engine.adapters
        if adapters is None or request.name not in adapters:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"The LoRA adapter {request.name!r} cannot be found.")
        adapters.retire(request.name)
        self.worker.engine.detach_retired_loras(self.worker.jobs.values())
        self.log.info("lora adapter unloaded", adapter=request.name)
        return wpb.LoraAdapterReply(adapters=adapters.names)

    async def ResetPrefixCache(self, request, context):
        dropped = self.worker.reset_prefix_cache()
        return wpb.ResetPrefixCacheReply(enabled=self.worker.engine.prefix_cache is not None, pages_dropped=dropped)
