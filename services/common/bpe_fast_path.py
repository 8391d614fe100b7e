"""An exact shortcut past the `tokenizers` backend for ASCII prompts of GPT-2-style byte-level BPE.

The router tokenizes every prompt, and the backend's encode was its largest single cost per request
(about 20 us for an 80-character prompt, most of it in the ByteLevel pre-tokenizer's regex). For a
tokenizer whose whole pipeline is "ByteLevel regex split -> BPE per piece (-> fixed special tokens
around)", an ASCII text can be split with the stdlib `re` instead, and the BPE ids of each piece
cached, as tiktoken and GPT-2's own encoder do: prompts repeat the same words.

`BpeFastPath.for_backend(backend)` decides once whether the backend's configuration is one this
reproduces exactly (else None: the caller keeps the backend). `encode` then returns the ids, or None
for a text it does not take (non-ASCII, or holding an added token's content): the caller asks the
backend. The backend must not be reconfigured afterwards (HuggingFaceTokenizer finishes it first).
"""

from __future__ import annotations

import json
import re
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

from services.common.byte_level import char_to_byte

# GPT-2's split pattern, tokenizers' ByteLevel regex
#   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
# for ASCII text: there \p{L} is [A-Za-z], \p{N} is [0-9], and onig's \s is re.ASCII's [ \t\n\v\f\r]
# (\x1c-\x1f are not White_Space); tests compare it with the backend on every ASCII character. The
# contractions go after words and numbers, which never start with "'": the same first match at
# every position, and 10 % faster, most pieces being words.
ASCII_SPLIT = re.compile(
    r""" ?[A-Za-z]+| ?[0-9]+|'s|'t|'re|'ve|'m|'ll|'d| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""", re.ASCII
)
# The cache starts over when it passes either bound, so hostile input (every piece new, long runs of
# punctuation that are one id per byte) keeps it under about 10 MB; a prompt's words fit many times.
MAX_CACHED_PIECE = 64  # longer pieces (a long run of spaces or digits) are tokenized, not kept
MAX_CACHE_ENTRIES = 20_000
MAX_CACHED_IDS = 100_000


class BpeFastPath:
    def __init__(self, model: models.BPE, *, add_prefix_space: bool, added_contents: list[str],
                 prefix: tuple[int, ...], suffix: tuple[int, ...]) -> None:
        self._tokenize = model.tokenize
        self._add_prefix_space = add_prefix_space
        # The backend splits added tokens out of the text before pre-tokenizing (chat templates put
        # them in prompts): a text holding one goes to the backend. Mostly they share a first
        # character ("<"), and a text without it needs no regex search.
        contents = sorted({c for c in added_contents if c}, key=len, reverse=True)
        self._added = re.compile("|".join(map(re.escape, contents))) if contents else None
        firsts = {c[0] for c in contents}
        self._added_first = firsts.pop() if len(firsts) == 1 else ""  # "": every text is searched
        self._prefix, self._suffix = prefix, suffix
        alphabet = {b: c for c, b in char_to_byte().items()}
        self._to_alphabet = {b: alphabet[b] for b in range(128)}  # str.translate table for ASCII
        self._cache: dict[str, tuple[int, ...]] = {}
        self._cached_ids = 0

    @classmethod
    def for_backend(cls, backend: BackendTokenizer) -> BpeFastPath | None:
        """The fast path for this backend, or None when its configuration is not one reproduced here."""
        model, pre = backend.model, backend.pre_tokenizer
        # Dropout draws merges at random: a cache would freeze one draw. The other options act inside
        # model.tokenize, but are left to the backend: only the plain GPT-2 form is tested here.
        if not (type(model) is models.BPE and model.dropout is None and not model.ignore_merges
                and not model.continuing_subword_prefix and not model.end_of_word_suffix
                and not model.byte_fallback):
            return None
        if backend.normalizer is not None or backend.truncation is not None or backend.padding is not None:
            return None
        if type(pre) is not pre_tokenizers.ByteLevel or not pre.use_regex:
            return None
        wrap = _special_tokens_around(backend.post_processor)
        if wrap is None:
            return None
        added = [token.content for token in backend.get_added_tokens_decoder().values()]
        return cls(model, add_prefix_space=bool(pre.add_prefix_space), added_contents=added,
                   prefix=wrap[0], suffix=wrap[1])

    def encode(self, text: str, add_special_tokens: bool) -> list[int] | None:
        """The backend's ids for `text`, or None when the backend has to encode it."""
        if not text.isascii():
            return None
        if self._added is not None and self._added_first in text and self._added.search(text):
            return None
        if self._add_prefix_space and text and text[0] != " ":
            text = " " + text
        cache = self._cache
        ids = list(self._prefix) if add_special_tokens else []
        for piece in ASCII_SPLIT.findall(text):
            piece_ids = cache.get(piece)
            if piece_ids is None:
                piece_ids = tuple([token.id for token in self._tokenize(piece.translate(self._to_alphabet))])
                if len(piece) <= MAX_CACHED_PIECE:
                    self._cached_ids += len(piece_ids)
                    if len(cache) >= MAX_CACHE_ENTRIES or self._cached_ids > MAX_CACHED_IDS:
                        cache.clear()
                        self._cached_ids = len(piece_ids)
                    cache[piece] = piece_ids
            ids += piece_ids
        if add_special_tokens and self._suffix:
            ids += self._suffix
        return ids

    @property
    def cache_size(self) -> tuple[int, int]:
        """(pieces, ids) held in the cache."""
        return len(self._cache), self._cached_ids


def _special_tokens_around(processor: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(ids before, ids after) a single sequence that the post-processor adds with
    add_special_tokens; None for a post-processor that does anything else to the ids."""
    if processor is None:
        return (), ()
    return _wrap_of(json.loads(processor.__getstate__()))


def _wrap_of(spec: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    kind = spec.get("type")
    if kind == "ByteLevel":  # changes offsets only
        return (), ()
    if kind == "Sequence":  # each wraps what the ones before made
        before: tuple[int, ...] = ()
        after: tuple[int, ...] = ()
        for inner in spec.get("processors", []):
            wrap = _wrap_of(inner)
            if wrap is None:
                return None
            before, after = wrap[0] + before, after + wrap[1]
        return before, after
    if kind != "TemplateProcessing":
        return None
    single, specials = spec.get("single", []), spec.get("special_tokens", {})
    sequences = [i for i, piece in enumerate(single) if "Sequence" in piece]
    if len(sequences) != 1 or single[sequences[0]]["Sequence"].get("id") != "A":
        return None
    at = sequences[0]
    try:
        before_ids = [int(i) for piece in single[:at] for i in specials[piece["SpecialToken"]["id"]]["ids"]]
        after_ids = [int(i) for piece in single[at + 1:] for i in specials[piece["SpecialToken"]["id"]]["ids"]]
    except (KeyError, TypeError, ValueError):
        return None
    return tuple(before_ids), tuple(after_ids)
