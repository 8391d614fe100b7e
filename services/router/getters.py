"""Typed getters for request fields: a wrong type or range is an OpenAI-style 400 naming the field."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from services.router.errors import bad_request, invalid_type


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _typed(body: dict, name: str, default: Any, ok: Callable[[Any], bool], expected: str) -> Any:
    """The field's value, `default` when it is absent or null; one that is not `expected` fails the
    request."""
    v = body.get(name)
    if v is None:
        return default
    if not ok(v):
        raise invalid_type(name, expected, v)
    return v


def get_int(body: dict, name: str, default: Any, lo: int | None = None, hi: int | None = None) -> Any:
    v = _typed(body, name, None, is_int, "an integer")
    if v is None:
        return default
    if lo is not None and v < lo:
        raise bad_request(f"'{name}' must be at least {lo}, got {v}.", param=name, code="invalid_value")
    if hi is not None and v > hi:
        raise bad_request(f"'{name}' must be at most {hi}, got {v}.", param=name, code="invalid_value")
    return v


def get_float(body: dict, name: str, default: Any, lo: float | None = None, hi: float | None = None) -> Any:
    v = _typed(body, name, None, is_number, "a number")
    if v is None:
        return default
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad_request(
            f"'{name}' must be between {lo:g} and {hi:g}, got {v}.", param=name, code="invalid_value"
        )
    return float(v)


def get_bool(body: dict, name: str, default: bool) -> bool:
    return _typed(body, name, default, lambda v: isinstance(v, bool), "a boolean")


def get_str(body: dict, name: str, default: Any) -> Any:
    return _typed(body, name, default, lambda v: isinstance(v, str), "a string")


def get_list(body: dict, name: str, default: Any) -> Any:
    return _typed(body, name, default, lambda v: isinstance(v, list), "an array")


def get_dict(body: dict, name: str, default: Any) -> Any:
    return _typed(body, name, default, lambda v: isinstance(v, dict), "an object")


def required_str(obj: dict, key: str, where: str) -> str:
    """A nested object's string field that must be there (`where` names the object, as
    `input[2]`): absent or null, or not a string, is a 400 naming `where.key`."""
    value = obj.get(key)
    if value is None:
        raise bad_request(f"'{where}.{key}' is required.", param=f"{where}.{key}", code="missing_required_parameter")
    if not isinstance(value, str):
        raise invalid_type(f"{where}.{key}", "a string", value)
    return value
