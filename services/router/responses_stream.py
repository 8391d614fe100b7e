"""The Responses API's stream of typed events, made from the chat route's SSE chunks.

The chat stream (services/router/app.py, render.py) already holds everything: text deltas, tool
call deltas in the openai SDK's shape, the finish reason, usage last (include_usage is always
asked for), or an error event mid-stream. `EventStream.feed(chunk)` turns each chunk into the
events OpenAI sends, in its order:

  response.created, response.in_progress
  per reasoning:   response.output_item.added, response.content_part.added,
                   response.reasoning_text.delta (one per chat delta), response.reasoning_text.done,
                   response.content_part.done, response.output_item.done (--reasoning-parser)
  per text reply:  response.output_item.added, response.content_part.added,
                   response.output_text.delta (one per chat delta), response.output_text.done,
                   response.content_part.done, response.output_item.done
  per tool call:   response.output_item.added, response.function_call_arguments.delta...,
                   response.function_call_arguments.done, response.output_item.done
  response.completed (response.incomplete when cut by max_output_tokens), with the whole Response

An error after the stream began (one the router could not migrate away) ends it with
response.failed; the connection closes cleanly. Every event has its sequence_number; there is
no `[DONE]` line, as in OpenAI's stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from services.router import responses_output as out
from services.router.chat_sse_rewrite import rewrite
from services.router.json_codec import dumps


class EventStream:
    def __init__(self, echo: dict[str, Any], on_final: Callable[[dict[str, Any]], None] | None = None,
                 opaque: bool = False):
        self.echo = echo
        self.opaque = opaque  # include reasoning.encrypted_content: a reasoning item carries it when done
        self.on_final = on_final  # given the whole Response once it completed or was cut (to store it)
        self.seq = 0
        self.rid = ""
        self.created = 0
        self.model = ""
        self.items: list[dict[str, Any]] = []  # output items so far (the open one last)
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its item
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.ended = False

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps(payload) + b"\n\n"

    def _response(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        return out.envelope(self.rid, self.created, self.model, self.echo, status, self.items,
                            self.usage if status != "in_progress" else None, error)

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        """The events of one chat chunk (an error chunk ends the stream)."""
        if self.ended:
            return []
        events: list[bytes] = []
        if "error" in chunk:
            return self._fail(chunk["error"])
        if not self.rid:
            self.rid, self.created, self.model = out.response_id(chunk["id"]), chunk["created"], chunk["model"]
            events.append(self._event("response.created", response=self._response("in_progress")))
            events.append(self._event("response.in_progress", response=self._response("in_progress")))
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                events += self._reasoning(delta["reasoning"])
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def _text(self, text: str) -> list[bytes]:
        events = []
        if self.open is None or self.open["type"] != "message":
            events += self._close()
            item_id = out.item_ids(self.rid)[0]
            if any(i["type"] == "message" for i in self.items):  # text again after a call: a new item
                item_id += f"_{len(self.items)}"
            events += self._open_with_part(out.message_item(item_id, "", "in_progress"), out.text_part(""))
        if not text:
            return events
        self.open["content"][0]["text"] += text
        events.append(self._event("response.output_text.delta", item_id=self.open["id"],
                                  output_index=len(self.items) - 1, content_index=0, delta=text, logprobs=[]))
        return events

    def _reasoning(self, text: str) -> list[bytes]:
        events = []
        if self.open is None or self.open["type"] != "reasoning":
            events += self._close()
            item = out.reasoning_item(out.reasoning_item_id(self.rid), "", "in_progress")
            events += self._open_with_part(item, out.reasoning_part(""))
        self.open["content"][0]["text"] += text
        events.append(self._event("response.reasoning_text.delta", item_id=self.open["id"],
                                  output_index=len(self.items) - 1, content_index=0, delta=text))
        return events

    def _open_with_part(self, item: dict[str, Any], part: dict[str, Any]) -> list[bytes]:
        """The events that open `item` with its one content part: added empty, then the part."""
        item["content"] = []
        events = self._add(item)
        item["content"].append(part)
        events.append(self._event("response.content_part.added", item_id=item["id"],
                                  output_index=len(self.items) - 1, content_index=0, part=part))
        return events

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        events = []
        index = call.get("index", 0)
        fn = call.get("function") or {}
        item = self.calls.get(index)
        if item is None:
            events += self._close()
            item = out.call_item(f"{out.item_ids(self.rid)[1]}_{index}", call.get("id") or "",
                                 fn.get("name") or "", "", "in_progress")
            self.calls[index] = item
            events += self._add(item)
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.items.index(item), delta=fn["arguments"]))
        return events

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        self.items.append(item)
        self.open = item
        return [self._event("response.output_item.added", output_index=len(self.items) - 1, item=item)]

    def _close(self, status: str = "completed") -> list[bytes]:
        """The done events of the item being streamed, if any."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        events = []
        item["status"] = status
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            if item["type"] == "message":
                events.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                          content_index=0, text=part["text"], logprobs=[]))
            else:
                if self.opaque:
                    item["encrypted_content"] = out.opaque_reasoning(part["text"])
                events.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                          content_index=0, text=part["text"]))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=part))
        else:
            item["status"] = "completed"  # a call's arguments came whole (a cut one is never sent)
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def finish(self) -> list[bytes]:
        """The closing events, once the chat stream ended."""
        if self.ended:
            return []
        if not self.rid:  # nothing came at all: cannot happen after a 200, but end properly
            return self._fail({"message": "The stream ended before any output.", "code": "server_error"})
        status = "incomplete" if self.finish_reason == "length" else "completed"
        events = self._text("") if not self.items else []  # an empty reply is still one message
        events += self._close(status)
        self.ended = True
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        final = self._response(status)
        if self.on_final is not None:
            self.on_final(final)
        events.append(self._event(kind, response=final))
        return events

    def _fail(self, error: dict[str, Any]) -> list[bytes]:
        self.ended = True
        events = self._close("incomplete")
        detail = {"code": "server_error", "message": str(error.get("message") or "The request failed.")}
        if not self.rid:
            return [self._event("error", code=detail["code"], message=detail["message"], param=None)]
        events.append(self._event("response.failed", response=self._response("failed", detail)))
        return events


def translate_sse(chat_events: AsyncIterator[bytes], echo: dict[str, Any],
                  on_final: Callable[[dict[str, Any]], None] | None = None,
                  opaque: bool = False) -> AsyncIterator[bytes]:
    """The Responses events of a chat SSE byte stream; closing this closes the chat stream."""
    return rewrite(chat_events, EventStream(echo, on_final, opaque))
