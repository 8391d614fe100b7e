"""POST /v1/completions and /v1/chat/completions (and SageMaker's /invocations, either of them by
its body), and `generate`, the path every generation request takes from its HTTP request to its
response.

Order of checks: X-Request-Id (400) → API key (401) → the router's admission budget spent
already (429, before the body is read or tokenized: an overloaded router must not spend work on
requests it will refuse) → bodies being read at once (429, --max-body-reads) → body size, from
Content-Length and while reading (413, before any parsing) → body in time (408, --body-timeout)
→ JSON (400; nested too deeply for the parser: 400) → fields and model (400/404) → tokenization
and context length (400) → admission of its choices (400 for more than the whole budget, 429
for more than is left: the slots are taken only once the body is in, so a client slow to send
holds none) → workers (503 none healthy / worker failure, 504 deadline). A refusal before the
body is in closes the connection (the rest of the body would otherwise arrive as its next bytes).
"""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from services.common.logging_setup import bound_contextvars, bound_room, get_logger
from services.router import errors, openapi
from services.router.errors import APIError
from services.router.http_errors import CLIENT_CLOSED
from services.router.orchestrator import new_room
from services.router.protocol import valid_request_id
from services.router.request_body import PARSERS, Parser, parse_invocation, parse_spec
from services.router.request_driver import RequestDriver, Reshape

log = get_logger("router")


def client_request_id(request: Request) -> str | None:
    """The caller's X-Request-Id header (vLLM's rule: it names the response and is echoed back):
    the first one, as `request.headers.get` finds it, read from the scope's list without building
    Starlette's Headers for a header most requests leave out (ASGI servers lowercase the names)."""
    for name, value in request.scope["headers"]:
        if name == b"x-request-id":
            return value.decode("latin-1")
    return None


async def generate(router, request: Request, kind: str, parse: Parser | None = None,
                   reshape: Reshape | None = None) -> Response:
    """One generation request, from its HTTP request to its response (JSON, or SSE when the
    body asks to stream).

    `router`: the Router (services/router/service.py). `kind`: "completion" or "chat", which
    names the response's shape (text_completion / chat.completion bodies and chunks). `parse`:
    body (parsed JSON) and ModelInfo -> GenerateSpec, raising APIError for a bad body; default
    protocol.parse_completion or parse_chat by `kind` (another API shape, mapped onto one of
    those, brings its own). `reshape`: that API's non-streamed body, from the chat/completion
    body dict (a body whose logprobs the route refuses: it is built in one go)."""
    parse = parse or PARSERS[kind]
    t0 = time.monotonic()
    deadline = asyncio.get_running_loop().time() + router.settings.request_timeout
    request_id = new_room()
    public_id = client_request_id(request)
    with bound_room(request_id), bound_contextvars(**({"client_request_id": public_id} if public_id else {})):
        body_in = False
        try:
            if public_id is not None and not valid_request_id(public_id):
                public_id = None
                raise errors.bad_request(
                    "The X-Request-Id header must be 1 to 128 visible ASCII characters.", code="invalid_value")
            router.check_auth(request)
            router.admission.check_capacity()
            body, size = await router.read_json(request)
            body_in = True
            spec = await parse_spec(parse, body, size, router.info, router.grammar_cost)
            # the slots are taken once the body is in and parsed: a client slow to send holds none
            slots = router.admission.admit(len(spec.prompts) * spec.n)
        except APIError as e:
            if router.settings.log_requests:
                log.info("request rejected", status=e.status, error=e.message[:300])
            if not body_in:
                # what is left of the body would arrive as the connection's next bytes: close it
                e.headers = {**e.headers, "Connection": "close"}
            return router.error_response(e, public_id or request_id)
        except ClientDisconnect:
            router.count(CLIENT_CLOSED)
            return Response(status_code=CLIENT_CLOSED)
        try:
            router.metrics.inc(router.metrics.num_requests)
            router.metrics.inc(router.metrics.prompt_tokens, sum(len(p.prompt_ids) for p in spec.prompts))
            public_id = public_id or spec.request_id or f"{request_id:016x}"
            driver = RequestDriver(router, spec, request_id, t0, deadline, public_id, slots, reshape)
        except BaseException:
            slots.release()
            raise
        if spec.stream:
            return await driver.stream(request)
        return await driver.complete(request)


def register(app: FastAPI, router) -> None:
    """The generation routes on `app`, and on its fast path (services/router/fastpath.py)."""

    @app.post("/v1/completions", openapi_extra=openapi.request_body(openapi.CompletionRequest),
              responses=openapi.error_responses())
    async def completions(request: Request) -> Response:
        """Text completion (JSON, or SSE with "stream": true)."""
        return await generate(router, request, "completion")

    @app.post("/v1/chat/completions", openapi_extra=openapi.request_body(openapi.ChatCompletionRequest),
              responses=openapi.error_responses())
    async def chat_completions(request: Request) -> Response:
        """Chat completion (JSON, or SSE with "stream": true)."""
        return await generate(router, request, "chat")

    @app.post("/invocations", openapi_extra=openapi.request_body(openapi.ChatCompletionRequest,
                                                                 openapi.CompletionRequest),
              responses=openapi.error_responses())
    async def invocations(request: Request) -> Response:
        """SageMaker's inference route (as vLLM's): a chat completion body ("messages") or a completion
        body ("prompt"), answered as /v1/chat/completions or /v1/completions would."""
        return await generate(router, request, "completion", parse=parse_invocation)

    # served without FastAPI's middleware and routing (services/router/fastpath.py); the routes
    # above stay for the OpenAPI schema and for what the fast path leaves to FastAPI
    app.fast_post = {"/v1/completions": completions, "/v1/chat/completions": chat_completions,
                     "/invocations": invocations}
