"""POST /v1/responses: OpenAI's Responses API, stateless, served by the chat route's machinery.

The body is translated into a chat-completions body (responses_request.py) as the parse step of
generation_routes.generate, after the same checks as every generation request (API key,
admission, body limits);
the chat completion that comes back — with its fail-over, migration, tool parsing and
structured output — is then rewritten: JSON into a Response object (responses_output.py), SSE
chunks into the Responses event stream (responses_stream.py). Errors keep their status and
OpenAI error body, with `param` named as the Responses request spells it. A response the client
asked to store (store defaults to true with a store) is kept once it completed or was cut by
max_output_tokens, streamed or not; a failed one is not.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.common.random_bits import randbits63
from services.router import generation_routes, openapi
from services.router.errors import APIError
from services.router.protocol import parse_chat
from services.router.responses_output import from_chat
from services.router.responses_request import ResponsesRequest, translate
from services.router.responses_store import ResponsesStore
from services.router.responses_stream import translate_sse
from services.router.sse import SSEResponse

# chat field names in errors -> the Responses fields they came from
_PARAMS = [
    (re.compile(r"^(max_tokens|max_completion_tokens)$"), "max_output_tokens"),
    (re.compile(r"^messages(\[\d+\])?.*$"), "input"),
    (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
    (re.compile(r"^reasoning_effort$"), "reasoning.effort"),
    (re.compile(r"^(tools\[\d+\])\.function"), r"\1"),
    (re.compile(r"^tool_choice\.function"), "tool_choice"),
]
_SKIPPED_HEADERS = ("content-length", "content-type")


def responses_param(param: str) -> str:
    for pattern, repl in _PARAMS:
        if pattern.search(param):
            return pattern.sub(repl, param, count=1)
    return param


def _headers(response: Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k not in _SKIPPED_HEADERS}


def _error(response: Response) -> Response:
    """A refusal of the chat route, its param renamed."""
    try:
        body = json.loads(response.body)
        param = body["error"].get("param")
    except (ValueError, KeyError, TypeError, AttributeError):
        return response
    if isinstance(param, str):
        body["error"]["param"] = responses_param(param)
    return JSONResponse(body, status_code=response.status_code, headers=_headers(response))


def make_store(settings: Any) -> ResponsesStore | None:
    """The router's stored responses (None: --responses-store-size 0, stateless)."""
    if settings.responses_store_size < 0:
        raise ValueError(f"--responses-store-size must be 0 or more, got {settings.responses_store_size}")
    if settings.responses_store_size == 0:
        return None
    if settings.processes > 1:
        raise ValueError("--responses-store-size needs --processes 1: the stored responses live in one router "
                         "process's memory, and a follow-up reaching another process would not find its response")
    return ResponsesStore(settings.responses_store_size, settings.responses_store_bytes)


def listed(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as OpenAI lists it: with an id, a message's text as one text part."""
    out = {"id": f"msg_{randbits63():016x}", **item}
    if out.get("type", "message") == "message" and isinstance(out.get("content"), str):
        kind = "output_text" if out.get("role") == "assistant" else "input_text"
        out = {**out, "type": "message", "content": [{"type": kind, "text": out["content"]}]}
    return out


def keep(store: ResponsesStore | None, req: ResponsesRequest, response: dict[str, Any]) -> None:
    """Store a finished Response with its own input and the conversation a follow-up continues
    (when asked: `req.store` is never set without a store)."""
    if store is None or not req.store or response.get("status") not in ("completed", "incomplete"):
        return
    items = [listed(item) for item in req.input_items]
    store.put(response, items, req.context + list(response["output"]))


def _not_stored(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id[:128]}' not found.", param="response_id",
                    code="response_not_found")


def register(app: FastAPI, router: Any) -> None:
    """Add POST /v1/responses to `app`, served by `router` (services.router.service.Router), and
    the stored responses' routes."""
    store = make_store(router.settings)

    @app.post("/v1/responses", openapi_extra=openapi.request_body(openapi.ResponsesRequest),
              responses=openapi.error_responses())
    async def responses(request: Request) -> Response:
        """A model response (OpenAI's Responses API): JSON, or typed SSE events with "stream": true.
        Stored with --responses-store-size (store, previous_response_id), else stateless."""
        seen: list[ResponsesRequest] = []

        def parse(body: Any, info: Any):
            req = translate(body, store)
            seen.append(req)
            return parse_chat(req.chat, info)

        def reshape(chat: dict[str, Any]) -> dict[str, Any]:
            out = from_chat(chat, seen[0].echo, seen[0].opaque_reasoning)
            keep(store, seen[0], out)
            return out

        response = await generation_routes.generate(router, request, "chat", parse, reshape=reshape)
        if isinstance(response, SSEResponse):
            response.events = translate_sse(response.events, seen[0].echo, lambda out: keep(store, seen[0], out),
                                            seen[0].opaque_reasoning)
            return response
        if response.status_code >= 400:
            return _error(response) if response.body else response
        return response  # 200: already the Response object (from_chat over the chat body dict)

    def stored(request: Request, response_id: str):
        router.check_auth(request)
        entry = store.get(response_id) if store is not None else None
        if entry is None:
            raise _not_stored(response_id)
        return entry

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Response:
        """A stored response (--responses-store-size)."""
        try:
            entry = stored(request, response_id)
        except APIError as e:
            return router.error_response(e)
        return JSONResponse(entry.response)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        """Forget a stored response; a follow-up naming it is then a 404."""
        try:
            stored(request, response_id)
        except APIError as e:
            return router.error_response(e)
        store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(request: Request, response_id: str) -> Response:
        """The input items a stored response was asked with, as OpenAI lists them: `order` desc
        (the default) or asc, `limit` 1-100 (20), `after` an item id."""
        try:
            entry = stored(request, response_id)
            query = request.query_params
            order = query.get("order", "desc")
            if order not in ("asc", "desc"):
                raise APIError(400, "'order' must be 'asc' or 'desc'.", param="order", code="invalid_value")
            limit = query.get("limit", "20")
            if not limit.isdigit() or not 1 <= int(limit) <= 100:
                raise APIError(400, "'limit' must be an integer from 1 to 100.", param="limit", code="invalid_value")
        except APIError as e:
            return router.error_response(e)
        items = entry.input_items if order == "asc" else entry.input_items[::-1]
        after = query.get("after")
        if after is not None:
            ids = [item.get("id") for item in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        page = items[:int(limit)]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)})
