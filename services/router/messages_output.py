"""The Message object of Anthropic's Messages API, and its error bodies, built from what the chat
route returned.

One chat choice becomes the `content` list: a `thinking` block (with --reasoning-parser, when the
reply has a thought), a `text` block (when the reply has text), then one `tool_use` block per
tool call. `stop_reason`: `tool_use` when there are calls, `stop_sequence` (naming it) when one
of `stop_sequences` ended the reply, `max_tokens` when max_tokens cut it, else `end_turn`.
Usage as Anthropic counts it: `input_tokens` are the prompt tokens computed for this request, the
ones the prefix cache supplied are `cache_read_input_tokens` (the prompt is their sum; pages are
cached without being asked, so `cache_creation_input_tokens` is 0).
"""

from __future__ import annotations

import json
from typing import Any

# Anthropic's error `type` per status (clients key on the status; the SDK names its exceptions by it)
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
# the chat stream's error event names the OpenAI type; the same failure, as Anthropic names it
_FROM_OPENAI_TYPE = {
    "invalid_request_error": "invalid_request_error",
    "rate_limit_error": "rate_limit_error",
    "service_unavailable_error": "overloaded_error",
    "timeout_error": "timeout_error",
}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


def stream_error(chat_error: dict[str, Any]) -> dict[str, Any]:
    """An error event's body, from the chat stream's `error` object."""
    kind = _FROM_OPENAI_TYPE.get(str(chat_error.get("type")), "api_error")
    return error_body(kind, str(chat_error.get("message") or "The request failed."))


def message_id(chat_id: str) -> str:
    """msg_<the request's id>: the same id the chat completion (and X-Request-Id) carries."""
    return "msg_" + chat_id.split("-", 1)[-1]


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    chat_usage = chat_usage or {}
    prompt = chat_usage.get("prompt_tokens", 0)
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": chat_usage.get("completion_tokens", 0)}


def stop_reason(finish_reason: str | None, chat_stop_reason: Any, has_calls: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a reply the chat route ended with `finish_reason` and its
    vLLM `stop_reason` (the matched stop string, or a stop token's id)."""
    if finish_reason is None:
        return None, None
    if has_calls or finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(chat_stop_reason, str):
        return "stop_sequence", chat_stop_reason
    return "end_turn", None


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object tool_use carries (the tool parsers give JSON objects;
    anything else is wrapped rather than lost)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def thinking_block(text: str) -> dict[str, Any]:
    # this server signs nothing: the signature is empty, and one sent back is not checked
    return {"type": "thinking", "thinking": text, "signature": ""}


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def tool_use_block(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}


def envelope(mid: str, model: str, content: list[dict[str, Any]], reason: tuple[str | None, str | None],
             chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason[0], "stop_sequence": reason[1], "usage": usage(chat_usage)}


def from_chat(chat: dict[str, Any], model: str | None) -> dict[str, Any]:
    """The Message of a (non-streamed) chat completion with one choice."""
    choice = chat["choices"][0]
    message = choice["message"]
    calls = message.get("tool_calls") or []
    content = []
    if message.get("reasoning"):
        content.append(thinking_block(message["reasoning"]))
    if message.get("content"):
        content.append(text_block(message["content"]))
    for call in calls:
        fn = call["function"]
        content.append(tool_use_block(call["id"], fn["name"], tool_input(fn["arguments"])))
    reason = stop_reason(choice["finish_reason"], choice.get("stop_reason"), bool(calls))
    return envelope(message_id(chat["id"]), model or chat["model"], content, reason, chat.get("usage"))
