"""OpenAI's Responses API request, translated into the chat-completions body the router serves.

Stateless by default: nothing is stored, so `store` may only be absent or false, and
`previous_response_id` is a 400 naming the field. With a store (`--responses-store-size`,
services/router/responses_store.py) `store` defaults to true, as OpenAI's, and
`previous_response_id` continues a stored response: its conversation (every earlier turn's items
and its output) comes before this request's input; its instructions do not carry over, as in
OpenAI's API. What needs more than that (`conversation` objects, `background`, item references,
stored `prompt` templates) is a 400 naming the field either way. The translation only builds a
chat body; every check of the chat route (model, sampling ranges, tools, structured output,
context length) then applies unchanged, so both routes accept exactly the same things.

What maps where:
  input (a string, or message / function_call / function_call_output items) -> messages
  instructions -> a system message first;  max_output_tokens -> max_tokens
  tools [{type: function, name, ...}] -> [{type: function, function: {name, ...}}];  tool_choice likewise
  text.format {type: json_object | json_schema, name, schema, strict} -> response_format
  reasoning.effort -> reasoning_effort (handed to the chat template, as the chat route does)
  cache_salt, priority (vLLM's) -> cache_salt, priority
  metadata, user, safety_identifier, prompt_cache_key, service_tier, stream_options: informational
Fields neither Responses nor vLLM defines are ignored, as on the other routes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.router.errors import APIError, bad_request, each_object, invalid_type
from services.router.getters import get_bool, get_int, get_list, get_str, required_str
from services.router.responses_output import reasoning_of_opaque
from services.router.responses_store import ResponsesStore

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
ENCRYPTED_REASONING = "reasoning.encrypted_content"  # the one `include` value served
TEXT_PARTS = ("input_text", "output_text")
UINT32_MAX = (1 << 32) - 1

# Responses fields this router cannot honour, with the value(s) that mean "not asked for"
STATELESS = ("this server stores no responses (the router's --responses-store-size is 0); send the whole "
             "conversation as 'input'")
REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "conversation": ("this server is stateless and stores no conversations; send the whole conversation "
                     "as 'input'", (None,)),
    "background": ("background responses need stored responses, and this server stores none", (None, False)),
    "prompt": ("stored prompt templates are not supported; send the prompt as 'input'", (None,)),
    "max_tool_calls": ("a cap on built-in tool calls is not supported (only function tools are)", (None,)),
    "top_logprobs": ("logprobs are not returned on this endpoint (use /v1/chat/completions)", (None, 0)),
    "truncation": ("only 'disabled' is supported: a prompt over the context is refused, not cut", (None, "disabled")),
}


@dataclass(frozen=True)
class ResponsesRequest:
    chat: dict[str, Any]  # the chat-completions body that serves it
    echo: dict[str, Any]  # the request's settings, as the Response object repeats them
    stream: bool
    store: bool = False  # keep the Response (a store is configured and the request did not say no)
    opaque_reasoning: bool = False  # include ["reasoning.encrypted_content"]
    input_items: list[dict[str, Any]] = field(default_factory=list)  # its own input, as items
    context: list[dict[str, Any]] = field(default_factory=list)  # the previous response's conversation + input_items


def translate(body: Any, store: ResponsesStore | None = None) -> ResponsesRequest:
    """The chat body of a Responses request; a 400 naming the field for anything it cannot serve.
    `store`: the router's stored responses (None: stateless)."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    _refuse(body, store is not None)
    opaque = _opaque_reasoning(body)
    stream = get_bool(body, "stream", False)
    keep = store is not None and get_bool(body, "store", True)
    previous = get_str(body, "previous_response_id", None)
    earlier: list[dict[str, Any]] = []
    if previous is not None:
        stored = store.get(previous) if store is not None else None
        if stored is None:
            raise APIError(404, f"Previous response with id '{previous[:128]}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
        earlier = stored.conversation
    items = _input_items(body)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": _messages(body, earlier, items)}
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}  # the final event carries usage
    max_output = get_int(body, "max_output_tokens", None, 1, UINT32_MAX)
    if max_output is not None:
        chat["max_tokens"] = max_output
    for name in ("temperature", "top_p", "cache_salt", "priority"):
        if body.get(name) is not None:
            chat[name] = body[name]  # ranges and types checked by the chat route
    tools = _tools(body)
    if tools:
        chat["tools"] = tools
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    parallel = get_bool(body, "parallel_tool_calls", True)
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = parallel
    text = _text(body.get("text"))
    fmt = _response_format(text.get("format"))
    if fmt is not None:
        chat["response_format"] = fmt
    reasoning = _reasoning(body.get("reasoning"))
    if reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        get_str(body, name, None)  # informational, but still typed
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise invalid_type("metadata", "an object", metadata)
    echo = {
        "instructions": body.get("instructions"),
        "max_output_tokens": max_output,
        "metadata": metadata or {},
        "parallel_tool_calls": parallel,
        "temperature": chat.get("temperature", 1.0),
        "top_p": chat.get("top_p", 1.0),
        "tool_choice": body.get("tool_choice") if body.get("tool_choice") is not None else "auto",
        "tools": body.get("tools") or [],
        "text": {"format": text.get("format") or {"type": "text"}},
        "reasoning": {"effort": reasoning.get("effort"), "summary": None},
        "store": keep,
        "background": False,
        "previous_response_id": previous,
        "truncation": "disabled",
        "user": body.get("user"),
    }
    return ResponsesRequest(chat=chat, echo=echo, stream=stream, store=keep, input_items=items,
                            context=earlier + items, opaque_reasoning=opaque)


