"""Structured output requests: OpenAI's `response_format` and vLLM's extras, as one grammar.

- `response_format`: `{"type": "text"}` (nothing), `{"type": "json_object"}` (any JSON object),
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`.
- vLLM's extras, for what OpenAI has no field for: `structured_outputs` (an object with exactly
  one of `json`, `regex`, `choice`, `grammar` — Lark, in llguidance's dialect) and the older
  spellings `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

At most one of them per request. The grammar is compiled here once (a bad schema or regex is a
400 naming the field), then the workers constrain every token with it (services/engine/grammar.py).
"""

from __future__ import annotations

import json
from typing import Any

from services.common.grammar_spec import choice_grammar, validate
from services.router.errors import bad_request, invalid_type
from services.router.limits import DEFAULT_LIMITS, RequestLimits, check_grammar_size

ANY_JSON_OBJECT = '{"type": "object"}'
EXTRA_KINDS = ("json", "regex", "choice", "grammar")
LEGACY_FIELDS = {f"guided_{kind}": kind for kind in EXTRA_KINDS}


def _response_format(fmt: Any) -> tuple[str, str] | None:
    if not isinstance(fmt, dict):
        raise invalid_type("response_format", "an object", fmt)
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_schema", ANY_JSON_OBJECT
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format of type 'json_schema' needs a 'json_schema' object.",
                              param="response_format.json_schema", code="invalid_value")
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("'response_format.json_schema.name' must be a non-empty string.",
                              param="response_format.json_schema.name", code="invalid_value")
        if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
            raise invalid_type("response_format.json_schema.strict", "a boolean", spec["strict"])
        schema = spec.get("schema", {})  # OpenAI: without a schema, any JSON
        if not isinstance(schema, dict):
            raise invalid_type("response_format.json_schema.schema", "an object", schema)
        return "json_schema", json.dumps(schema)
    raise bad_request(f"response_format type must be 'text', 'json_object' or 'json_schema', not {kind!r}.",
                      param="response_format.type", code="invalid_value")


def _extra(kind: str, value: Any, param: str) -> tuple[str, str]:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise bad_request(f"'{param}' is not valid JSON.", param=param, code="invalid_value") from None
        if not isinstance(value, dict):
            raise invalid_type(param, "a JSON schema object", value)
        return "json_schema", json.dumps(value)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise invalid_type(param, "a non-empty array of non-empty strings", value)
        return choice_grammar(value)
    if not isinstance(value, str) or not value:
        raise invalid_type(param, "a non-empty string", value)
    return ("regex" if kind == "regex" else "lark"), value


def structured_output(body: dict, ignore_eos: bool, limits: RequestLimits = DEFAULT_LIMITS) -> tuple[str, str] | None:
    """The request's grammar as (kind, source), or None. Raises APIError (400)."""
    found = structured_output_field(body, ignore_eos, limits)
    return found[1] if found is not None else None


def structured_output_field(body: dict, ignore_eos: bool,
                            limits: RequestLimits = DEFAULT_LIMITS) -> tuple[str, tuple[str, str]] | None:
    """The field that carries the request's grammar and the grammar, or None. Raises APIError (400)."""
    found: list[tuple[str, tuple[str, str]]] = []
    if body.get("response_format") is not None:
        grammar = _response_format(body["response_format"])
        if grammar is not None:
            found.append(("response_format", grammar))
    extras = body.get("structured_outputs")
    if extras is not None:
        if not isinstance(extras, dict):
            raise invalid_type("structured_outputs", "an object", extras)
        given = [k for k in EXTRA_KINDS if extras.get(k) is not None]
        if len(given) > 1:
            raise bad_request(f"'structured_outputs' takes one of {', '.join(EXTRA_KINDS)}, got {', '.join(given)}.",
                              param="structured_outputs", code="invalid_value")
        found += [("structured_outputs", _extra(k, extras[k], f"structured_outputs.{k}")) for k in given]
    for field, kind in LEGACY_FIELDS.items():
        if body.get(field) is not None:
            found.append((field, _extra(kind, body[field], field)))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(f"'{f}'" for f, _ in found)
        raise bad_request(f"Only one structured output constraint per request; got {names}.",
                          param=found[1][0], code="invalid_value")
    param, (kind, source) = found[0]
    check_grammar_size(source, param, limits)
    if ignore_eos:
        raise bad_request("'ignore_eos' cannot be combined with structured output: the grammar ends the output.",
                          param="ignore_eos", code="unsupported_value")
    why = validate(kind, source)
    if why:
        raise bad_request(f"Invalid '{param}': {why.strip()}", param=param, code="invalid_value")
    return param, (kind, source)
