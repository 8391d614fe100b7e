"""GET /v1/models and /v1/models/{id}: the served model under each name clients may send, and
each LoRA adapter (--lora-modules), whose card names the base model as its parent, as vLLM's."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.router import errors
from services.router.errors import APIError


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
