"""`tools` and `tool_choice` of a chat request: validation, the grammar of a forced call, and
the tool-related message fields (an assistant's `tool_calls`, a tool message's `tool_call_id`).

Pure functions like protocol.py (which calls them): every bad input is an OpenAI-style 400.
The reply's calls are parsed by services/router/tool_parsers.py in the format the router's
`--tool-call-parser` names (by default detected from the chat template).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.common.grammar_spec import validate
from services.common.tokenizer import Tokenizer
from services.router.errors import bad_request, each_object, invalid_type
from services.router.limits import DEFAULT_LIMITS, RequestLimits, check_grammar_size
from services.router.tool_parsers import get_format

MAX_TOOLS = 128  # OpenAI's limit
NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required")
FORCED_JSON_PARSER = "llama3_json"  # the format of a forced call on a model that shows none
# JSON inside a forced call is written the way json.dumps (and so the chat template's tojson)
# writes it: ", " and ": ", no other whitespace. Models saw that layout in their prompts, and a
# model cannot pad the arguments with whitespace forever. A schema's own "x-guidance" wins.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]  # a JSON schema of an object


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict[str, Any]]  # as the client sent them: the chat template renders these
    choice: str  # "none" | "auto" | "required" | "function" (a named function)
    forced_name: str | None  # the named function of tool_choice
    parallel: bool
    parser: str | None  # the reply's format, None when the reply is not parsed (tool_choice none)
    grammar: tuple[str, str] | None  # ("lark", source) forcing the call(s), for required / named


def _missing(param: str):
    return bad_request(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")


def _field(obj: dict, key: str, where: str, kind: type, expected: str) -> Any:
    """obj[key], which must be there and be a `kind` (`expected` names it in the 400)."""
    value = obj.get(key)
    if value is None:
        raise _missing(f"{where}.{key}")
    if not isinstance(value, kind):
        raise invalid_type(f"{where}.{key}", expected, value)
    return value


def _function_type(obj: dict, where: str) -> None:
    """obj["type"] must be "function", the one kind of tool OpenAI has."""
    kind = obj.get("type")
    if kind is None:
        raise _missing(f"{where}.type")
    if kind != "function":
        raise bad_request(f"Invalid value for '{where}.type': {kind!r}. Supported values are: 'function'.",
                          param=f"{where}.type", code="invalid_value")


def _parse_tool(i: int, tool: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise invalid_type(where, "an object", tool)
    _function_type(tool, where)
    fn = _field(tool, "function", where, dict, "an object")
    name = _field(fn, "name", f"{where}.function", str, "a string")
    if not NAME_PATTERN.match(name):
        raise bad_request(
            f"Invalid '{where}.function.name': string does not match pattern. Expected a string that matches "
            f"the pattern '{NAME_PATTERN.pattern}'.", param=f"{where}.function.name", code="invalid_value")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid_type(f"{where}.function.description", "a string", description)
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid_type(f"{where}.function.strict", "a boolean", strict)
    params = fn.get("parameters")
    if params is None:
        return Tool(name, NO_ARGUMENTS)
    if not isinstance(params, dict):
        raise invalid_type(f"{where}.function.parameters", "an object (a JSON schema)", params)
    kind = params.get("type", "object")
    if kind != "object":
        raise bad_request(
            f"Invalid schema for function '{name}': schema must be a JSON Schema of 'type: \"object\"', "
            f"got 'type: {json.dumps(kind)}'.", param=f"{where}.function.parameters", code="invalid_value")
    return Tool(name, {**params, "type": "object"})


def _parse_choice(body: dict, names: list[str]) -> tuple[str, str | None]:
    choice = body.get("tool_choice")
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise bad_request(
                f"Invalid value for 'tool_choice': {choice!r}. Supported values are: 'none', 'auto', 'required', "
                "or an object naming a function.", param="tool_choice", code="invalid_value")
        return choice, None
    if not isinstance(choice, dict):
        raise invalid_type("tool_choice", "a string or an object", choice)
    _function_type(choice, "tool_choice")
    fn = _field(choice, "function", "tool_choice", dict, "an object")
    name = _field(fn, "name", "tool_choice.function", str, "a string")
    if names and name not in names:
        raise bad_request(
            f"Invalid value for 'tool_choice': no function named '{name}' was specified in 'tools' "
            f"(the functions are: {', '.join(names)}).", param="tool_choice.function.name", code="invalid_value")
    return "function", name


def parse_tools(body: dict, parser: str | None, tokenizer: Tokenizer | None = None,
                limits: RequestLimits = DEFAULT_LIMITS, auto: bool = True) -> ToolRequest | None:
    """The request's tools, or None when it has none. `parser`: the served model's tool-call
    format (None when its chat template shows none); `tokenizer`: the model's, for the grammar;
    `auto`: whether tool_choice auto is served (--enable-auto-tool-choice)."""
    for old in ("functions", "function_call"):
        if body.get(old) is not None:
            raise bad_request(f"The deprecated '{old}' parameter is not supported; send 'tools' and 'tool_choice'.",
                              param=old, code="unsupported_value")
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise invalid_type("tools", "an array", raw)
    if raw is not None and not raw:
        raise bad_request("Invalid 'tools': empty array. Expected an array with minimum length 1, but got an "
                          "empty array instead.", param="tools", code="empty_array")
    if raw is not None and len(raw) > MAX_TOOLS:
        raise bad_request(f"Invalid 'tools': array too long. Expected an array with maximum length {MAX_TOOLS}, "
                          f"but got an array with length {len(raw)} instead.", param="tools", code="array_above_max_length")
    tools = [_parse_tool(i, t) for i, t in enumerate(raw or [])]
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise bad_request(f"Duplicate function name '{tool.name}' in 'tools' (tools[{seen[tool.name]}] and "
                              f"tools[{i}]).", param=f"tools[{i}].function.name", code="invalid_value")
        seen[tool.name] = i
    names = list(seen)
    choice, forced = _parse_choice(body, names)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid_type("parallel_tool_calls", "a boolean", parallel)
    if not tools:
        if choice != "none":
            raise bad_request("Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are "
                              "specified.", param="tool_choice", code="invalid_value")
        if parallel is not None:
            raise bad_request("Invalid value for 'parallel_tool_calls': 'parallel_tool_calls' is only allowed when "
                              "'tools' are specified.", param="parallel_tool_calls", code="invalid_value")
        return None
    parallel = True if parallel is None else parallel
    if choice == "none":
        # rendered (the model sees what it may not call, as vLLM does), never parsed
        return ToolRequest(raw or [], choice, None, parallel, None, None)
    if choice == "auto" and not auto:
        raise bad_request(
            "tool_choice 'auto' (the default when 'tools' are given) is turned off on this server "
            "(--no-enable-auto-tool-choice); send tool_choice 'required', a named function or 'none'.",
            param="tool_choice", code="unsupported_value")
    if parser is None and choice in ("required", "function"):
        # a model whose template shows no format (the built-in one) can still be made to call: the
        # grammar forces plain JSON calls, {"name": ..., "parameters": {...}} (vLLM forces JSON too)
        parser = FORCED_JSON_PARSER
    if parser is None:
        raise bad_request(
            "Tool calling with tool_choice 'auto' is not supported with this model: its chat template shows no "
            "tool-call format the router can parse (hermes, llama3_json). Start the router with "
            "--tool-call-parser to name one, or send tool_choice 'required', a named function or 'none'.",
            param="tools", code="unsupported_value")
    grammar = None
    if choice in ("required", "function"):
        chosen = [t for t in tools if t.name == forced] if forced else tools
        grammar = ("lark", tool_grammar(parser, chosen, parallel=parallel and choice == "required",
                                        tokenizer=tokenizer, limits=limits))
    return ToolRequest(raw, choice, forced, parallel, parser, grammar)


# --- the grammar of a forced call ------------------------------------------------------------


def _arguments_schema(tool: Tool) -> dict[str, Any]:
    schema = dict(tool.parameters)
    schema.setdefault("x-guidance", JSON_LAYOUT)
    return schema


def marker_term(tokenizer: Tokenizer | None) -> Callable[[str], str]:
    """How a grammar spells a format's marker (<tool_call>): `<[id]>` when the tokenizer has it
    as one token, else a string. llguidance treats every added token of a tokenizer.json as
    atomic, special or not, so the string "<tool_call>" would never match the model's token."""
    def term(text: str) -> str:
        if tokenizer is not None:
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=False) == text:
                return f"<[{ids[0]}]>"
        return json.dumps(text)
    return term


