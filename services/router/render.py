"""Token chunks → OpenAI response objects (one JSON body, or SSE chunk payloads).

`ResponseState` is fed the decode chunks of one choice and keeps the text (via OutputText:
detokenization + stop strings), the usage counts and the logprobs. It builds exactly the
shapes OpenAI returns for /v1/completions and /v1/chat/completions, streaming or not; with
n > 1 or a batch of prompts there is one state per choice (`index` = prompt i x n + j), and
`body()`/`usage()` take all of them: each prompt is counted once and completion tokens are
summed, as OpenAI reports usage. With vLLM's `continuous_usage_stats` every chunk carries the
usage of its choice so far.

With tools (spec.tool_parser set), a chat reply is parsed for tool calls: as a whole for a JSON
body, incrementally for a stream (content deltas and tool-call deltas, services/router/tool_parsers.py).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable, Iterator
from typing import Any

from services.common.prompt_logprobs import PromptLogprobs
from services.common.tokenizer import Tokenizer
from services.router.json_codec import dumps
from services.router.orchestrator import Chunk
from services.router.output import OutputText, TokenStrings
from services.router.protocol import GenerateSpec
from services.router.reasoning import ReasoningSplit
from services.router.sse import sse_event
from services.router.tool_parsers import ToolFormat, get_format

# (token id, logprob, text offset, top_logprobs alternatives or None) of one generated token, or
# of a prompt token with echo + logprobs (the prompt's first token: logprob None, as OpenAI's null)
Entry = tuple[int, float | None, int, list[tuple[int, float]] | None]
MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way
# A text that marks where delta_event's template takes the text: JSON escapes the control
# characters, so the encoded slot cannot occur anywhere else in an event.
_SLOT = "\x00pdmesh-text\x00"
_SLOT_JSON = dumps(_SLOT)
BODY_SLICE = 256  # logprob entries built and encoded between two turns of the event loop


def _dumps(value: Any) -> bytes:
    """JSON as Starlette's JSONResponse writes it (services/router/json_codec.py)."""
    return dumps(value)


def _slot(index: int) -> str:
    return f"{_SLOT}logprobs-{index}"


