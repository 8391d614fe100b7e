"""Anthropic's Messages API request (`POST /v1/messages`, as vLLM and SGLang serve it), translated
into the chat-completions body the router serves.

The translation only builds a chat body: every check of the chat route (model, sampling ranges,
tools, structured output, reasoning, context length) then applies unchanged. What it cannot map
is a 400 naming the Messages field.

What maps where:
  system (a string or text blocks) and any `system` message -> one system message first
  messages: user text blocks -> a user message;  tool_result blocks -> tool messages (ahead of
    the user's text, right after the assistant message that made the calls);  assistant text ->
    content, tool_use -> tool_calls, thinking -> reasoning_content (the chat template's field);
    a final assistant message with text is the reply's beginning (Anthropic's prefill:
    continue_final_message, the reply holds what follows)
  max_tokens (required) -> max_tokens;  stop_sequences -> stop;  temperature, top_p, top_k
  tools [{name, description, input_schema, strict}] -> function tools
  tool_choice {type: auto | any | tool | none, name, disable_parallel_tool_use} -> tool_choice
    auto / required / named / none, parallel_tool_calls false
  thinking {type: enabled, budget_tokens} -> enable_thinking for the chat template and
    thinking_token_budget (needs --reasoning-parser); {type: adaptive} -> enable_thinking, no
    budget; {type: disabled} -> enable_thinking false; display omitted -> include_reasoning false
  output_config {effort, format: {type: json_schema, schema}} (and the older top-level
    output_format) -> reasoning_effort, response_format json_schema
  chat_template_kwargs, cache_salt, priority (vLLM's) -> as on the chat route
  metadata.user_id, service_tier, cache_control (top-level, or on any block or tool):
    informational (the prefix cache keys pages by content whether a block is marked or not)

A tool_result with `is_error: true` reaches the model as "Error: " + its text: chat templates
have no field for it, and the model must see that the call failed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from services.router.errors import APIError, bad_request, each_object, invalid_type
from services.router.getters import get_bool, get_dict, get_int, get_list, get_str, required_str

UINT32_MAX = (1 << 32) - 1
ROLES = ("user", "assistant")
# Claude Code opens its system prompt with a block that differs on every request; kept, it would
# make every request's prompt differ from its first tokens and defeat the prefix cache
PER_REQUEST_SYSTEM_PREFIX = "x-anthropic-billing-header"

# Messages fields this router cannot honour, with why
REFUSED = {
    "container": "code-execution containers are not supported (only custom tools are)",
    "mcp_servers": "MCP servers are not supported; define the tools as custom tools",
    "context_management": "server-side context editing is not supported; send the context to use",
}
TEXT_ONLY = "this model takes text only"


# chat field names in errors -> the Messages fields they came from
CHAT_FIELDS = [
    (re.compile(r"^stop(\[\d+\])?$"), r"stop_sequences\1"),
    (re.compile(r"^(tools\[\d+\])\.function\.parameters"), r"\1.input_schema"),
    (re.compile(r"^(tools\[\d+\])\.function"), r"\1"),
    (re.compile(r"^tool_choice\.function\.name$"), "tool_choice.name"),
    (re.compile(r"^response_format.*$"), "output_config.format"),
    (re.compile(r"^reasoning_effort$"), "output_config.effort"),
    (re.compile(r"^thinking_token_budget$"), "thinking.budget_tokens"),
]
MESSAGE_AT = re.compile(r"^messages\[(\d+)\]")


@dataclass(frozen=True)
class MessagesRequest:
    chat: dict[str, Any]  # the chat-completions body that serves it
    model: str | None  # the model as the client named it, for the reply
    stream: bool
    origins: tuple[str, ...] = ()  # per chat message, the Messages field it came from

    def field(self, chat_param: str) -> str:
        """The Messages field a chat field named in an error came from."""
        for pattern, repl in CHAT_FIELDS:
            if pattern.search(chat_param):
                return pattern.sub(repl, chat_param, count=1)
        at = MESSAGE_AT.match(chat_param)
        if at and int(at.group(1)) < len(self.origins):
            return self.origins[int(at.group(1))]
        return chat_param


def translate(body: Any, *, count_only: bool = False) -> MessagesRequest:
    """The chat body of a Messages request; a 400 naming the field for anything it cannot serve.
    `count_only`: a count_tokens request (no max_tokens, nothing sampled)."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    for name, reason in REFUSED.items():
        if body.get(name) is not None:
            raise bad_request(f"'{name}' is not supported: {reason}.", param=name, code="unsupported_value")
    model = get_str(body, "model", None)
    system = _system(body)
    origins: list[str] = ["system"] * len(system)
    chat: dict[str, Any] = {"model": model, "messages": system + _messages(body, origins)}
    last = chat["messages"][-1]
    if last["role"] == "assistant" and last["content"] and "tool_calls" not in last:
        # Anthropic's prefill: the reply continues the final assistant text rather than starting a turn
        chat["continue_final_message"] = True
    kwargs = get_dict(body, "chat_template_kwargs", None)
    if kwargs is not None:
        chat["chat_template_kwargs"] = dict(kwargs)
    tools = _tools(body)
    if tools:
        chat["tools"] = tools
    _tool_choice(body, chat)
    _thinking(body, chat)
    if count_only:
        return MessagesRequest(chat=chat, model=model, stream=False, origins=tuple(origins))
    max_tokens = get_int(body, "max_tokens", None, 1, UINT32_MAX)
    if max_tokens is None:
        raise bad_request("'max_tokens' is required.", param="max_tokens", code="missing_required_parameter")
    chat["max_tokens"] = max_tokens
    stream = get_bool(body, "stream", False)
    if stream:
        chat["stream"] = True
        # every chunk carries usage: the first gives message_start its input tokens
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list):
            raise invalid_type("stop_sequences", "an array of strings", stops)
        if stops:
            chat["stop"] = stops  # each string and their number checked by the chat route
    for name in ("temperature", "top_p", "top_k", "cache_salt", "priority"):
        if body.get(name) is not None:
            chat[name] = body[name]  # ranges and types checked by the chat route
    _output_config(body, chat)
    metadata = get_dict(body, "metadata", None)
    if metadata is not None:
        _nested(get_str, metadata, "metadata", "user_id", None)  # informational, but still typed
    get_str(body, "service_tier", None)
    return MessagesRequest(chat=chat, model=model, stream=stream, origins=tuple(origins))


