"""Byte-level BPE tokens as the bytes they stand for (GPT-2's byte alphabet: Llama 3, Qwen2, the
built-in model).

A byte-level vocabulary writes each byte as one printable character; its decoder maps the
characters of every token back to bytes and decodes the joined bytes as UTF-8 (U+FFFD for what is
not). So the text of a run of tokens depends only on their bytes, which lets the detokenizer
append a token's text without asking the tokenizer to decode its neighbours again
(services/common/detokenizer.py). `byte_table` returns the bytes of every ordinary token, or None
when the tokenizer's decoder is not that plain byte-level one, or when the backend's own decode
disagrees with the table on a sample (then nothing relies on it).
"""

from __future__ import annotations

import random
from functools import lru_cache

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders

CHECKED_TOKENS = 512  # single tokens compared against the backend's decode
CHECKED_RUNS = 128  # runs of 2..8 tokens compared likewise


@lru_cache(maxsize=1)
def char_to_byte() -> dict[str, int]:
    """The byte alphabet's character -> byte: printable Latin-1 bytes stand for themselves, every
    other byte for the next unused code point from 256 up, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def byte_table(backend: BackendTokenizer) -> dict[int, bytes] | None:
    if type(backend.decoder) is not decoders.ByteLevel:  # alone: not in a Sequence with others
        return None
    alphabet = char_to_byte()
    added = set(backend.get_added_tokens_decoder())
    table: dict[int, bytes] = {}
    for token, token_id in backend.get_vocab(with_added_tokens=False).items():
        if token_id in added:
            continue
        try:
            table[token_id] = bytes(alphabet[c] for c in token)
        except KeyError:
            continue  # a character outside the alphabet: decode keeps such a token as it is; not ours
    return table if table and _agrees(backend, table) else None


def _agrees(backend: BackendTokenizer, table: dict[int, bytes]) -> bool:
    ids = sorted(table)
    step = max(1, len(ids) // CHECKED_TOKENS)
    rng = random.Random(0)
    runs = [[i] for i in ids[::step]]
    runs += [[rng.choice(ids) for _ in range(rng.randint(2, 8))] for _ in range(CHECKED_RUNS)]
    return all(backend.decode(run, skip_special_tokens=True)
               == b"".join(table[i] for i in run).decode("utf-8", errors="replace") for run in runs)