def tool_grammar(parser: str, tools: list[Tool], parallel: bool, tokenizer: Tokenizer | None = None,
                 limits: RequestLimits = DEFAULT_LIMITS) -> str:
    """A Lark grammar (llguidance's dialect) for a reply that is one call of one of `tools` — or,
    with `parallel`, one or more — in the format `parser`, each call's arguments following its
    function's parameters schema. Raises a 400 when a schema cannot be compiled, or when the
    schemas together pass --max-grammar-bytes (checked before anything is compiled)."""
    fmt = get_format(parser)
    marker = marker_term(tokenizer)
    schemas = [json.dumps(_arguments_schema(tool)) for tool in tools]
    check_grammar_size("".join(schemas), "tools", limits)
    lines = []
    for k, (tool, schema_text) in enumerate(zip(tools, schemas, strict=True)):
        error = validate("json_schema", schema_text)
        if error:
            raise bad_request(f"The parameters schema of function '{tool.name}' cannot be enforced: {error.strip()}",
                              param="tools", code="invalid_value")
        lines.append(f"call_{k}: {fmt.call_text(tool.name, f'args_{k}', marker)}")
        lines.append(f"args_{k}: %json {schema_text}")
    lines.append("call: " + " | ".join(f"call_{k}" for k in range(len(tools))))
    source = "\n".join([f"start: {fmt.calls_rule('call', parallel)}", *lines]) + "\n"
    error = validate("lark", source)
    if error:  # each schema compiled alone: a fault of ours, said plainly rather than a 500 later
        raise bad_request(f"The tool-call grammar does not compile: {error.strip()}", param="tools",
                          code="invalid_value")
    return source