def _opaque_reasoning(body: dict) -> bool:
    """`include`: only reasoning.encrypted_content is served (whether it is asked)."""
    include = get_list(body, "include", None) or []
    for extra in include:
        if extra != ENCRYPTED_REASONING:
            raise bad_request(f"'include' value {str(extra)[:64]!r} is not supported; only "
                              f"'{ENCRYPTED_REASONING}' is.", param="include", code="unsupported_value")
    return ENCRYPTED_REASONING in include


def _refuse(body: dict, stored: bool) -> None:
    if not stored:
        if body.get("store") is not None and get_bool(body, "store", False):
            raise bad_request(f"'store' must be false or absent: {STATELESS}.", param="store",
                              code="unsupported_value")
        if body.get("previous_response_id") is not None:
            raise bad_request(f"'previous_response_id' is not supported: {STATELESS}.",
                              param="previous_response_id", code="unsupported_value")
    for name, (reason, defaults) in REFUSED.items():
        value = body.get(name)
        if not any(value is d if d is None or isinstance(d, bool) else value == d for d in defaults):
            raise bad_request(f"'{name}' is not supported: {reason}.", param=name, code="unsupported_value")


# --- input -> messages ------------------------------------------------------------------------


def _input_items(body: dict) -> list[dict[str, Any]]:
    """The request's `input` as a list of items (a string is one user message)."""
    items = body.get("input")
    if items is None:
        raise bad_request("You must provide an input.", param="input", code="missing_required_parameter")
    if isinstance(items, str):
        return [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list):
        raise invalid_type("input", "a string or an array of input items", items)
    if not items:
        raise bad_request("'input' must contain at least one item.", param="input", code="empty_array")
    return items


def _messages(body: dict, earlier: list[dict[str, Any]], items: list[Any]) -> list[dict[str, Any]]:
    """The chat messages: the instructions first, then a stored conversation's items (`earlier`),
    then the request's own."""
    out: list[dict[str, Any]] = []
    instructions = get_str(body, "instructions", None)
    if instructions is not None:
        out.append({"role": "system", "content": instructions})
    named = [("previous_response_id", item) for item in earlier] + [(f"input[{i}]", item) for i, item in enumerate(items)]
    for where, item in named:
        if not isinstance(item, dict):
            raise invalid_type(where, "an input item object", item)
        kind = item.get("type", "message")
        if kind == "message":
            _add_message(_message(item, where), out)
        elif kind == "reasoning":
            out.append({"role": "assistant", "content": None, "reasoning_content": _reasoning_text(item, where)})
        elif kind == "function_call":
            _function_call(item, where, out)
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": required_str(item, "call_id", where),
                        "content": _output_text(item.get("output"), f"{where}.output")})
        elif kind == "item_reference":
            raise bad_request(f"'{where}': item references are not supported; send the item itself.",
                              param=f"{where}.type", code="unsupported_value")
        else:
            raise bad_request(f"Input items of type {kind!r} are not supported; only 'message', 'reasoning', "
                              "'function_call' and 'function_call_output' are.", param=f"{where}.type",
                              code="unsupported_value")
    return out


