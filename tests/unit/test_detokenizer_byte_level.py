"""The detokenizer's byte-level path (Tokenizer.byte_tables) gives, chunk for chunk, what decoding
the window twice gives, on byte-level tokenizers (the built-in model's, Llama 3- and Qwen2-style,
the byte tokenizer of builtin-random), and is not offered where its promise does not hold
(a sentencepiece-style decoder)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from services.common.builtin_tokenizer import BuiltinTokenizer
from services.common.detokenizer import IncrementalDetokenizer
from services.common.tokenizer import load_tokenizer
from services.common.tokenizer_base import Tokenizer
from tests.unit.test_tokenizer import DETOKENIZER_TEXTS, FOLDER_BUILDERS


class CountingDecodes:
    """The same tokenizer, counting decode calls; `tables=False` hides its byte tables, which makes
    the detokenizer decode every step (the reference)."""

    def __init__(self, inner: Tokenizer, tables: bool = True):
        self.inner, self.tables, self.decodes = inner, tables, 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.decodes += 1
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def byte_tables(self):
        return self.inner.byte_tables() if self.tables else None


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("byte_level")
    out: dict[str, Tokenizer] = {name: load_tokenizer(str(build(root / name))) for name, build in FOLDER_BUILDERS.items()}
    out["builtin"] = load_tokenizer(None)
    out["builtin-random"] = load_tokenizer("builtin-random")
    return out


def _stream(tokenizer, ids: list[int], prompt: list[int], skip: bool) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)  # type: ignore[arg-type]
    chunks = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(chunks) == detok.text
    return chunks


def _runs(tokenizer: Tokenizer, rng: random.Random) -> list[tuple[list[int], list[int]]]:
    """(prompt, generated) pairs: real text, random ids (byte pieces, specials, invalid bytes), and
    prompts that end in the middle of a character."""
    vocab = tokenizer.vocab_size
    specials = [i for i in range(vocab) if tokenizer.is_special(i)]
    runs = []
    for text in DETOKENIZER_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        runs.append((tokenizer.encode("Hi there"), ids))
        cut = tokenizer.encode("🤖", add_special_tokens=False)[:1]  # a prompt ending on part of a character
        runs.append((cut, ids))
    for _ in range(150):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        if specials and rng.random() < 0.5:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        runs.append((prompt, ids))
    return runs


@pytest.mark.parametrize("name", sorted([*FOLDER_BUILDERS, "builtin", "builtin-random"]))
def test_the_byte_level_path_streams_what_decoding_streams(tokenizers: dict[str, Tokenizer], name: str) -> None:
    tokenizer = tokenizers[name]
    rng = random.Random(name)
    for prompt, ids in _runs(tokenizer, rng):
        for skip in (True, False):
            fast = _stream(CountingDecodes(tokenizer), ids, prompt, skip)
            slow = _stream(CountingDecodes(tokenizer, tables=False), ids, prompt, skip)
            assert fast == slow, (name, prompt, ids, skip)


def test_text_held_back_is_not_skipped_by_a_whole_token(tokenizers: dict[str, Tokenizer]) -> None:
    # U+FFFD's own bytes are whole UTF-8, yet decoding holds text that ends in it back; the next
    # whole token must come after it, not instead of it
    tokenizer = tokenizers["builtin-random"]
    ids = [*"\ufffd".encode(), ord("a"), *"é".encode()[:1], ord("b")]
    for prompt in ([], [ord("x")]):
        fast = _stream(CountingDecodes(tokenizer), ids, prompt, True)
        assert fast == _stream(CountingDecodes(tokenizer, tables=False), ids, prompt, True)
        assert "".join(fast) == "\ufffda\ufffdb"


def test_byte_level_tokenizers_have_tables_and_sentencepiece_has_none(tokenizers: dict[str, Tokenizer]) -> None:
    for name in ("llama3", "qwen2", "builtin", "builtin-random"):
        assert tokenizers[name].byte_tables() is not None, name
    assert tokenizers["metaspace"].byte_tables() is None
    assert isinstance(tokenizers["builtin-random"], BuiltinTokenizer)


def test_every_token_of_the_builtin_vocabulary_decodes_as_its_bytes(tokenizers: dict[str, Tokenizer]) -> None:
    tokenizer = tokenizers["builtin"]
    table, whole = tokenizer.byte_tables()  # type: ignore[misc]
    assert len(whole) > len(table) // 2
    for token_id, raw in table.items():
        assert tokenizer.decode([token_id]) == raw.decode("utf-8", errors="replace"), token_id
        assert tokenizer.decode([token_id, token_id]) == (raw * 2).decode("utf-8", errors="replace"), token_id
        if token_id in whole:
            assert whole[token_id] == tokenizer.decode([token_id])


def test_ordinary_text_streams_without_decoding(tokenizers: dict[str, Tokenizer]) -> None:
    tokenizer = tokenizers["builtin"]
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog, again and again.", add_special_tokens=False)
    counting = CountingDecodes(tokenizer)
    chunks = _stream(counting, ids, tokenizer.encode("Once upon a time"), True)
    assert "".join(chunks) == tokenizer.decode(ids)
    assert counting.decodes <= 2, counting.decodes  # the final flush; every token took its own text
    reference = CountingDecodes(tokenizer, tables=False)
    _stream(reference, ids, tokenizer.encode("Once upon a time"), True)
    assert reference.decodes >= 2 * len(ids)


def test_no_tables_where_decode_would_disagree(tmp_path: Path) -> None:
    from tokenizers import decoders

    from services.common.byte_level import _agrees, byte_table

    tokenizer = load_tokenizer(str(FOLDER_BUILDERS["qwen2"](tmp_path / "q")))
    backend = tokenizer.backend  # type: ignore[attr-defined]
    table = byte_table(backend)
    assert table is not None and _agrees(backend, table)
    # one token's bytes wrong: the sample check finds it (every single token is in the sample here)
    wrong = dict(table)
    token_id = next(i for i, raw in sorted(table.items()) if raw.isalpha())
    wrong[token_id] = wrong[token_id].upper() + b"!"
    assert not _agrees(backend, wrong)
    # a decoder that rewrites text after the bytes: not the plain byte-level one
    backend.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Replace("a", "b")])
    assert byte_table(backend) is None

