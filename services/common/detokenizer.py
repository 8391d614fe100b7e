"""Turn generated token ids into text one token at a time, for streaming and stop strings.

Decoding a single token on its own is wrong in two ways: a UTF-8 character may be split over
several byte tokens, and sentencepiece-style decoders drop the leading space of the *first*
token they see. So each step decodes a short window of recent tokens twice, once without and
once with the new tokens, and emits the difference; text is held back while it ends in an
incomplete character (U+FFFD). This is the prefix/read-offset scheme vLLM and TGI use.

Per-token work is O(1): the window never holds more than MAX_PENDING_TOKENS unemitted ids. A
character is at most 4 bytes, so ids that still end in U+FFFD after that many never complete one
(a token that decodes to U+FFFD alone, an invalid byte): their text is emitted as it is. Ids that
add no text at all (skipped special tokens) leave the window the same way. Without the bound each
such id would re-decode every id before it: quadratic in the output's length.

With a byte-level tokenizer (Tokenizer.byte_tables) most steps decode nothing: when nothing is
held back and the context ends on a whole character, a token whose bytes are whole characters
adds exactly its own text, which is what the two decodes would give; every other step (part of a
character, a special token, a context that ends mid-character) decodes as above.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded as context before the first generated token, so its leading space is
# kept as it would be mid-sentence. A few tokens are enough for every decoder we know of.
PROMPT_CONTEXT_TOKENS = 5
# Unemitted ids the window may hold: a UTF-8 character is at most 4 bytes (so 4 byte tokens)
MAX_PENDING_TOKENS = 6


class IncrementalDetokenizer:
    """Feed ids with add(); each call returns only text that is now complete."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Only a window of ids is kept: [prefix_offset, read_offset) was already emitted and serves
        # as context, [read_offset, end) is not emitted yet.
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._chunks: list[str] = []
        tables = tokenizer.byte_tables()
        self._bytes, self._whole = tables if tables is not None else (None, None)
        self._clean = self._context_whole()  # the next whole token's text is its own

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._chunks)

    def add(self, token_id: int) -> str:
        if self._clean:
            text = self._whole.get(token_id)  # type: ignore[union-attr] - _clean implies the tables
            if text is not None:
                # the state _emit would leave: the emitted token is the next step's context
                self._ids = [token_id]
                self._prefix_offset, self._read_offset = 0, 1
                self._chunks.append(text)
                return text
        self._ids.append(token_id)
        text = self._emit(final=False)
        self._clean = self._context_whole()
        return text

    def flush(self) -> str:
        """Emit whatever is held back (e.g. an incomplete character at the end of generation)."""
        text = self._emit(final=True)
        self._clean = self._context_whole()
        return text

    def _context_whole(self) -> bool:
        """Nothing is held back and the context's bytes are whole UTF-8 characters."""
        if self._bytes is None or self._read_offset != len(self._ids):
            return False
        context = self._ids  # all of it: after every emit (and at the start) _prefix_offset is 0
        whole = self._whole
        for token_id in context:  # whole tokens, joined, are whole: most contexts end here
            if token_id not in whole:  # type: ignore[operator]
                break
        else:
            return True
        try:
            b"".join([self._bytes[i] for i in context]).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            return False  # a special or added token, or a character cut in two
        return True

    def _emit(self, final: bool) -> str:
        context_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        stuck = len(self._ids) - self._read_offset >= MAX_PENDING_TOKENS
        if len(window_text) <= len(context_text):
            if stuck:  # ids that add no text: keep a little context, drop the rest
                del self._ids[: max(0, len(self._ids) - PROMPT_CONTEXT_TOKENS)]
                self._prefix_offset, self._read_offset = 0, len(self._ids)
            return ""  # e.g. a skipped special token, or bytes that do not form a character yet
        if window_text.endswith(REPLACEMENT_CHAR) and not final and not stuck:
            return ""  # wait for the rest of the character
        new_text = window_text[len(context_text) :]
        # The newly emitted tokens become the context of the next step; older ids are no longer needed.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._chunks.append(new_text)
        return new_text

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens) if ids else ""