# --- system and messages -----------------------------------------------------------------------


def _system(body: dict) -> list[dict[str, Any]]:
    """One system message of the top-level `system` and any message with role system (which
    vLLM takes too), or none."""
    texts = _system_texts(body.get("system"), "system")
    messages = body.get("messages")
    if isinstance(messages, list):
        for i, message in enumerate(messages):
            if isinstance(message, dict) and message.get("role") == "system":
                texts += _system_texts(message.get("content"), f"messages[{i}].content")
    return [{"role": "system", "content": "\n".join(texts)}] if texts else []


def _system_texts(system: Any, where: str) -> list[str]:
    if system is None:
        return []
    if isinstance(system, str):
        return [system] if system else []
    if not isinstance(system, list):
        raise invalid_type(where, "a string or an array of text blocks", system)
    texts = []
    for at, block in each_object(system, where, "a text block object"):
        if block.get("type") != "text":
            raise bad_request(f"'{at}.type' must be 'text' in a system prompt.", param=f"{at}.type",
                              code="invalid_value")
        text = required_str(block, "text", at)
        if not text.startswith(PER_REQUEST_SYSTEM_PREFIX):
            texts.append(text)
    return texts


def _messages(body: dict, origins: list[str]) -> list[dict[str, Any]]:
    """The chat messages; `origins` gets, per message, the Messages field it came from."""
    messages = body.get("messages")
    if messages is None:
        raise bad_request("'messages' is required.", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise invalid_type("messages", "an array", messages)
    out: list[dict[str, Any]] = []
    offset = len(origins)  # the system message's
    for where, message in each_object(messages, "messages", "a message object"):
        role = message.get("role")
        if role == "system":
            continue  # joined into the system message
        if role not in ROLES:
            raise bad_request(f"Invalid value for '{where}.role': {role!r}. Supported values are: user, assistant.",
                              param=f"{where}.role", code="invalid_value")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            (_user if role == "user" else _assistant)(content, f"{where}.content", out)
        else:
            raise invalid_type(f"{where}.content", "a string or an array of content blocks", content)
        origins += [where] * (offset + len(out) - len(origins))
    if not any(m["role"] != "system" for m in out):
        raise bad_request("'messages' must contain at least one user or assistant message.", param="messages",
                          code="empty_array")
    return out


def _user(blocks: list, where: str, out: list[dict[str, Any]]) -> None:
    """A user turn: its tool results first (the template puts them right after the calls), then
    its text, if any."""
    texts = []
    for at, block in each_object(blocks, where, "a content block object"):
        kind = block.get("type")
        if kind == "text":
            texts.append(required_str(block, "text", at))
        elif kind == "tool_result":
            out.append({"role": "tool", "tool_call_id": required_str(block, "tool_use_id", at),
                        "content": _tool_result(block, at)})
        else:
            raise _unsupported_block(kind, at, "text, tool_result")
    if texts or not blocks:
        out.append({"role": "user", "content": "\n".join(texts)})


def _tool_result(block: dict, where: str) -> str:
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for at, part in each_object(content, f"{where}.content", "a content block object"):
            if part.get("type") != "text":
                raise _unsupported_block(part.get("type"), at, "text")
            parts.append(required_str(part, "text", at))
        text = "\n".join(parts)
    else:
        raise invalid_type(f"{where}.content", "a string or an array of text blocks", content)
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise invalid_type(f"{where}.is_error", "a boolean", is_error)
    return "Error: " + text if is_error else text


def _assistant(blocks: list, where: str, out: list[dict[str, Any]]) -> None:
    """An assistant turn: its text, its calls and its thinking are one chat message."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for at, block in each_object(blocks, where, "a content block object"):
        kind = block.get("type")
        if kind == "text":
            texts.append(required_str(block, "text", at))
        elif kind == "thinking":
            thoughts.append(required_str(block, "thinking", at))  # its signature is ours to ignore: never checked
        elif kind == "tool_use":
            calls.append(_tool_use(block, at))
        elif kind == "redacted_thinking":
            raise bad_request(f"'{at}': redacted thinking is encrypted by another provider and cannot be read here; "
                              "leave the block out.", param=f"{at}.type", code="unsupported_value")
        else:
            raise _unsupported_block(kind, at, "text, thinking, tool_use")
    if texts:
        message["content"] = "".join(texts)
    if thoughts:
        message["reasoning_content"] = "".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    out.append(message)


def _tool_use(block: dict, where: str) -> dict[str, Any]:
    arguments = block.get("input")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise invalid_type(f"{where}.input", "an object", arguments)
    return {"id": required_str(block, "id", where), "type": "function",
            "function": {"name": required_str(block, "name", where), "arguments": json.dumps(arguments)}}


def _nested(getter, obj: dict, where: str, name: str, *args: Any) -> Any:
    """`getter` (services/router/getters.py) on a field of a nested object, its errors naming
    the field's whole path."""
    try:
        return getter(obj, name, *args)
    except APIError as e:
        e.param = f"{where}.{name}"
        e.message = e.message.replace(f"'{name}'", f"'{where}.{name}'", 1)
        raise


def _unsupported_block(kind: Any, where: str, allowed: str):
    reason = f"{TEXT_ONLY} ({allowed})" if kind in ("image", "document") else f"supported here: {allowed}"
    return bad_request(f"Content block type {kind!r} is not supported: {reason}.", param=f"{where}.type",
                       code="unsupported_value")


# --- tools, thinking, output -------------------------------------------------------------------


def _tools(body: dict) -> list[dict[str, Any]]:
    out = []
    for where, tool in each_object(get_list(body, "tools", []), "tools", "a tool object"):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise bad_request(f"Tools of type {kind!r} are not supported: Anthropic's server tools run on its "
                              "servers; only custom tools (name, description, input_schema) are.",
                              param=f"{where}.type", code="unsupported_value")
        schema = tool.get("input_schema")
        if schema is None:
            raise bad_request(f"'{where}.input_schema' is required.", param=f"{where}.input_schema",
                              code="missing_required_parameter")
        fn: dict[str, Any] = {"name": tool.get("name"), "parameters": schema}  # checked by the chat route
        for key in ("description", "strict"):
            if tool.get(key) is not None:
                fn[key] = tool[key]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(body: dict, chat: dict[str, Any]) -> None:
    choice = get_dict(body, "tool_choice", None)
    if choice is None:
        return
    kind = choice.get("type")
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": required_str(choice, "name", "tool_choice")}}
    else:
        raise bad_request(f"Invalid value for 'tool_choice.type': {kind!r}. Supported values are: auto, any, tool, "
                          "none.", param="tool_choice.type", code="invalid_value")
    if _nested(get_bool, choice, "tool_choice", "disable_parallel_tool_use", False):
        if kind in ("auto", "any", "tool"):
            chat["parallel_tool_calls"] = False


def _thinking(body: dict, chat: dict[str, Any]) -> None:
    thinking = get_dict(body, "thinking", None)
    if thinking is None:
        return
    kind = thinking.get("type")
    kwargs = chat.setdefault("chat_template_kwargs", {})
    if kind in ("enabled", "adaptive"):
        kwargs.setdefault("enable_thinking", True)
        if kind == "enabled":
            budget = _nested(get_int, thinking, "thinking", "budget_tokens", None, 1, UINT32_MAX)
            if budget is None:
                raise bad_request("'thinking.budget_tokens' is required when thinking is enabled.",
                                  param="thinking.budget_tokens", code="missing_required_parameter")
            chat["thinking_token_budget"] = budget
        display = _nested(get_str, thinking, "thinking", "display", None)
        if display == "omitted":
            chat["include_reasoning"] = False
        elif display not in (None, "summarized"):
            raise bad_request(f"Invalid value for 'thinking.display': {display!r}. Supported values are: summarized, "
                              "omitted.", param="thinking.display", code="invalid_value")
    elif kind == "disabled":
        kwargs.setdefault("enable_thinking", False)
    else:
        raise bad_request(f"Invalid value for 'thinking.type': {kind!r}. Supported values are: enabled, adaptive, "
                          "disabled.", param="thinking.type", code="invalid_value")


def _output_config(body: dict, chat: dict[str, Any]) -> None:
    config = get_dict(body, "output_config", None) or {}
    effort = _nested(get_str, config, "output_config", "effort", None)
    if effort is not None:
        chat["reasoning_effort"] = effort  # its values checked by the chat route
    fmt, where = config.get("format"), "output_config.format"
    if fmt is None and body.get("output_format") is not None:
        fmt, where = body["output_format"], "output_format"
    if fmt is None:
        return
    if not isinstance(fmt, dict):
        raise invalid_type(where, "an object", fmt)
    if fmt.get("type") != "json_schema":
        raise bad_request(f"Invalid value for '{where}.type': {fmt.get('type')!r}. Supported values are: "
                          "json_schema.", param=f"{where}.type", code="invalid_value")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise invalid_type(f"{where}.schema", "an object (a JSON schema)", schema)
    chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
