"""What the router knows of the served model, from its folder and the flags: the names clients
may send, the context length, the tool-call format, the sampling defaults (a `ModelInfo`), and
the bounded grammar compile over its tokenizer."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from services.common.config import RouterSettings
from services.common.logging_setup import get_logger
from services.common.model_name import served_name
from services.common.random_bits import SeededBits, randbits63
from services.common.tokenizer import BUILTIN_NAMES, BUILTIN_RANDOM, Tokenizer, resolve_model_path
from services.router import model_controls, reasoning
from services.router.grammar_cost import GrammarCost
from services.router.limits import RequestLimits
from services.router.protocol import ModelInfo
from services.router.tool_parsers import FORMATS, detect_tool_parser

log = get_logger("router")

# services/engine/builtin_model.py's values (the router must not import torch, so they are repeated)
BUILTIN_CONTEXT_LENGTH = 8192
DEFAULT_CONTEXT_LENGTH = 4096  # what the engine assumes when config.json does not say


def context_length(model: str) -> int:
    """max_position_embeddings of the model folder's config.json (8192 for the built-in model)."""
    if model in BUILTIN_NAMES:
        return BUILTIN_CONTEXT_LENGTH
    path = Path(model) / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return DEFAULT_CONTEXT_LENGTH
    for source in (cfg, cfg.get("text_config") or {}):
        value = source.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_CONTEXT_LENGTH


def tool_parser(flag: str, tokenizer: Tokenizer) -> str | None:
    """The tool-call format replies are parsed in: the flag's, or (auto) the one the chat template
    shows (its tool_use template first); None: tools are refused unless tool_choice is none."""
    if flag == "none":
        return None
    if flag in FORMATS:
        return flag
    if flag != "auto":
        raise ValueError(f"unknown tool-call parser {flag!r}")
    return detect_tool_parser([tokenizer.tool_chat_template])


def grammar_cost(settings: RouterSettings, tokenizer: Tokenizer) -> GrammarCost | None:
    """The bounded compile of requests' grammars, over the served model's tokenizer; None (grammars
    then go to the workers unmeasured, which still bound each step) when llguidance cannot read it."""
    source = settings.tokenizer or settings.model
    folder = Path(resolve_model_path(source)) if source != BUILTIN_RANDOM else None
    try:
        return GrammarCost(tokenizer, folder if folder is not None and folder.is_dir() else None,
                           settings.grammar_compile_budget, settings.grammar_mask_budget)
    except Exception:  # noqa: BLE001 - logged; the workers' per-step budget still holds
        log.exception("grammar cost checks disabled: llguidance could not read the tokenizer")
        return None


def served_model(settings: RouterSettings, tokenizer: Tokenizer,
                 capacity: Callable[[], int | None]) -> tuple[list[str], ModelInfo]:
    """The names clients may send (the first names responses) and the model's ModelInfo;
    `capacity`: tokens the largest healthy decode's KV pool holds (bounds a default max_tokens)."""
    names = model_controls.served_names(settings.model, settings.served_model_name, served_name(settings.model))
    aliases = frozenset({settings.model, *names[1:],
                         *(BUILTIN_NAMES[1:] if settings.model in BUILTIN_NAMES else ())}) - {""}
    info = ModelInfo(name=names[0], tokenizer=tokenizer,
                     context_length=model_controls.max_model_len(settings.max_model_len,
                                                                 context_length(settings.model)),
                     aliases=aliases, tool_parser=tool_parser(settings.tool_call_parser, tokenizer),
                     defaults={**model_controls.generation_defaults(settings.model, settings.generation_config),
                               **model_controls.generation_overrides(settings.override_generation_config)},
                     capacity=capacity, root=settings.model,
                     force_include_usage=settings.enable_force_include_usage,
                     tokens_as_ids=settings.return_tokens_as_token_ids,
                     reasoning_parser=reasoning.parser_name(settings.reasoning_parser),
                     auto_tool_choice=settings.enable_auto_tool_choice,
                     response_role=settings.response_role,
                     scheduling_policy=settings.scheduling_policy,
                     draw_seed=SeededBits(settings.seed + settings.process_index) if settings.seed >= 0
                     else randbits63,
                     max_logprobs=model_controls.max_logprobs(settings.max_logprobs),
                     adapters=model_controls.lora_adapters(settings.enable_lora, settings.lora_modules,
                                                           {*names, *aliases},
                                                           settings.allow_runtime_lora_updating,
                                                           settings.processes),
                     limits=RequestLimits(settings.max_grammar_bytes, settings.max_request_worker_bytes))
    return names, info
