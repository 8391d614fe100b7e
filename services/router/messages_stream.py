"""The Messages API's stream of events, made from the chat route's SSE chunks.

The chat stream is asked with continuous usage, so its first chunk already gives the prompt's
tokens for `message_start`. Each chunk's deltas become Anthropic's events, in its order:

  message_start (the Message with empty content, its input usage)
  per block: content_block_start, content_block_delta... (text_delta, thinking_delta, or the
             call's arguments as input_json_delta), content_block_stop
  message_delta (stop_reason, stop_sequence, usage), message_stop

A thought (--reasoning-parser) is a `thinking` block, the reply's text a `text` block, each tool
call a `tool_use` block; a new kind of delta closes the open block. An error after the stream
began (one the router could not migrate away) is an `error` event, and the stream ends; the
chat stream's keep-alive comments pass through (Anthropic's clients skip comment lines as they
skip its `ping` events).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from services.router import messages_output as out
from services.router.chat_sse_rewrite import rewrite
from services.router.json_codec import dumps


def event(kind: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + dumps({"type": kind, **payload}) + b"\n\n"


class EventStream:
    def __init__(self, model: str | None):
        self.model = model
        self.started = False
        self.index = -1  # of the open block; blocks are numbered from 0 in the order they open
        self.open: str | None = None  # the open block's kind: thinking, text or tool_use
        self.calls: dict[int, int] = {}  # chat tool-call index -> its block's index
        self.has_calls = False
        self.finish_reason: str | None = None
        self.chat_stop_reason: Any = None
        self.usage: dict[str, Any] | None = None
        self.ended = False

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        """The events of one chat chunk (an error chunk ends the stream)."""
        if self.ended:
            return []
        if "error" in chunk:
            return self._fail(chunk["error"])
        events: list[bytes] = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if not self.started:
            self.started = True
            message = out.envelope(out.message_id(chunk["id"]), self.model or chunk["model"], [], (None, None),
                                   self.usage)
            message["usage"]["output_tokens"] = 0
            events.append(event("message_start", {"message": message}))
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                events += self._delta("thinking", {"type": "thinking_delta", "thinking": delta["reasoning"]})
            if delta.get("content"):
                events += self._delta("text", {"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.chat_stop_reason = choice.get("stop_reason")
        return events

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        events = self._close()
        self.index += 1
        self.open = kind
        events.append(event("content_block_start", {"index": self.index, "content_block": block}))
        return events

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def _delta(self, kind: str, delta: dict[str, Any]) -> list[bytes]:
        events = []
        if self.open != kind:
            events += self._open(kind, out.thinking_block("") if kind == "thinking" else out.text_block(""))
        events.append(event("content_block_delta", {"index": self.index, "delta": delta}))
        return events

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        events = []
        index = call.get("index", 0)
        fn = call.get("function") or {}
        if self.calls.get(index) != self.index:  # a new call (a call's deltas come together)
            self.has_calls = True
            events += self._open("tool_use", out.tool_use_block(call.get("id") or "", fn.get("name") or "", {}))
            self.calls[index] = self.index
        if fn.get("arguments"):
            events.append(event("content_block_delta", {
                "index": self.index, "delta": {"type": "input_json_delta", "partial_json": fn["arguments"]}}))
        return events

    def finish(self) -> list[bytes]:
        """The closing events, once the chat stream ended."""
        if self.ended:
            return []
        if not self.started:  # nothing came at all: cannot happen after a 200, but end properly
            return self._fail({"message": "The stream ended before any output."})
        self.ended = True
        events = self._close()
        reason, sequence = out.stop_reason(self.finish_reason, self.chat_stop_reason, self.has_calls)
        events.append(event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                               "usage": out.usage(self.usage)}))
        events.append(event("message_stop", {}))
        return events

    def _fail(self, error: dict[str, Any]) -> list[bytes]:
        self.ended = True
        return [event("error", out.stream_error(error))]


def translate_sse(chat_events: AsyncIterator[bytes], model: str | None) -> AsyncIterator[bytes]:
    """The Messages events of a chat SSE byte stream; closing this closes the chat stream."""
    return rewrite(chat_events, EventStream(model))