def _message(item: dict, where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise bad_request(f"Invalid value for '{where}.role': {role!r}. Supported values are: "
                          f"{', '.join(MESSAGE_ROLES)}.", param=f"{where}.role", code="invalid_value")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise invalid_type(f"{where}.content", "a string or an array of content parts", content)
    texts = []
    for at, part in each_object(content, f"{where}.content", "a content part object"):
        kind = part.get("type")
        if kind == "refusal" and role == "assistant":
            texts.append(required_str(part, "refusal", at))
        elif kind in TEXT_PARTS:
            texts.append(required_str(part, "text", at))
        else:
            raise bad_request(f"Content part type {kind!r} is not supported: this model takes text only "
                              f"({', '.join(TEXT_PARTS)}).", param=f"{at}.type", code="unsupported_value")
    return {"role": role, "content": "".join(texts)}


def _add_message(message: dict[str, Any], out: list[dict[str, Any]]) -> None:
    """An assistant message right after that reply's reasoning item joins it: one chat message."""
    last = out[-1] if out else None
    if (message["role"] == "assistant" and last is not None and last["role"] == "assistant"
            and last["content"] is None and "reasoning_content" in last and "tool_calls" not in last):
        last["content"] = message["content"]
    else:
        out.append(message)


def _reasoning_text(item: dict, where: str) -> str:
    """An earlier reply's reasoning item, as given back: its reasoning_text parts (a summary,
    which this server never writes, is not the reasoning and is left out)."""
    sealed = item.get("encrypted_content")
    if sealed is not None:
        text = reasoning_of_opaque(sealed) if isinstance(sealed, str) else None
        if text is None:
            raise bad_request(f"'{where}.encrypted_content' was not made by this server (another provider's "
                              "encrypted reasoning cannot be read here); send its content instead.",
                              param=f"{where}.encrypted_content", code="invalid_value")
        if not item.get("content"):
            return text
    content = item.get("content") or []
    if not isinstance(content, list):
        raise invalid_type(f"{where}.content", "an array of reasoning_text parts", content)
    texts = []
    for at, part in each_object(content, f"{where}.content", "a content part object"):
        if part.get("type") != "reasoning_text":
            raise bad_request(f"Reasoning content part type {part.get('type')!r} is not supported; only "
                              "'reasoning_text' is.", param=f"{at}.type", code="unsupported_value")
        texts.append(required_str(part, "text", at))
    return "".join(texts)


def _function_call(item: dict, where: str, out: list[dict[str, Any]]) -> None:
    """A call the model made earlier: joins the assistant message just before it (a reply's text
    and its calls are one chat message), or opens one."""
    call = {"id": required_str(item, "call_id", where), "type": "function",
            "function": {"name": required_str(item, "name", where), "arguments": required_str(item, "arguments", where)}}
    last = out[-1] if out else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _output_text(output: Any, where: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        texts = []
        for j, part in enumerate(output):
            if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
                raise bad_request(f"'{where}[{j}]' must be an input_text part: this model takes text only.",
                                  param=f"{where}[{j}]", code="unsupported_value")
            texts.append(required_str(part, "text", f"{where}[{j}]"))
        return "".join(texts)
    raise invalid_type(where, "a string or an array of input_text parts", output)


# --- tools, text, reasoning -------------------------------------------------------------------


def _tools(body: dict) -> list[dict[str, Any]]:
    out = []
    for where, tool in each_object(get_list(body, "tools", []), "tools", "a tool object"):
        if tool.get("type") != "function":
            raise bad_request(f"Tools of type {tool.get('type')!r} are not supported; only 'function' tools are.",
                              param=f"{where}.type", code="unsupported_value")
        fn = {"name": tool.get("name")}  # its checks are the chat route's (named tools[i].function.*)
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                fn[key] = tool[key]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice  # none / auto / required, checked by the chat route
    if not isinstance(choice, dict):
        raise invalid_type("tool_choice", "a string or an object", choice)
    if choice.get("type") != "function":
        raise bad_request(f"tool_choice of type {choice.get('type')!r} is not supported; send 'none', 'auto', "
                          "'required' or {\"type\": \"function\", \"name\": ...}.", param="tool_choice.type",
                          code="unsupported_value")
    return {"type": "function", "function": {"name": required_str(choice, "name", "tool_choice")}}


def _text(text: Any) -> dict[str, Any]:
    if text is None:
        return {}
    if not isinstance(text, dict):
        raise invalid_type("text", "an object", text)
    verbosity = text.get("verbosity")
    if verbosity not in (None, "medium"):
        raise bad_request("'text.verbosity' is not supported (only 'medium', the default).", param="text.verbosity",
                          code="unsupported_value")
    return text


def _response_format(fmt: Any) -> dict[str, Any] | None:
    """text.format in chat's response_format shape (the flat json_schema fields nested under it)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid_type("text.format", "an object", fmt)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {"name": required_str(fmt, "name", "text.format")}
        for key in ("schema", "strict", "description"):
            if fmt.get(key) is not None:
                schema[key] = fmt[key]
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request(f"Invalid value for 'text.format.type': {kind!r}. Supported values are: text, json_object, "
                      "json_schema.", param="text.format.type", code="invalid_value")


def _reasoning(reasoning: Any) -> dict[str, Any]:
    if reasoning is None:
        return {}
    if not isinstance(reasoning, dict):
        raise invalid_type("reasoning", "an object", reasoning)
    for name in ("summary", "generate_summary"):
        if reasoning.get(name) is not None:
            raise bad_request(f"'reasoning.{name}' is not supported: no reasoning parser is configured, so there is "
                              "no reasoning to summarise.", param=f"reasoning.{name}", code="unsupported_value")
    get_str(reasoning, "effort", None)
    return reasoning
