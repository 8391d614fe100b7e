"""The Response object of OpenAI's Responses API, built from the chat completion that served it.

One chat choice becomes the `output` list: a `reasoning` item holding the reply's reasoning as
one `reasoning_text` part (with --reasoning-parser, when the reply has one), a `message` item
holding the reply's text as one `output_text` part (when there is text, or no other item), then
one `function_call` item per tool call. A reply cut by max_tokens is `incomplete` with reason
`max_output_tokens`. `output_text` is left to the SDK, which derives it from `output`, as OpenAI's
server does.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

# include ["reasoning.encrypted_content"] (Codex and other stateless agents ask for it with
# store false, to send the reasoning back next turn): this server keeps no secret, so the
# "encrypted" content is the reasoning text made opaque — marked, base64url — which it reads back
# from a reasoning item given as input. Not encryption: the same text is in the item's content.
OPAQUE_PREFIX = "pdmesh.r1."


def response_id(chat_id: str) -> str:
    """resp_<the request's id>: the same id the chat completion (and X-Request-Id) carries."""
    return "resp_" + chat_id.split("-", 1)[-1]


def item_ids(rid: str) -> tuple[str, str]:
    """The message item's id and the prefix of the function-call items' ids."""
    suffix = rid[len("resp_"):]
    return "msg_" + suffix, "fc_" + suffix


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": (chat_usage.get("prompt_tokens_details") or {})
                                 .get("cached_tokens", 0)},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": (chat_usage.get("completion_tokens_details") or {})
                                  .get("reasoning_tokens", 0)},
        "total_tokens": chat_usage["total_tokens"],
    }


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [text_part(text)]}


def reasoning_item_id(rid: str) -> str:
    return "rs_" + rid[len("resp_"):]


def opaque_reasoning(text: str) -> str:
    return OPAQUE_PREFIX + base64.urlsafe_b64encode(text.encode()).decode()


def reasoning_of_opaque(token: str) -> str | None:
    """The reasoning an opaque_reasoning() token carries; None for one this server did not make."""
    if not token.startswith(OPAQUE_PREFIX):
        return None
    try:
        return base64.urlsafe_b64decode(token[len(OPAQUE_PREFIX):].encode()).decode()
    except (binascii.Error, ValueError):
        return None


def reasoning_item(item_id: str, text: str, status: str, opaque: bool = False) -> dict[str, Any]:
    """A reply's reasoning (--reasoning-parser): its text whole, as one reasoning_text part; with
    `opaque` (include reasoning.encrypted_content) also as encrypted_content."""
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [],
            "content": [reasoning_part(text)], "encrypted_content": opaque_reasoning(text) if opaque else None}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def envelope(rid: str, created: int, model: str, echo: dict[str, Any], status: str,
             output: list[dict[str, Any]], chat_usage: dict[str, Any] | None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Response object around `output` (its status: in_progress, completed, incomplete, failed)."""
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model,
        "output": output,
        **echo,
        "usage": usage(chat_usage),
    }


def from_chat(chat: dict[str, Any], echo: dict[str, Any], opaque: bool = False) -> dict[str, Any]:
    """The Response object of a (non-streamed) chat completion with one choice; `opaque`: the
    reasoning item carries encrypted_content."""
    rid = response_id(chat["id"])
    msg_id, fc_prefix = item_ids(rid)
    choice = chat["choices"][0]
    message = choice["message"]
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    calls = message.get("tool_calls") or []
    output = []
    if message.get("reasoning") is not None:
        reasoning_status = "incomplete" if status == "incomplete" and message.get("content") is None else "completed"
        output.append(reasoning_item(reasoning_item_id(rid), message["reasoning"], reasoning_status, opaque))
    if message.get("content") or not (calls or message.get("reasoning") is not None):
        output.append(message_item(msg_id, message.get("content") or "", status))
    for i, call in enumerate(calls):
        fn = call["function"]
        output.append(call_item(f"{fc_prefix}_{i}", call["id"], fn["name"], fn["arguments"], "completed"))
    return envelope(rid, chat["created"], chat["model"], echo, status, output, chat.get("usage"))
