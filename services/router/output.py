"""Generated token ids → text the client may see: incremental detokenization plus stop strings.

`OutputText.add()` returns only text that is final: complete UTF-8 characters (the
IncrementalDetokenizer holds back a split character) that cannot be the start of a stop
string (a suffix that is a prefix of some stop string is held back until the next token
decides it). When a stop string completes, the text up to it is released, the stop string
and everything after it are dropped (OpenAI trims the stop sequence; with vLLM's
include_stop_str_in_output the stop string is kept), and `stopped` is set so the caller cancels
the Decode RPC.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.builtin_tokenizer import BYTE_TOKENS, BuiltinTokenizer
from services.common.detokenizer import IncrementalDetokenizer
from services.common.tokenizer import Tokenizer


class StopMatcher:
    """Finds the earliest stop string in a growing text, holding back possible partial matches."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, start: int) -> int:
        """Index of the earliest complete stop string at or after `start`, or -1."""
        best = -1
        for s in self.stops:
            i = text.find(s, start)
            if i != -1 and (best == -1 or i < best):
                best = i
        return best

    def holdback(self, text: str, start: int) -> int:
        """Length of the longest suffix of text[start:] that is a proper prefix of a stop string."""
        tail = text[max(start, len(text) - self.longest + 1):] if self.longest > 1 else ""
        for k in range(len(tail), 0, -1):
            suffix = tail[-k:]
            if any(len(s) > k and s.startswith(suffix) for s in self.stops):
                return k
        return 0


class OutputText:
    """Released text is kept as chunks and only the unreleased tail is searched, so each token
    costs O(1) however long the output grows."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ):
        self._include_stop = include_stop
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
        # most requests have no stop strings: no matcher then (it is made per choice, per request)
        self._matcher = StopMatcher(stop) if any(stop) else None
        self._released: list[str] = []  # text released to the client, in order
        self.released_chars = 0  # len of the released text
        self._pending = ""  # detokenized, held back (could begin a stop string)
        self.stopped = False  # a stop string matched
        self.matched_stop: str | None = None

    @property
    def text(self) -> str:
        """Text released so far."""
        if len(self._released) > 1:
            self._released = ["".join(self._released)]
        return self._released[0] if self._released else ""

    def add(self, token_id: int) -> str:
        """Feed one generated token; returns the newly released text ("" while held back)."""
        if self.stopped:
            return ""
        if self._matcher is None:  # nothing to hold back: all of it is released (_release's last line)
            out = self._pending + self._detok.add(token_id)
            self._pending = ""
            if out:
                self._released.append(out)
                self.released_chars += len(out)
            return out
        self._pending += self._detok.add(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        """Generation ended without a stop string: release everything still held back."""
        if self.stopped:
            return ""
        self._pending += self._detok.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        pending = self._pending
        if self._matcher is not None:
            # A match can only start in the held-back part: released text never holds a stop prefix.
            at = self._matcher.find(pending, 0)
            if at != -1:
                self.matched_stop = next(s for s in self._matcher.stops if pending.startswith(s, at))
                if self._include_stop:
                    at += len(self.matched_stop)
                self.stopped = True
                return self._advance(at, drop_rest=True)
            if not final:
                return self._advance(len(pending) - self._matcher.holdback(pending, 0))
        return self._advance(len(pending))

    def _advance(self, to: int, drop_rest: bool = False) -> str:
        out = self._pending[:to]
        self._pending = "" if drop_rest else self._pending[to:]
        if out:
            self._released.append(out)
            self.released_chars += len(out)
        return out


class TokenStrings:
    """Per-token text and bytes for logprobs (cached; a byte token of the built-in tokenizer keeps its byte)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._byte_level = isinstance(tokenizer, BuiltinTokenizer)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            raw = [token_id] if self._byte_level and token_id < BYTE_TOKENS else list(text.encode("utf-8"))
            hit = self._cache[token_id] = (text, raw)
        return hit
