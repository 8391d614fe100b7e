"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API (as vLLM and SGLang
serve it), served by the chat route's machinery.

The body is translated into a chat-completions body (messages_request.py) as the parse step of
generation_routes.generate, after the same checks as every generation request (API key — sent
as `x-api-key`, as Anthropic's clients do, or as a bearer token —, admission, body limits); the
chat completion that comes back, with its fail-over, migration, tool parsing, reasoning split and
structured output, is then rewritten: JSON into a Message (messages_output.py), SSE chunks into
the Messages event stream (messages_stream.py). Errors keep their status and take Anthropic's
body, `{"type": "error", "error": {"type", "message"}}`, the field named as the Messages request
spells it. `anthropic-version` and `anthropic-beta` headers are accepted and change nothing.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.router import generation_routes, openapi
from services.router.errors import APIError
from services.router.extra_routes import chat_prompt_ids, serve_json
from services.router.messages_output import error_body, error_type, from_chat
from services.router.messages_request import MessagesRequest, translate
from services.router.messages_stream import translate_sse
from services.router.protocol import parse_chat
from services.router.sse import SSEResponse

_SKIPPED_HEADERS = ("content-length", "content-type")


def in_messages_terms(error: APIError, req: MessagesRequest) -> APIError:
    """A refusal of the chat body, naming the Messages field it came from."""
    if error.param:
        field = req.field(error.param)
        error.message = error.message.replace(f"'{error.param}'", f"'{field}'")
        error.param = field
    return error


def anthropic_error(response: Response) -> Response:
    """An error response (OpenAI's body) in Anthropic's shape, its status and headers kept; the
    field it names leads the message, as Anthropic's errors name it."""
    try:
        error = json.loads(response.body)["error"]
        message, param = str(error["message"]), error.get("param")
    except (ValueError, KeyError, TypeError, AttributeError):
        message, param = "The request failed.", None
    if isinstance(param, str) and param:
        message = f"{param}: {message}"
    headers = {k: v for k, v in response.headers.items() if k not in _SKIPPED_HEADERS}
    return JSONResponse(error_body(error_type(response.status_code), message), status_code=response.status_code,
                        headers=headers)


def register(app: FastAPI, router: Any) -> None:
    """Add the Messages routes to `app`, served by `router` (services.router.service.Router)."""
    info = router.info

    @app.post("/v1/messages", openapi_extra=openapi.request_body(openapi.MessagesRequest),
              responses=openapi.error_responses())
    async def messages(request: Request) -> Response:
        """A model reply (Anthropic's Messages API): a Message, or typed SSE events with "stream": true."""
        seen: list[MessagesRequest] = []

        def parse(body: Any, model_info: Any):
            req = translate(body)
            seen.append(req)
            try:
                return parse_chat(req.chat, model_info)
            except APIError as e:
                raise in_messages_terms(e, req) from None

        response = await generation_routes.generate(router, request, "chat", parse,
                                                    reshape=lambda chat: from_chat(chat, seen[0].model))
        if isinstance(response, SSEResponse):
            response.events = translate_sse(response.events, seen[0].model)
            return response
        if response.status_code >= 400 and response.body:
            return anthropic_error(response)
        return response  # 200: already the Message (from_chat over the chat body dict)

    def count(body: Any) -> dict[str, Any]:
        req = translate(body, count_only=True)
        try:
            return {"input_tokens": len(chat_prompt_ids(req.chat, info))}
        except APIError as e:
            raise in_messages_terms(e, req) from None

    @app.post("/v1/messages/count_tokens", openapi_extra=openapi.request_body(openapi.CountTokensRequest),
              responses={200: {"description": "{input_tokens}"}})
    async def count_tokens(request: Request) -> Response:
        """The prompt's tokens for a Messages request (its system, messages and tools), as the
        chat template renders them; nothing is generated."""
        response = await serve_json(router, request, count)
        return anthropic_error(response) if response.status_code >= 400 else response
