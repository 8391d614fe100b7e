"""A request body in, bounded: its size (413, from Content-Length and while reading), its time
(408, --body-timeout), how many are read at once (429, --max-body-reads), then JSON (400; nested
too deeply for the parser: 400) and, for a generation request, its fields into a `GenerateSpec`
(off the event loop when big or carrying its own chat template)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from starlette.requests import Request

from services.common.metrics import Metrics
from services.router import errors
from services.router.connection_guard import take_whole_body
from services.router.grammar_cost import GrammarCost
from services.router.json_codec import loads
from services.router.leases import Lease
from services.router.protocol import GenerateSpec, ModelInfo, parse_chat, parse_completion

PARSE_IN_THREAD_BYTES = 64 * 1024  # tokenize bigger bodies off the event loop

Parser = Callable[[Any, ModelInfo], GenerateSpec]
PARSERS: dict[str, Parser] = {"completion": parse_completion, "chat": parse_chat}


def parse_invocation(body: Any, info: ModelInfo) -> GenerateSpec:
    """SageMaker's POST /invocations, as vLLM serves it: a chat completion body (it has
    `messages`) or a completion body (`prompt`), each parsed and answered as its own route."""
    if isinstance(body, dict) and "messages" in body:
        return parse_chat(body, info)
    if isinstance(body, dict) and "prompt" in body:
        return parse_completion(body, info)
    raise errors.bad_request("/invocations takes a chat completion body (with 'messages') or a completion body "
                             "(with 'prompt').", code="invalid_value")


class BodyReader:
    def __init__(self, max_body_bytes: int, body_timeout: float, max_body_reads: int, metrics: Metrics):
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.max_body_reads = max_body_reads
        self.metrics = metrics
        self._reads = 0  # request bodies being read, changed only by their leases

    def _count(self, delta: int) -> None:
        self._reads += delta

    async def read_json(self, request: Request) -> tuple[Any, int]:
        """The parsed body and its size in bytes."""
        if self._reads >= self.max_body_reads:
            raise errors.too_many_body_reads(self.max_body_reads)
        raw = take_whole_body(request.scope)  # all of it in already: nothing to wait for, no timer
        if raw is None:
            raw = await self._read_in_time(request)
        elif len(raw) > self.max_body_bytes:
            raise errors.body_too_large(self.max_body_bytes)
        try:
            return loads(raw), len(raw)
        except RecursionError:
            raise errors.nested_too_deeply() from None
        except (ValueError, UnicodeDecodeError) as e:
            # looked at only when the body does not parse: a compressed body is the likely cause
            encoding = request.headers.get("content-encoding", "identity").strip().lower()
            if encoding != "identity":
                raise errors.unsupported_content_encoding(encoding) from None
            raise errors.bad_request(
                f"We could not parse the JSON body of your request ({e}). Send valid JSON.", code="invalid_json"
            ) from None

    async def _read_in_time(self, request: Request) -> bytes:
        try:
            with Lease(self._count):
                async with asyncio.timeout(self.body_timeout):
                    return await self._read(request)
        except TimeoutError:
            self.metrics.inc(self.metrics.router_client_cutoffs, reason="body_timeout")
            raise errors.body_timeout(self.body_timeout) from None

    async def _read(self, request: Request) -> bytes:
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                raise errors.bad_request("Invalid Content-Length header.") from None
            if size > limit:
                raise errors.body_too_large(limit)
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise errors.body_too_large(limit)
            parts.append(part)
        return b"".join(parts)


async def parse_spec(parse: Parser, body: Any, size_hint: int, info: ModelInfo,
                     grammar_cost: GrammarCost | None) -> GenerateSpec:
    """`parse` (protocol.parse_completion, parse_chat, or another body -> GenerateSpec) over the
    body, then the bounded compile of its grammar."""
    # a request's own chat template may take up to its render bound: not on the event loop
    in_thread = size_hint > PARSE_IN_THREAD_BYTES or (isinstance(body, dict) and body.get("chat_template") is not None)
    try:
        spec = await asyncio.to_thread(parse, body, info) if in_thread else parse(body, info)
    except RecursionError:  # a body deep enough to parse, walked by code that recurses
        raise errors.nested_too_deeply() from None
    if grammar_cost is not None:
        await grammar_cost.check(spec.grammar, spec.grammar_param)
    return spec
