"""Stored responses of the Responses API (`--responses-store-size`, off by default; vLLM's
VLLM_ENABLE_RESPONSES_API_STORE): what `previous_response_id`, `GET /v1/responses/{id}`,
`DELETE` and `input_items` read.

One entry per stored response: the Response object as the client got it, the input items it was
asked with (its own, as `input_items` lists them), and the conversation a follow-up continues —
every earlier turn's items, this request's input and its output items, in order. Held in this
router process's memory, bounded by a number of entries and by their size (the JSON text of
each), the least recently used dropped first: a follow-up to a dropped response is a 404, as
OpenAI's for one it does not know. Pure (no I/O): the route serialises the entries it puts.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    conversation: list[dict[str, Any]]  # earlier turns + input_items + the output items
    size: int = field(default=0, compare=False)


class ResponsesStore:
    def __init__(self, max_entries: int, max_bytes: int):
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("a responses store needs room for at least one entry and one byte")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]],
            conversation: list[dict[str, Any]]) -> bool:
        """Keep it (replacing an entry of the same id); False when it alone is over the byte bound."""
        size = len(json.dumps([response, input_items, conversation], separators=(",", ":")))
        if size > self.max_bytes:
            return False
        self.delete(response["id"])
        self._entries[response["id"]] = StoredResponse(response, input_items, conversation, size)
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= dropped.size
        return True

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True
