"""POST /v1/responses: OpenAI's Responses API, stateless, served by the chat route's machinery.

The body is translated into a chat-completions body (responses_request.py) as the parse step of
generation_routes.generate, after the same checks as every generation request (API key,
admission, body limits);
the chat completion that comes back — with its fail-over, migration, tool parsing and
structured output — is then rewritten: JSON into a Response object (responses_output.py), SSE
chunks into the Responses event stream (responses_stream.py). Errors keep their status and
OpenAI error body, with `param` named as the Responses request spells it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.router import generation_routes, openapi
from services.router.protocol import parse_chat
from services.router.responses_output import from_chat
from services.router.responses_request import ResponsesRequest, translate
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


def register(app: FastAPI, router: Any) -> None:
    """Add POST /v1/responses to `app`, served by `router` (services.router.service.Router)."""

    @app.post("/v1/responses", openapi_extra=openapi.request_body(openapi.ResponsesRequest),
              responses=openapi.error_responses())
    async def responses(request: Request) -> Response:
        """A model response (OpenAI's Responses API; stateless, nothing stored): JSON, or typed SSE
        events with "stream": true."""
        seen: list[ResponsesRequest] = []

        def parse(body: Any, info: Any):
            req = translate(body)
            seen.append(req)
            return parse_chat(req.chat, info)

        response = await generation_routes.generate(router, request, "chat", parse,
                                                    reshape=lambda chat: from_chat(chat, seen[0].echo))
        if isinstance(response, SSEResponse):
            response.events = translate_sse(response.events, seen[0].echo)
            return response
        if response.status_code >= 400:
            return _error(response) if response.body else response
        return response  # 200: already the Response object (from_chat over the chat body dict)