# --- messages ---------------------------------------------------------------------------------


def check_tool_fields(message: dict[str, Any], where: str) -> dict[str, Any]:
    """A message's tool fields validated (an assistant's `tool_calls`, a tool message's
    `tool_call_id`), with each call's `arguments` JSON string turned into the object chat
    templates expect (they write it with tojson, as transformers documents)."""
    role = message.get("role")
    if role == "tool":
        _field(message, "tool_call_id", where, str, "a string")
    calls = message.get("tool_calls")
    if calls is None:
        return message
    if role != "assistant":
        raise bad_request(f"'{where}.tool_calls' is only allowed in messages with role 'assistant'.",
                          param=f"{where}.tool_calls", code="invalid_value")
    if not isinstance(calls, list):
        raise invalid_type(f"{where}.tool_calls", "an array", calls)
    out = []
    for at, call in each_object(calls, f"{where}.tool_calls"):
        _field(call, "id", at, str, "a string")
        _function_type(call, at)
        fn = _field(call, "function", at, dict, "an object")
        _field(fn, "name", f"{at}.function", str, "a string")
        args = _field(fn, "arguments", f"{at}.function", object, "a string")
        if isinstance(args, str):
            try:
                decoded = json.loads(args)
            except ValueError:
                decoded = None
            if isinstance(decoded, dict):
                args = decoded
        elif not isinstance(args, dict):
            raise invalid_type(f"{at}.function.arguments", "a string", args)
        out.append({**call, "function": {**fn, "arguments": args}})
    return {**message, "tool_calls": out}
