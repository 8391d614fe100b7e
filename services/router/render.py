"""Token chunks → OpenAI response objects (one JSON body, or SSE chunk payloads).

`ResponseState` is fed the decode chunks of one choice and keeps the text (via OutputText:
detokenization + stop strings), the usage counts and the logprobs. It builds exactly the
shapes OpenAI returns for /v1/completions and /v1/chat/completions, streaming or not; with
n > 1 there is one state per choice (`index`), and `body()`/`usage()` take all of them: the
prompt is counted once and completion tokens are summed, as OpenAI reports usage.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from services.common.tokenizer import Tokenizer
from services.router.orchestrator import Chunk
from services.router.output import OutputText, TokenStrings
from services.router.protocol import GenerateSpec
from services.router.sse import sse_event

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way
# A text that marks where delta_event's template takes the text: JSON escapes the control
# characters, so the encoded slot cannot occur anywhere else in an event.
_SLOT = "\x00pdmesh-text\x00"
_SLOT_JSON = json.dumps(_SLOT).encode("utf-8")


def _lp(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


class ResponseState:
    def __init__(self, spec: GenerateSpec, tokenizer: Tokenizer, token_strings: TokenStrings, request_id: str,
                 index: int = 0):
        self.spec = spec
        self.index = index
        self.token_strings = token_strings
        prefix = "cmpl-" if spec.kind == "completion" else "chatcmpl-"
        self.id = prefix + request_id
        self.created = int(time.time())
        self.out = OutputText(tokenizer, spec.prompt_ids, spec.stop, spec.skip_special_tokens)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.entries: list[tuple[int, float, int]] = []  # (token, logprob, text offset) for the body
        self._echo_pending = spec.echo
        self._text_template: list[bytes] | None = None  # delta_event's event bytes around the text

    @property
    def prompt_tokens(self) -> int:
        return len(self.spec.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def feed(self, chunk: Chunk) -> tuple[str, list[tuple[int, float, int]]]:
        """New text and logprob entries from one chunk; sets finish_reason when it ends the output."""
        texts: list[str] = []
        entries: list[tuple[int, float, int]] = []
        n = len(chunk.token_ids)
        for i, token in enumerate(chunk.token_ids):
            self.completion_tokens += 1
            offset = len(self.spec.echo_text) + len(self.out.text)
            # The token that made decode stop (eos or a stop_token_id) is counted but not shown.
            if not (chunk.finish_reason == "stop" and i == n - 1):
                texts.append(self.out.add(token))
            if self.spec.logprobs is not None:
                lp = chunk.logprobs[i] if i < len(chunk.logprobs) else float("nan")
                entries.append((token, lp, offset))
            if self.out.stopped:
                self.finish_reason = "stop"
                break
        if chunk.finish_reason and not self.out.stopped:
            texts.append(self.out.finish())
            self.finish_reason = chunk.finish_reason
        if self._echo_pending:
            texts.insert(0, self.spec.echo_text)
            self._echo_pending = False
        self.entries += entries
        return "".join(texts), entries

    def feed_each(self, chunk: Chunk) -> list[tuple[str, list[tuple[int, float, int]], str | None]]:
        """As feed(), token by token: (text, entries, finish_reason after it) per token fed — exactly
        what chunks of one token each would have given, so a stream's events do not depend on how
        decode batched its tokens into chunks. Stops at the token that finished the output."""
        n = len(chunk.token_ids)
        if n <= 1:
            return [(*self.feed(chunk), self.finish_reason)]
        out = []
        for i, token in enumerate(chunk.token_ids):
            part = Chunk([token], chunk.logprobs[i : i + 1], chunk.finish_reason if i == n - 1 else "")
            out.append((*self.feed(part), self.finish_reason))
            if self.finished:
                break
        return out

    @property
    def text(self) -> str:
        return (self.spec.echo_text if self.spec.echo else "") + self.out.text

    def usage(self, states: list[ResponseState] | None = None) -> dict[str, int]:
        """Usage of the whole request: the prompt once, completion tokens of every choice."""
        completion = sum(s.completion_tokens for s in states or [self])
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }

    # --- logprobs -----------------------------------------------------------------------------

    def _completion_logprobs(self, entries) -> dict[str, Any] | None:
        if self.spec.logprobs is None:
            return None
        tokens = [self.token_strings.get(t)[0] for t, _, _ in entries]
        lps = [_lp(lp) for _, lp, _ in entries]
        return {
            "tokens": tokens,
            "token_logprobs": lps,
            # only the chosen token is known; it is the only entry of each top_logprobs dict
            "top_logprobs": [{s: lp} for s, lp in zip(tokens, lps, strict=True)] if self.spec.logprobs > 0 else None,
            "text_offset": [o for _, _, o in entries],
        }

    def _chat_logprobs(self, entries) -> dict[str, Any] | None:
        if self.spec.logprobs is None:
            return None
        content = []
        for token, lp, _ in entries:
            text, raw = self.token_strings.get(token)
            one = {"token": text, "logprob": _lp(lp), "bytes": raw}
            content.append({**one, "top_logprobs": [dict(one)] if self.spec.logprobs > 0 else []})
        return {"content": content, "refusal": None}

    # --- bodies -------------------------------------------------------------------------------

    def choice(self) -> dict[str, Any]:
        if self.spec.kind == "completion":
            return {
                "index": self.index,
                "text": self.text,
                "logprobs": self._completion_logprobs(self.entries),
                "finish_reason": self.finish_reason,
            }
        return {
            "index": self.index,
            "message": {"role": "assistant", "content": self.text, "refusal": None},
            "logprobs": self._chat_logprobs(self.entries),
            "finish_reason": self.finish_reason,
        }

    def body(self, states: list[ResponseState] | None = None) -> dict[str, Any]:
        """The non-streaming response (`states`: every choice's state, this one first; default just this)."""
        states = states or [self]
        return {
            "id": self.id,
            "object": "text_completion" if self.spec.kind == "completion" else "chat.completion",
            "created": self.created,
            "model": self.spec.model,
            "system_fingerprint": None,
            "choices": [s.choice() for s in states],
            "usage": self.usage(states),
        }

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj = {
            "id": self.id,
            "object": "text_completion" if self.spec.kind == "completion" else "chat.completion.chunk",
            "created": self.created,
            "model": self.spec.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if self.spec.include_usage:
            obj["usage"] = None
        return obj

    def role_chunk(self) -> dict[str, Any]:
        """Chat streams open with the assistant role and empty content, as OpenAI's do."""
        return self._chunk(
            [{"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
              "finish_reason": None}]
        )

    def delta_chunk(self, text: str, entries, finish_reason: str | None) -> dict[str, Any] | None:
        """The SSE payload for new text/logprobs (None when there is nothing to say)."""
        if not text and not entries and finish_reason is None:
            return None
        if self.spec.kind == "completion":
            choice = {
                "index": self.index,
                "text": text,
                "logprobs": self._completion_logprobs(entries) if entries else None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {
                "index": self.index,
                "delta": {"content": text} if text or finish_reason is None else {},
                "logprobs": self._chat_logprobs(entries) if entries else None,
                "finish_reason": finish_reason,
            }
        return self._chunk([choice])

    def delta_event(self, text: str, entries, finish_reason: str | None) -> bytes | None:
        """delta_chunk() as an SSE event, byte for byte; plain text (no logprobs, not the last
        event) fills a template made once per choice instead of building and encoding the object."""
        if entries or finish_reason is not None:
            payload = self.delta_chunk(text, entries, finish_reason)
            return None if payload is None else sse_event(payload)
        if not text:
            return None
        if self._text_template is None:
            self._text_template = sse_event(self.delta_chunk(_SLOT, [], None)).split(_SLOT_JSON)
        head, tail = self._text_template
        return head + json.dumps(text, ensure_ascii=False).encode("utf-8") + tail

    def usage_chunk(self, states: list[ResponseState] | None = None) -> dict[str, Any]:
        obj = self._chunk([])
        obj["usage"] = self.usage(states)
        return obj
