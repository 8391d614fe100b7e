"""vLLM's utility endpoints beside the OpenAI API: /tokenize, /detokenize, /version, /ping.

Shapes are vLLM's. `POST /tokenize` takes a completions-style `prompt` (one string or token-id
list; `add_special_tokens`, default true) or a chat-style `messages` (rendered exactly as
/v1/chat/completions renders them: chat_template, add_generation_prompt, continue_final_message,
tools, ...) and answers `{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs` only
with `return_token_strs`). `POST /detokenize` takes `tokens` and answers `{"prompt": text}`.
`GET /version` answers `{"version"}`; `GET`/`POST /ping` answer 200 with an empty body while the
router runs (a liveness probe: /health says whether workers are there). The two POST routes
need the API key when one is set, read their body under --max-body-bytes, and check `model`
when it is given.
"""

from __future__ import annotations

import asyncio
import tomllib
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.router import errors
from services.router.errors import APIError
from services.router.getters import get_bool, is_int
from services.router.prompts import chat_prompt, check_ids, truncate
from services.router.protocol import completion_prompt, served_model
from services.router.request_body import PARSE_IN_THREAD_BYTES
from services.router.tools import parse_tools

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def version() -> str:
    """The installed package's version, else pyproject.toml's (run from the source tree)."""
    try:
        return metadata.version("pdmesh")
    except metadata.PackageNotFoundError:
        try:
            return tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["version"]
        except (OSError, KeyError, ValueError):
            return "unknown"


async def serve_json(router: Any, request: Request, handler: Callable[[Any], dict[str, Any]]) -> Response:
    """A request answered from its JSON body alone, without the workers: API key, the body under
    the router's bounds, then `handler(body)` (in a thread when the body is large or brings its
    own chat template, which may take a while to render); an APIError is its error response."""
    try:
        router.check_auth(request)
        body, size = await router.read_json(request)
        if size > PARSE_IN_THREAD_BYTES or (isinstance(body, dict) and body.get("chat_template") is not None):
            out = await asyncio.to_thread(handler, body)
        else:
            out = handler(body)
    except APIError as e:
        return router.error_response(e)
    router.count(200)
    return JSONResponse(out)


def chat_prompt_ids(body: dict, info: Any) -> list[int]:
    """The prompt ids of a chat body as the chat route renders it (its model checked): what
    /tokenize and the Messages API's count_tokens report."""
    served_model(body, info)
    return chat_prompt(body, info.tokenizer, parse_tools(body, info.tool_parser, info.tokenizer))


def register(app: FastAPI, router: Any) -> None:
    """Add the routes to `app`, served by `router` (services.router.service.Router)."""
    info = router.info

    def tokenize(body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise errors.bad_request("The request body must be a JSON object.", code="invalid_json")
        if "messages" in body:
            ids = chat_prompt_ids(body, info)
        else:
            served_model(body, info)
            ids = completion_prompt(body, info.tokenizer).ids
        ids = truncate(ids, body, info.context_length)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": info.context_length, "tokens": ids,
                               "token_strs": None}
        if get_bool(body, "return_token_strs", False):
            out["token_strs"] = [router.token_strings.get(t)[0] for t in ids]
        return out

    def detokenize(body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise errors.bad_request("The request body must be a JSON object.", code="invalid_json")
        served_model(body, info)
        tokens = body.get("tokens")
        if tokens is None:
            raise errors.bad_request("You must provide tokens.", param="tokens", code="missing_required_parameter")
        if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
            raise errors.invalid_type("tokens", "an array of token ids", tokens)
        if tokens:
            check_ids(tokens, info.tokenizer.vocab_size, "tokens")
        return {"prompt": info.tokenizer.decode(tokens, skip_special_tokens=False)}

    @app.post("/tokenize", responses={200: {"description": "{count, max_model_len, tokens, token_strs}"}})
    async def tokenize_route(request: Request) -> Response:
        """vLLM's /tokenize: a prompt or chat messages → token ids."""
        return await serve_json(router, request, tokenize)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        """vLLM's /detokenize: token ids → text."""
        return await serve_json(router, request, detokenize)

    @app.get("/version")
    async def version_route() -> Response:
        return JSONResponse({"version": version()})

    async def ping() -> Response:
        """Liveness: 200 while the router serves HTTP."""
        return Response(status_code=200)

    # one route per method: one route with both gives both operations the same operationId in
    # /openapi.json, which OpenAPI client generators refuse
    for method in ("GET", "POST"):
        app.add_api_route("/ping", ping, methods=[method], operation_id=f"ping_ping_{method.lower()}")
