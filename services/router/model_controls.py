"""The served model's controls with vLLM's names: --served-model-name (several), --max-model-len,
--chat-template, --generation-config. Read once at start; pure apart from reading the model folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.common.tokenizer import BUILTIN_RANDOM, GENERATION_CONFIG_FILE, resolve_model_path
from services.router.protocol import GENERATION_DEFAULTS

GENERATION_CONFIG_CHOICES = ("auto", "vllm")  # or a folder holding generation_config.json


def served_names(model: str, explicit: list[str] | str, default_name: str) -> list[str]:
    """The names clients may send as `model`, the first the primary one (responses and metrics
    carry it): --served-model-name's, else the model folder's name."""
    names = [explicit] if isinstance(explicit, str) else list(explicit)
    names = [n for n in dict.fromkeys(names) if n]
    return names or [default_name]


def max_model_len(flag: int, model_limit: int) -> int:
    """--max-model-len (0: the model's own limit); more than the model's limit is an error, as vLLM's."""
    if flag < 0:
        raise ValueError(f"--max-model-len must be positive, got {flag}")
    if flag > model_limit:
        raise ValueError(f"--max-model-len {flag} is more than the model's max_position_embeddings ({model_limit})")
    return flag or model_limit


def chat_template(flag: str) -> str | None:
    """--chat-template: a file holding a Jinja template, or the template itself; empty: the model's."""
    if not flag:
        return None
    path = Path(flag)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"--chat-template {flag!r} cannot be read: {e}") from e
    if "{" not in flag:
        raise ValueError(f"--chat-template {flag!r} is neither a file nor a Jinja template")
    return flag


def generation_defaults(model: str, flag: str = "auto") -> dict[str, Any]:
    """vLLM's --generation-config: "auto" applies the model folder's generation_config.json sampling
    defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens → max_tokens),
    "vllm" none, a folder that folder's file. A request's own value always wins."""
    if flag == "vllm":
        return {}
    if flag == "auto":
        if model == BUILTIN_RANDOM:
            return {}  # the random built-in model has no folder
        folder = Path(resolve_model_path(model))
    else:
        folder = Path(flag)
    path = folder / GENERATION_CONFIG_FILE
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read: {e}") from e
    out = {}
    for key, field in GENERATION_DEFAULTS.items():
        value = cfg.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[field] = value
    return out
