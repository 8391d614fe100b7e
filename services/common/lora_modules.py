"""vLLM's --lora-modules values, read into (name, folder) pairs: torch-free, for the router (which
lists and accepts the adapters) and the workers (which load them, services/engine/lora.py)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass


class LoraError(ValueError):
    """An adapter that cannot be served; the message names its folder and what is wrong."""


@dataclass(frozen=True)
class LoraModule:
    """One served adapter as the flag names it: `name=path`."""

    name: str
    path: str


def parse_lora_modules(values: Iterable[str]) -> list[LoraModule]:
    """vLLM's --lora-modules forms: `name=path`, or JSON `{"name": ..., "path": ...}` (its
    `base_model_name` is accepted: there is one base model)."""
    out: list[LoraModule] = []
    for value in values:
        value = value.strip()
        if not value:
            continue
        if value.startswith("{"):
            try:
                raw = json.loads(value)
            except json.JSONDecodeError as e:
                raise LoraError(f"--lora-modules: {value!r} is not valid JSON ({e.msg})") from None
            if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not isinstance(raw.get("path"), str):
                raise LoraError(f"--lora-modules: {value!r} needs string fields name and path")
            name, path = raw["name"], raw["path"]
        else:
            name, sep, path = value.partition("=")
            if not sep:
                raise LoraError(f"--lora-modules: {value!r} is not name=path")
        if not name or not path:
            raise LoraError(f"--lora-modules: {value!r} needs a name and a path")
        if any(m.name == name for m in out):
            raise LoraError(f"--lora-modules: the name {name!r} is given twice")
        out.append(LoraModule(name, path))
    return out
