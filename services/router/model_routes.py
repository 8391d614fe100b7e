"""GET /v1/models and /v1/models/{id}: the served model under each name clients may send, and
each LoRA adapter (--lora-modules), whose card names the base model as its parent, as vLLM's.
POST /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's runtime LoRA updates, with the
router's --allow-runtime-lora-updating (services/router/lora_updates.py); a 200 answers vLLM's
plain-text sentence."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from services.router import errors, openapi
from services.router.errors import APIError, bad_request
from services.router.getters import get_bool, get_str


def model_card(router, name: str) -> dict[str, Any]:
    """`router`: the Router (services/router/service.py)."""
    return {
        "id": name,
        "object": "model",
        "created": router.created,
        "owned_by": "pdmesh",
        # vLLM's: what the served names were loaded from (the --model value), and no base model
        "root": router.info.root or router.info.name,
        "parent": None,
        "max_model_len": router.info.context_length,
        # pdmesh extension: the format tool calls are parsed in (null: tools only with tool_choice none)
        "tool_call_parser": router.info.tool_parser,
        # and the reasoning parser chat replies are split by (null: none, replies whole)
        "reasoning_parser": router.info.reasoning_parser,
    }


def adapter_card(router, name: str) -> dict[str, Any]:
    """A LoRA adapter's card: vLLM's root (its folder) and parent (the base model's name)."""
    return {**model_card(router, name), "root": router.info.adapters[name], "parent": router.info.name}


def cards(router) -> list[dict[str, Any]]:
    return [model_card(router, n) for n in router.names] + [adapter_card(router, n) for n in router.info.adapters]


def register(app: FastAPI, router) -> None:
    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            router.check_auth(request)
        except APIError as e:
            return router.error_response(e)
        router.count(200)
        return JSONResponse({"object": "list", "data": cards(router)})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        try:
            router.check_auth(request)
            info = router.info
            if model_id != info.name and model_id not in info.aliases and model_id not in info.adapters:
                raise errors.model_not_found(model_id, info.name, list(info.adapters))
        except APIError as e:
            return router.error_response(e)
        router.count(200)
        if model_id in router.info.adapters:
            return JSONResponse(adapter_card(router, model_id))
        return JSONResponse(model_card(router, model_id if model_id in router.names else router.info.name))

    @app.post("/v1/load_lora_adapter", responses=openapi.error_responses())
    async def load_lora_adapter(request: Request) -> Response:
        """Load a LoRA adapter on every worker under a name ({"lora_name", "lora_path"}), as vLLM's."""
        try:
            router.check_auth(request)
            name, path = await _lora_body(router, request, with_path=True)
            await router.lora_updates.load(name, path)
        except APIError as e:
            return router.error_response(e)
        router.count(200)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", responses=openapi.error_responses())
    async def unload_lora_adapter(request: Request) -> Response:
        """Unload a LoRA adapter ({"lora_name"}), as vLLM's: no new request may name it."""
        try:
            router.check_auth(request)
            name, _ = await _lora_body(router, request, with_path=False)
            await router.lora_updates.unload(name)
        except APIError as e:
            return router.error_response(e)
        router.count(200)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def _lora_body(router, request: Request, with_path: bool) -> tuple[str, str]:
    """vLLM's bodies: lora_name (and, to load, lora_path), each a non-empty string."""
    body, _ = await router.read_json(request)
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    name = get_str(body, "lora_name", "")
    path = get_str(body, "lora_path", "") if with_path else ""
    if with_path and get_bool(body, "load_inplace", False):
        raise bad_request("'load_inplace' is not supported: unload the adapter, then load it again.",
                          param="load_inplace", code="unsupported_value")
    needed = ("lora_name", "lora_path") if with_path else ("lora_name",)
    if not name or (with_path and not path):
        raise bad_request(f"{' and '.join(repr(n) for n in needed)} must be provided.",
                          param="lora_name" if not name else "lora_path", code="missing_required_parameter")
    return name, path
