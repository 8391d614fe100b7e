"""The served model's controls with vLLM's names: --served-model-name (several), --max-model-len,
--chat-template, --generation-config, --override-generation-config, --max-logprobs. Read once at
start; pure apart from reading the model folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.common.lora_modules import parse_lora_modules
from services.common.sampling_params import api_fields
from services.common.tokenizer import BUILTIN_RANDOM, GENERATION_CONFIG_FILE, resolve_model_path
from services.router.protocol import GENERATION_DEFAULTS, MAX_LOGPROBS

GENERATION_CONFIG_CHOICES = ("auto", "vllm")  # or a folder holding generation_config.json
# --override-generation-config: each key's (least, most, whole numbers only): the range a request's
# own field is held to, so that an override never turns every request leaving the field out into a 400
_API = {name: (api, isinstance(default, int)) for name, default, api in api_fields()}
OVERRIDE_RANGES: dict[str, tuple[float, float, bool]] = {
    key: (_API[field][0].lo, _API[field][0].hi if _API[field][0].hi is not None else 1 << 31, _API[field][1])
    for key, field in GENERATION_DEFAULTS.items() if field in _API}
OVERRIDE_RANGES["max_new_tokens"] = (1, 1 << 31, True)


def served_names(model: str, explicit: list[str] | str, default_name: str) -> list[str]:
    """The names clients may send as `model`, the first the primary one (responses and metrics
    carry it): --served-model-name's, else the model folder's name."""
    names = [explicit] if isinstance(explicit, str) else list(explicit)
    names = [n for n in dict.fromkeys(names) if n]
    return names or [default_name]


def lora_adapters(enabled: bool, values: list[str], model_names: set[str], runtime: bool = False,
                  processes: int = 1) -> dict[str, str]:
    """--lora-modules as name -> folder; as vLLM, they need --enable-lora, and an adapter may not
    take a name of the base model (a request could not tell them apart). `runtime`:
    --allow-runtime-lora-updating, which needs --enable-lora and one process (whose list it changes)."""
    modules = parse_lora_modules(values)
    if modules and not enabled:
        raise ValueError("--lora-modules needs --enable-lora (as vLLM's)")
    if runtime and not enabled:
        raise ValueError("--allow-runtime-lora-updating needs --enable-lora")
    if runtime and processes > 1:
        raise ValueError("--allow-runtime-lora-updating needs --processes 1: each process would keep its own "
                         "list of adapters")
    clash = next((m.name for m in modules if m.name in model_names), None)
    if clash is not None:
        raise ValueError(f"--lora-modules: the adapter name {clash!r} is a name of the base model")
    return {m.name: m.path for m in modules}


def max_model_len(flag: int, model_limit: int) -> int:
    """--max-model-len (0: the model's own limit); more than the model's limit is an error, as vLLM's."""
    if flag < 0:
        raise ValueError(f"--max-model-len must be positive, got {flag}")
    if flag > model_limit:
        raise ValueError(f"--max-model-len {flag} is more than the model's max_position_embeddings ({model_limit})")
    return flag or model_limit


def max_logprobs(flag: int) -> int:
    """--max-logprobs: 0 to the workers' own most (vLLM's -1, the whole vocabulary, they cannot return)."""
    if not 0 <= flag <= MAX_LOGPROBS:
        raise ValueError(f"--max-logprobs must be between 0 and {MAX_LOGPROBS} (the workers return at most "
                         f"{MAX_LOGPROBS} alternatives a token), got {flag}")
    return flag


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


def generation_overrides(flag: str) -> dict[str, Any]:
    """vLLM's --override-generation-config: a JSON object of generation_config.json's sampling keys
    that sets or replaces --generation-config's defaults (with `vllm`, they are the only defaults),
    keyed by request field. An unknown key or a value out of its range ends the router at start."""
    if not flag:
        return {}
    try:
        cfg = json.loads(flag)
    except ValueError as e:
        raise ValueError(f"--override-generation-config is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError("--override-generation-config must be a JSON object, e.g. '{\"temperature\": 0.5}'")
    unknown = sorted(set(cfg) - set(OVERRIDE_RANGES))
    if unknown:
        raise ValueError(f"--override-generation-config: unknown key(s) {', '.join(unknown)}; "
                         f"known: {', '.join(OVERRIDE_RANGES)}")
    out = {}
    for key, value in cfg.items():
        least, most, whole = OVERRIDE_RANGES[key]
        number = isinstance(value, int if whole else (int, float)) and not isinstance(value, bool)
        if not number or not least <= value <= most or (key == "repetition_penalty" and value == 0):
            kind = "a whole number" if whole else "a number"
            raise ValueError(f"--override-generation-config: {key} must be {kind} from {least} to {most}, "
                             f"got {value!r}")
        out[GENERATION_DEFAULTS[key]] = value
    return out