def _lp(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


class ResponseState:
    def __init__(self, spec: GenerateSpec, tokenizer: Tokenizer, token_strings: TokenStrings, request_id: str,
                 index: int = 0, counts_prompt: bool = True):
        self.spec = spec
        self.index = index
        self.counts_prompt = counts_prompt  # the first choice of its prompt: usage counts the prompt here
        self.token_strings = token_strings
        prefix = "cmpl-" if spec.kind == "completion" else "chatcmpl-"
        self.id = prefix + request_id
        self.created = int(time.time())
        self._tokenizer = tokenizer
        self.out = OutputText(tokenizer, spec.prompt_ids, spec.stop, spec.skip_special_tokens,
                              spec.include_stop_str_in_output)
        self.completion_tokens = 0
        # the prompt's tokens the workers found cached, from the first chunk: a migrated request's
        # later attempts send prompt + generated ids, which is not what the client's prompt was
        self.cached_tokens: int | None = None
        self.finish_reason: str | None = None
        # vLLM's stop_reason: the stop string that matched, or the stop token id (one of the
        # client's stop_token_ids, or an eos id other than the tokenizer's own, as vLLM counts
        # generation_config's); None for the tokenizer's eos, a length cut, or no stop yet
        self.stop_reason: str | int | None = None
        self.entries: list[Entry] = []  # for the body
        self._echo_pending = spec.echo
        self.tool_format: ToolFormat | None = (
            get_format(spec.tool_parser) if spec.kind == "chat" and spec.tool_parser else None)
        self.tool_stream = self.tool_format.stream() if self.tool_format and spec.stream else None
        self._tool_deltas: list[dict[str, Any]] = []  # for the next delta_chunk
        # a chat reply's reasoning, split from its content token by token as the text comes: a
        # stream's goes out with the next delta_chunk, a body's is kept whole (_message); usage's
        # reasoning_tokens counts each token whose text is (or ends) the thought (a tag written as
        # text counts from its last token)
        self.reasoning = (ReasoningSplit(spec.reasoning_inside)
                          if spec.kind == "chat" and spec.reasoning_parser else None)
        self._reasoning_text = ""  # for the next delta_chunk
        self._thought: list[str] = []  # a body's reasoning and content pieces
        self._answer: list[str] = []
        self.reasoning_tokens = 0
        self._text_template: list[bytes] | None = None  # delta_event's event bytes around the text
        # vLLM's return_token_ids: every generated id (the one that stopped decode too, as counted
        # in usage), and those not yet sent in a stream
        self.token_ids: list[int] = []
        self._pending_ids: list[int] = []
        self._prompt_ids_sent = False
        # the prompt's logprobs (prompt_logprobs, or echo with logprobs), from the first chunk
        self.prompt_lp: PromptLogprobs | None = None
        # nothing asked for but the text: feed_each's per-token path can skip what feed() checks
        self._plain = (spec.logprobs is None and not spec.return_token_ids and self.tool_stream is None
                       and self.reasoning is None and not spec.echo_only and not spec.echo
                       and not spec.continuous_usage)

    @property
    def prompt_tokens(self) -> int:
        return len(self.spec.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def feed(self, chunk: Chunk) -> tuple[str, list[Entry]]:
        """New text and logprob entries from one chunk; sets finish_reason when it ends the output."""
        texts: list[str] = []
        entries: list[Entry] = []
        n = len(chunk.token_ids)
        if self.cached_tokens is None and n:
            self.cached_tokens = min(chunk.cached_tokens, self.prompt_tokens)
        if chunk.prompt is not None and self.prompt_lp is None:
            self.prompt_lp = chunk.prompt
        if self.spec.echo_only:
            # max_tokens 0 with echo: the prompt alone; the workers' one token is left out
            if n or chunk.finish_reason:
                self.finish_reason = "length"
            n = 0
        for i, token in enumerate(chunk.token_ids[:n]):
            self.completion_tokens += 1
            if self.spec.return_token_ids:
                self.token_ids.append(token)
                self._pending_ids.append(token)
            offset = len(self.spec.echo_text) + self.out.released_chars
            # The token that made decode stop (eos or a stop_token_id) is counted but not shown.
            if not (chunk.finish_reason == "stop" and i == n - 1):
                piece = self.out.add(token)
                texts.append(piece if self.reasoning is None else self._split(piece, True))
            else:
                self.stop_reason = self._stop_token_reason(token)
            if self.spec.logprobs is not None:
                lp = chunk.logprobs[i] if i < len(chunk.logprobs) else float("nan")
                top = chunk.top[i] if chunk.top is not None and i < len(chunk.top) else None
                entries.append((token, lp, offset, top))
            if self.out.stopped:
                self.finish_reason = "stop"
                self.stop_reason = self.out.matched_stop
                break
        if chunk.finish_reason and not self.out.stopped and not self.spec.echo_only:
            tail = self.out.finish()
            texts.append(tail if self.reasoning is None else self._split(tail, False))
            self.finish_reason = chunk.finish_reason
        if self.reasoning is not None and self.finished:
            texts.append(self._split(None, False))  # what the split still held back
        text = "".join(texts)
        if self._echo_pending:
            text = self.spec.echo_text + text
            self._echo_pending = False
            if self.spec.echo_logprobs:
                entries[:0] = self._prompt_entries()
        self.entries += entries
        if self.tool_stream is not None:
            text, deltas = self.tool_stream.feed(text)
            if self.finished:
                more, last = self.tool_stream.finish()
                text, deltas = text + more, deltas + last
            self._tool_deltas += deltas
        return text, entries

    def _split(self, piece: str | None, token: bool) -> str:
        """The content part of one piece of the reply (None: the end, what the split held back);
        its reasoning part waits for the next delta_chunk, or the body (dropped when the request
        set include_reasoning false). `token`: the piece is one generated token's text."""
        was = self.reasoning.thinking
        reasoning, content = self.reasoning.finish() if piece is None else self.reasoning.feed(piece)
        if token and (was or self.reasoning.thinking):
            self.reasoning_tokens += 1
        if not self.spec.stream:
            self._thought.append(reasoning)
            self._answer.append(content)
        elif self.spec.include_reasoning:
            self._reasoning_text += reasoning
        return content

    def feed_each(self, chunk: Chunk) -> Iterable[tuple[str, list[Entry], str | None]]:
        """As feed(), token by token: (text, entries, finish_reason after it) per token fed — exactly
        what chunks of one token each would have given, so a stream's events do not depend on how
        decode batched its tokens into chunks. Stops at the token that finished the output.

        Each token is fed as its step is taken: the caller makes a step's event (delta_event)
        before taking the next, so what the event carries besides its text — the ids not yet sent
        (return_token_ids), tool-call deltas, the usage so far — is the stream's up to that token."""
        n = len(chunk.token_ids)
        if n <= 1:
            return [(*self.feed(chunk), self.finish_reason)]
        if self._plain and not self._echo_pending and self.finish_reason is None:
            return self._feed_plain(chunk)
        return self._feed_one_by_one(chunk)

    def _feed_one_by_one(self, chunk: Chunk) -> Iterator[tuple[str, list[Entry], str | None]]:
        n = len(chunk.token_ids)
        for i, token in enumerate(chunk.token_ids):
            part = Chunk([token], chunk.logprobs[i : i + 1], chunk.finish_reason if i == n - 1 else "",
                         chunk.top[i : i + 1] if chunk.top is not None else None, chunk.cached_tokens,
                         chunk.prompt if i == 0 else None)
            yield (*self.feed(part), self.finish_reason)
            if self.finished:
                return

    def _feed_plain(self, chunk: Chunk) -> list[tuple[str, list[Entry], str | None]]:
        """feed_each() for a choice that asked for nothing but its text (no logprobs, no token ids,
        no tools, no echo): what feed() of one token at a time gives, without a Chunk per token."""
        if self.cached_tokens is None:
            self.cached_tokens = min(chunk.cached_tokens, self.prompt_tokens)
        if chunk.prompt is not None and self.prompt_lp is None:
            self.prompt_lp = chunk.prompt
        ids, out, add = chunk.token_ids, [], self.out.add
        last = len(ids) - 1
        for i, token in enumerate(ids):
            finish_reason = chunk.finish_reason if i == last else ""
            self.completion_tokens += 1
            # the token that made decode stop (eos or a stop_token_id) is counted but not shown
            if finish_reason == "stop":
                text = ""
                self.stop_reason = self._stop_token_reason(token)
            else:
                text = add(token)
            if self.out.stopped:
                self.finish_reason = "stop"
                self.stop_reason = self.out.matched_stop
                out.append((text, [], "stop"))
                break
            if finish_reason:
                text += self.out.finish()
                self.finish_reason = finish_reason
            out.append((text, [], self.finish_reason))
        return out

    def _stop_token_reason(self, token: int) -> int | None:
        if token in self.spec.stop_token_ids:
            return token
        eos = self._tokenizer.eos_token_ids
        return token if token in eos[1:] else None

    @property
    def text(self) -> str:
        return (self.spec.echo_text if self.spec.echo else "") + self.out.text

    def usage(self, states: list[ResponseState] | None = None) -> dict[str, int]:
        """Usage of the whole request: each prompt once, completion tokens of every choice; of the
        prompts, the tokens a prefix cache served (per prompt, the most any of its choices' workers found)."""
        states = states or [self]
        completion = sum(s.completion_tokens for s in states)
        prompt = sum(s.prompt_tokens for s in states if s.counts_prompt) or self.prompt_tokens
        cached: dict[int, int] = {}
        for s in states:
            cached[id(s.spec)] = max(cached.get(id(s.spec), 0), s.cached_tokens or 0)
        out = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
        }
        if self.reasoning is not None:  # with a reasoning parser, as vLLM and OpenAI report it
            out["completion_tokens_details"] = {"reasoning_tokens": sum(s.reasoning_tokens for s in states)}
        return out

    def own_usage(self) -> dict[str, int]:
        """This choice's usage so far (continuous_usage_stats, as vLLM reports it per choice)."""
        out = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens or 0},
        }
        if self.reasoning is not None:
            out["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return out

    # --- logprobs -----------------------------------------------------------------------------

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        """A token's text and bytes in logprobs; vLLM's return_tokens_as_token_ids spells it
        "token_id:N", which names tokens that are not valid text on their own."""
        if self.spec.tokens_as_ids:
            text = f"token_id:{token_id}"
            return text, list(text.encode("ascii"))
        return self.token_strings.get(token_id)

    def _prompt_entries(self) -> list[Entry]:
        """echo + logprobs: the prompt's tokens as entries, ahead of the generated ones. The first
        has no logprob (null, as OpenAI's). A token's offset is where its text starts in the
        echoed prompt (detokenized incrementally, as the generated tokens' offsets are counted, so
        offsets never decrease across the two); special tokens count when the echoed text holds
        them (a prompt of token ids is echoed as their full decoding)."""
        ids, lp, k = self.spec.prompt_ids, self.prompt_lp, self.spec.logprobs or 0
        if lp is None or len(lp) != len(ids) - 1:
            raise ValueError("the prompt's logprobs are missing or incomplete")
        skip = self.spec.echo_text != self._tokenizer.decode(ids, skip_special_tokens=False)
        walk = OutputText(self._tokenizer, [], (), skip)
        out: list[Entry] = []
        for i, token in enumerate(ids):
            offset = walk.released_chars
            walk.add(token)
            out.append((token, None, offset, None) if i == 0 else
                       (token, lp.logprobs[i - 1], offset, lp.top(i - 1, k) if k else None))
        return out

    def _completion_logprobs(self, entries) -> dict[str, Any] | None:
        if self.spec.logprobs is None:
            return None
        tokens = [self._token(t)[0] for t, _, _, _ in entries]
        lps = [None if lp is None else _lp(lp) for _, lp, _, _ in entries]
        tops = None
        if self.spec.logprobs > 0:
            # OpenAI's legacy shape: a dict per position, keyed by token text; the chosen token is
            # always in it (vLLM's rule), even when it is not among the k most likely; null for
            # the echoed prompt's first token
            tops = []
            for (_, lp, _, top), text in zip(entries, tokens, strict=True):
                if lp is None:
                    tops.append(None)
                    continue
                alternatives = {self._token(t)[0]: _lp(v) for t, v in top or []}
                alternatives.setdefault(text, _lp(lp))
                tops.append(alternatives)
        return {
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": tops,
            "text_offset": [o for _, _, o, _ in entries],
        }

    def prompt_logprobs_json(self) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's prompt_logprobs: None for the first prompt token, then per token a dict keyed by
        token id (a string in JSON) of {logprob, rank, decoded_token}: the prompt's own token, with
        its rank, and the k most likely (ranks 1..k)."""
        k = self.spec.prompt_logprobs
        if k is None:
            return None
        lp, ids = self.prompt_lp, self.spec.prompt_ids
        if lp is None or len(lp) != len(ids) - 1:
            raise ValueError("the prompt's logprobs are missing or incomplete")
        out: list[dict[str, dict[str, Any]] | None] = [None]
        for i in range(len(lp)):
            token = ids[i + 1]
            entry = {str(token): {"logprob": _lp(lp.logprobs[i]), "rank": lp.ranks[i],
                                  "decoded_token": self._token(token)[0]}}
            for rank, (t, v) in enumerate(lp.top(i, k), start=1):
                entry.setdefault(str(t), {"logprob": _lp(v), "rank": rank, "decoded_token": self._token(t)[0]})
            out.append(entry)
        return out

    def _chat_logprobs(self, entries) -> dict[str, Any] | None:
        if self.spec.logprobs is None:
            return None
        return {"content": [self._chat_entry(e) for e in entries], "refusal": None}

    def _chat_entry(self, entry: Entry) -> dict[str, Any]:
        token, lp, _, top = entry
        text, raw = self._token(token)
        alternatives = []
        for t, v in (top or [])[: self.spec.logprobs]:
            t_text, t_raw = self._token(t)
            alternatives.append({"token": t_text, "logprob": _lp(v), "bytes": t_raw})
        return {"token": text, "logprob": _lp(lp), "bytes": raw, "top_logprobs": alternatives}

    async def _logprobs_json(self) -> bytes:
        """This choice's logprobs as JSON, built and encoded BODY_SLICE entries at a time with the
        event loop served between slices (the same value as _chat_logprobs / _completion_logprobs)."""
        if self.spec.kind != "completion":
            parts = []
            for i in range(0, len(self.entries), BODY_SLICE):
                parts.append(_dumps([self._chat_entry(e) for e in self.entries[i : i + BODY_SLICE]])[1:-1])
                await asyncio.sleep(0)
            return b'{"content":[' + b",".join(p for p in parts if p) + b'],"refusal":null}'
        fields = []
        for i in range(0, len(self.entries), BODY_SLICE):
            fields.append(self._completion_logprobs(self.entries[i : i + BODY_SLICE]))
            await asyncio.sleep(0)
        out = []
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            if name == "top_logprobs" and not self.spec.logprobs:
                out.append(b'"top_logprobs":null')
                continue
            pieces = [_dumps(f[name])[1:-1] for f in fields]
            out.append(b'"' + name.encode() + b'":[' + b",".join(p for p in pieces if p) + b"]")
        return b"{" + b",".join(out) + b"}"

    # --- bodies -------------------------------------------------------------------------------

    def _finish_reason(self, finish_reason: str | None, has_calls: bool) -> str | None:
        # a reply that ended by itself after making calls ends "for" them (a cut one stays "length");
        # a call forced by name stays "stop", as OpenAI and vLLM answer it
        if has_calls and finish_reason == "stop" and not self.spec.tool_named:
            return "tool_calls"
        return finish_reason

    def _message(self) -> tuple[dict[str, Any], str | None]:
        message: dict[str, Any] = {"role": self.spec.role, "content": self.text, "refusal": None}
        if self.reasoning is not None:
            reasoning, content = self.reasoning.reply("".join(self._thought), "".join(self._answer))
            if self.spec.echo:
                content = self.spec.echo_text + (content or "")
            message["content"] = content
            # vLLM's name, and the older one DeepSeek's API and many clients read
            message["reasoning"] = message["reasoning_content"] = reasoning if self.spec.include_reasoning else None
        if self.tool_format is None:
            return message, self.finish_reason
        parsed = self.tool_format.parse(message["content"] or "")
        if parsed.calls:
            message["content"] = parsed.content
            message["tool_calls"] = [call.to_openai() for call in parsed.calls]
        return message, self._finish_reason(self.finish_reason, bool(parsed.calls))

    def choice(self, logprobs: bool = True) -> dict[str, Any]:
        """This choice of the body; `logprobs` False leaves them None (body_json fills them in)."""
        if self.spec.kind == "completion":
            out = {
                "index": self.index,
                "text": self.text,
                "logprobs": self._completion_logprobs(self.entries) if logprobs else None,
                "finish_reason": self.finish_reason,
                "stop_reason": self.stop_reason,
            }
            if self.spec.return_token_ids:
                out.update(prompt_token_ids=self.spec.prompt_ids, token_ids=self.token_ids)
            if self.spec.prompt_logprobs is not None:
                out["prompt_logprobs"] = self.prompt_logprobs_json()  # vLLM's: per choice on completions
            return out
        message, finish_reason = self._message()
        out = {
            "index": self.index,
            "message": message,
            "logprobs": self._chat_logprobs(self.entries) if logprobs else None,
            "finish_reason": finish_reason,
            "stop_reason": self.stop_reason,
        }
        if self.spec.return_token_ids:
            out["token_ids"] = self.token_ids
        return out

    async def body_json(self, states: list[ResponseState] | None = None) -> bytes:
        """body() encoded as JSON bytes. A big one (n × thousands of tokens with top_logprobs is
        millions of objects, seconds of CPU) is built incrementally: its logprobs BODY_SLICE
        entries at a time, the event loop served between slices, so no other request waits long."""
        states = states or [self]
        if sum(len(s.entries) for s in states if s.spec.logprobs is not None) <= BODY_SLICE:
            return _dumps(self.body(states))
        skeleton = self.body(states, logprobs=False)
        for i, choice in enumerate(skeleton["choices"]):
            if choice["logprobs"] is None and states[i].spec.logprobs is not None:
                choice["logprobs"] = _slot(i)
        encoded = _dumps(skeleton)
        for i, state in enumerate(states):
            if state.spec.logprobs is not None:
                encoded = encoded.replace(_dumps(_slot(i)), await state._logprobs_json(), 1)
        return encoded

    def body(self, states: list[ResponseState] | None = None, logprobs: bool = True) -> dict[str, Any]:
        """The non-streaming response (`states`: every choice's state, this one first; default just this)."""
        states = states or [self]
        return {
            "id": self.id,
            "object": "text_completion" if self.spec.kind == "completion" else "chat.completion",
            "created": self.created,
            "model": self.spec.model,
            "system_fingerprint": None,
            "choices": [s.choice(logprobs) for s in states],
            "usage": self.usage(states),
            **({"prompt_token_ids": self.spec.prompt_ids}
               if self.spec.return_token_ids and self.spec.kind == "chat" else {}),
            # vLLM's chat reply carries the prompt's logprobs once, beside the choices
            **({"prompt_logprobs": self.prompt_logprobs_json()}
               if self.spec.prompt_logprobs is not None and self.spec.kind == "chat" else {}),
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
        if self.spec.continuous_usage:
            obj["usage"] = self.own_usage()
        elif self.spec.include_usage:
            obj["usage"] = None
        return obj

    def role_chunk(self) -> dict[str, Any]:
        """Chat streams open with the assistant role and empty content, as OpenAI's do (with
        return_token_ids, the prompt's ids ride on it, as vLLM's first chunk)."""
        obj = self._chunk(
            [{"index": self.index, "delta": {"role": self.spec.role, "content": ""}, "logprobs": None,
              "finish_reason": None}]
        )
        if self.spec.return_token_ids:
            obj["prompt_token_ids"] = self.spec.prompt_ids
            self._prompt_ids_sent = True
        return obj

    def delta_chunk(self, text: str, entries, finish_reason: str | None) -> dict[str, Any] | None:
        """The SSE payload for new text/logprobs/tool-call deltas (None when there is nothing to say)."""
        calls = _merge_tool_deltas(self._tool_deltas)
        self._tool_deltas = []
        reasoning, self._reasoning_text = self._reasoning_text, ""
        if not text and not entries and finish_reason is None and not calls and not reasoning:
            return None  # ids of held-back text go out with the next chunk
        ids, self._pending_ids = self._pending_ids, []
        if self.spec.kind == "completion":
            choice = {
                "index": self.index,
                "text": text,
                "logprobs": self._completion_logprobs(entries) if entries else None,
                "finish_reason": finish_reason,
                "stop_reason": self.stop_reason if finish_reason is not None else None,
            }
            if self.spec.return_token_ids:
                if not self._prompt_ids_sent:
                    choice["prompt_token_ids"] = self.spec.prompt_ids
                    self._prompt_ids_sent = True
                choice["token_ids"] = ids
        else:
            delta: dict[str, Any] = {"reasoning": reasoning, "reasoning_content": reasoning} if reasoning else {}
            if text or (finish_reason is None and not calls and not reasoning):
                delta["content"] = text
            if calls:
                delta["tool_calls"] = calls
            if self.tool_stream is not None:
                finish_reason = self._finish_reason(finish_reason, self.tool_stream.has_calls)
            choice = {
                "index": self.index,
                "delta": delta,
                "logprobs": self._chat_logprobs(entries) if entries else None,
                "finish_reason": finish_reason,
            }
            if finish_reason is not None:
                choice["stop_reason"] = self.stop_reason  # vLLM's chat chunks carry it on the last one
            if self.spec.return_token_ids:
                choice["token_ids"] = ids
        return self._chunk([choice])

    def delta_event(self, text: str, entries, finish_reason: str | None) -> bytes | None:
        """delta_chunk() as an SSE event, byte for byte; plain text (no logprobs, not the last
        event) fills a template made once per choice instead of building and encoding the object."""
        if (entries or finish_reason is not None or self._tool_deltas or self._reasoning_text
                or self.spec.continuous_usage or self.spec.return_token_ids):
            payload = self.delta_chunk(text, entries, finish_reason)
            return None if payload is None else sse_event(payload)
        if not text:
            return None
        if self._text_template is None:
            self._text_template = sse_event(self.delta_chunk(_SLOT, [], None)).split(_SLOT_JSON)
        head, tail = self._text_template
        return head + dumps(text) + tail

    def usage_chunk(self, states: list[ResponseState] | None = None) -> dict[str, Any]:
        obj = self._chunk([])
        obj["usage"] = self.usage(states)
        return obj


def _merge_tool_deltas(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per call and chunk: a call's announcement and argument fragments that arrived
    together go out as one delta (its arguments joined), as OpenAI streams them."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if out and out[-1]["index"] == d["index"]:
            fn = out[-1].setdefault("function", {})
            fn["arguments"] = fn.get("arguments", "") + d.get("function", {}).get("arguments", "")
        else:
            out.append({**d, "function": dict(d.get("function", {}))})
    return out
