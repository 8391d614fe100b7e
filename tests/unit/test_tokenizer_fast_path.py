"""The byte-level BPE fast path (services/common/bpe_fast_path.py) gives the backend's ids exactly.

Every check compares HuggingFaceTokenizer.encode with the backend's own encode and with the batch
form encode used before the fast path, on the built-in model and on tiny tokenizers trained here.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as BackendTokenizer

from services.common import bpe_fast_path
from services.common.bpe_fast_path import ASCII_SPLIT, BpeFastPath
from services.common.tokenizer import HuggingFaceTokenizer, load_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 12345 o'clock; we'll see, they've gone.",
    "def main():\n    return {'a': 1, \"b\": [2, 3]}  # comment\n\n\tindented\ttabs\r\nwindows",
    "Numbers 0123456789 and x1y2z3, punctuation!!! ?? ... --- ((())) <tag> a<b>c",
    "I'm sure you're right, she'd say; HE'LL NOT. Don't stop.   Spaces   everywhere   ",
]

TRICKY = [
    "", " ", "  ", "\n", "\n\n  x", "x\n\n", "   x", "x   ", "x   y", "a \n b", " \t x", "\t\tfoo\t",
    "\x0b", "\x0c", "a\x0bb", "a\x0cb", " \x0b x", "\x1c\x1d\x1e\x1f", "a\x1cb", "\x00\x7f", "\r\n",
    "it's", "it 's", "it'S", "IT'S", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'RE", "'Ve",
    "we'll they've I'm you're she'd don't", "''s", "'''", "x'", "'x", "' s", "rock'n'roll",
    "abc123def", "123abc", "1 2 3", " 12345678901234567890", "3.14159", "1,000,000", "a1b2c3",
    "!!!", "?!.", " ...", "a...b", "--x--", " (a) [b] {c}", "<>", "<|", "|>", "< |bos| >", "<|bos",
    "word  ", "word \n", "word\n ", " \n \n ", "x" * 200, " " * 100 + "x", "y" * 64 + " " + "z" * 65,
    "12345: The quick brown fox jumps over the lazy dog. Tell me a story about it.",
]


def _pairs_of_every_character() -> list[str]:
    texts = []
    for code in range(128):
        c = chr(code)
        texts += [c, c + c, c * 3, "a" + c, c + "a", " " + c, c + " ", "  " + c + "  a", "a" + c + "b", "1" + c,
                  c + "1", "'" + c, c + "'s", c + "\n", "\n" + c, c + " " + c]
    return texts


def _random_texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = [chr(i) for i in range(128)]
    weights = [1.0] * 128
    for c, w in {" ": 60, "\n": 12, "\t": 4, "'": 8, ".": 6, ",": 6, "!": 3, "-": 3, "<": 2, "|": 2, ">": 2,
                 "s": 6, "t": 6, "e": 8, "r": 4, "v": 3, "m": 3, "l": 4, "d": 4, "S": 2, "0": 3, "1": 3}.items():
        weights[ord(c)] = w
    for c in "abcfghijknopquwxyzABCDEFGHIJKLMNOPQRTUVWXYZ23456789":
        weights[ord(c)] = 3
    return ["".join(rng.choices(alphabet, weights, k=rng.randint(0, 60))) for _ in range(count)]


def _assert_same(tokenizer: HuggingFaceTokenizer, texts: list[str]) -> None:
    backend = tokenizer.backend
    for text in texts:
        for special in (True, False):
            ours = tokenizer.encode(text, add_special_tokens=special)
            assert type(ours) is list
            assert ours == backend.encode(text, add_special_tokens=special).ids, (text, special)
            assert ours == backend.encode_batch_fast([text], add_special_tokens=special)[0].ids, (text, special)


def _wrap(backend: BackendTokenizer) -> HuggingFaceTokenizer:
    return HuggingFaceTokenizer(backend, clean_up_tokenization_spaces=False, bos_token_id=None, eos_token_ids=[],
                                pad_token_id=None, special_token_strings={}, chat_templates={})


def _trained(model: models.Model, pre_tokenizer, specials: list[str], alphabet: list[str]) -> BackendTokenizer:
    backend = BackendTokenizer(model)
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    trainer_kind = trainers.BpeTrainer if isinstance(model, models.BPE) else trainers.WordPieceTrainer
    trainer = trainer_kind(vocab_size=400, special_tokens=specials, show_progress=False, initial_alphabet=alphabet)
    backend.train_from_iterator(CORPUS * 3, trainer)
    return backend


def _byte_level_bpe(*, add_prefix_space: bool = False) -> BackendTokenizer:
    return _trained(models.BPE(), pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True),
                    ["<s>", "</s>", "<|endoftext|>"], pre_tokenizers.ByteLevel.alphabet())


@pytest.fixture(scope="module")
def builtin() -> HuggingFaceTokenizer:
    tokenizer = load_tokenizer("builtin")
    assert isinstance(tokenizer, HuggingFaceTokenizer)
    return tokenizer


# --- the split pattern -------------------------------------------------------------------------------


def test_ascii_split_equals_the_byte_level_pre_tokenizer() -> None:
    reference = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    table = BpeFastPath(models.BPE(), add_prefix_space=False, added_contents=[], prefix=(), suffix=())._to_alphabet
    texts = [*TRICKY, *_pairs_of_every_character(), *_random_texts(5000, seed=11)]
    for text in texts:
        expected = [piece for piece, _ in reference.pre_tokenize_str(text)]
        assert [piece.translate(table) for piece in ASCII_SPLIT.findall(text)] == expected, text


# --- the built-in model --------------------------------------------------------------------------------


def test_builtin_model_takes_the_fast_path(builtin: HuggingFaceTokenizer) -> None:
    fast = builtin._fast_path
    assert fast is not None
    text = "12345: The quick brown fox jumps over the lazy dog. Tell me a story about it."
    assert fast.encode(text, True) == builtin.backend.encode(text).ids
    assert fast.encode(text, True)[0] == builtin.backend.token_to_id("<|bos|>")
    assert fast.encode(text, False) == builtin.backend.encode(text, add_special_tokens=False).ids


def test_builtin_model_same_ids_on_tricky_texts(builtin: HuggingFaceTokenizer) -> None:
    _assert_same(builtin, TRICKY + _pairs_of_every_character())


def test_builtin_model_same_ids_on_random_texts(builtin: HuggingFaceTokenizer) -> None:
    texts = _random_texts(5000, seed=3)
    _assert_same(builtin, texts)
    # the second round reads the cache
    _assert_same(builtin, texts[:500])


def test_builtin_model_added_tokens_and_non_ascii_go_to_the_backend(builtin: HuggingFaceTokenizer) -> None:
    fast = builtin._fast_path
    assert fast is not None
    added = [t.content for t in builtin.backend.get_added_tokens_decoder().values()]
    assert "<|bos|>" in added and "<|user|>" in added
    texts = [f"a{token}b" for token in added] + [token for token in added] + [
        "<|user|>\nhi<|end|>\n<|assistant|>\n", "x <|eos|>", "<|system|>You are terse.<|end|>",
        "naïve café", "emoji 🤖", "a\x80b", "\u00a0x", "x\u2028y", "plain ascii then é",
    ]
    for text in texts:
        for special in (True, False):
            assert fast.encode(text, special) is None, text
    _assert_same(builtin, texts)
    # near misses of added tokens stay on the fast path
    for text in ["<|bos", "<|user |>", "< |end|>", "<<|>>", "<|"]:
        assert fast.encode(text, True) is not None, text


def test_builtin_model_matches_transformers(builtin: HuggingFaceTokenizer) -> None:
    from transformers import AutoTokenizer

    from services.common.tokenizer import BUILTIN_MODEL_DIR

    reference = AutoTokenizer.from_pretrained(str(BUILTIN_MODEL_DIR))
    for text in [*TRICKY, *_random_texts(300, seed=5), "a<|end|>b"]:
        for special in (True, False):
            assert builtin.encode(text, add_special_tokens=special) == reference.encode(
                text, add_special_tokens=special), (text, special)


# --- other eligible configurations ---------------------------------------------------------------------


@pytest.mark.parametrize("add_prefix_space", [False, True])
@pytest.mark.parametrize("post_processor", ["none", "byte_level", "bos_eos", "sequence"])
def test_trained_byte_level_bpe_same_ids(add_prefix_space: bool, post_processor: str) -> None:
    backend = _byte_level_bpe(add_prefix_space=add_prefix_space)
    template = processors.TemplateProcessing(
        single="<s> $A </s> </s>", pair="<s> $A </s> $B", special_tokens=[
            ("<s>", backend.token_to_id("<s>")), ("</s>", backend.token_to_id("</s>"))])
    backend.post_processor = {
        "none": None,
        "byte_level": processors.ByteLevel(trim_offsets=False),
        "bos_eos": template,
        "sequence": processors.Sequence([processors.ByteLevel(trim_offsets=False), template]),
    }[post_processor]
    backend.add_tokens(["<tool_call>", "x y"])
    tokenizer = _wrap(backend)
    assert tokenizer._fast_path is not None
    texts = [*TRICKY, *_pairs_of_every_character(), *_random_texts(1500, seed=7),
             "a<tool_call>b", "x y", "<s> hi </s>", "<|endoftext|>", "é"]
    _assert_same(tokenizer, texts)
    if post_processor in ("bos_eos", "sequence"):
        s, e = backend.token_to_id("<s>"), backend.token_to_id("</s>")
        ids = tokenizer.encode("hello")
        assert ids[0] == s and ids[-2:] == [e, e]


def test_tiny_qwen2_tools_checkpoint_takes_the_fast_path(tmp_path: Path) -> None:
    # The tool-calling test checkpoint: its tokenizer.json has the plain ByteLevel pre-tokenizer and
    # non-special added tokens. (transformers 5 does not read that pre-tokenizer: config.json says
    # qwen2, and its Qwen2Tokenizer puts Qwen2's split regex in; so only the backend is compared.)
    from services.fakes.hf_checkpoints import save_tiny_qwen2_tools

    folder = save_tiny_qwen2_tools(tmp_path / "qwen2_tools")
    tokenizer = load_tokenizer(str(folder))
    assert isinstance(tokenizer, HuggingFaceTokenizer) and tokenizer._fast_path is not None
    texts = [*TRICKY, *_random_texts(500, seed=9), '<tool_call>\n{"name": "f"}\n</tool_call>', "<|im_start|>x"]
    _assert_same(tokenizer, texts)


# --- ineligible tokenizers ---------------------------------------------------------------------------------


def _split_then_byte_level() -> BackendTokenizer:  # Qwen2 / Llama 3 style
    pattern = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
    return _trained(models.BPE(), pre_tokenizers.Sequence([
        pre_tokenizers.Split(pattern=Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
        ["<|endoftext|>"], pre_tokenizers.ByteLevel.alphabet())


def _normalized() -> BackendTokenizer:
    backend = _byte_level_bpe()
    backend.normalizer = normalizers.NFC()
    return backend


def _no_regex() -> BackendTokenizer:
    return _trained(models.BPE(), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False), [],
                    pre_tokenizers.ByteLevel.alphabet())


def _word_piece() -> BackendTokenizer:
    return _trained(models.WordPiece(unk_token="[UNK]"), pre_tokenizers.ByteLevel(add_prefix_space=False),
                    ["[UNK]"], pre_tokenizers.ByteLevel.alphabet())


def _truncating() -> BackendTokenizer:
    backend = _byte_level_bpe()
    backend.enable_truncation(5)
    return backend


def _padding() -> BackendTokenizer:
    backend = _byte_level_bpe()
    backend.enable_padding(length=40, pad_id=0)
    return backend


def _roberta() -> BackendTokenizer:
    backend = _byte_level_bpe()
    backend.post_processor = processors.RobertaProcessing(("</s>", backend.token_to_id("</s>")),
                                                          ("<s>", backend.token_to_id("<s>")))
    return backend


def _pair_only_template() -> BackendTokenizer:
    backend = _byte_level_bpe()
    backend.post_processor = processors.TemplateProcessing(
        single="$A <s> $A", pair="$A $B", special_tokens=[("<s>", backend.token_to_id("<s>"))])
    return backend


def _with_dropout() -> BackendTokenizer:
    backend = _byte_level_bpe()
    backend.model.dropout = 0.5
    return backend


def _with_suffix() -> BackendTokenizer:
    backend = _byte_level_bpe()
    backend.model.end_of_word_suffix = "</w>"  # set after training: the trainer makes a new model
    return backend


INELIGIBLE = {
    "split_then_byte_level": _split_then_byte_level,
    "normalizer": _normalized,
    "byte_level_without_regex": _no_regex,
    "word_piece": _word_piece,
    "truncation": _truncating,
    "padding": _padding,
    "roberta_post_processor": _roberta,
    "template_with_a_twice": _pair_only_template,
    "bpe_dropout": _with_dropout,
    "end_of_word_suffix": _with_suffix,
}


@pytest.mark.parametrize("name", sorted(INELIGIBLE))
def test_ineligible_tokenizers_use_the_backend(name: str) -> None:
    tokenizer = _wrap(INELIGIBLE[name]())
    assert tokenizer._fast_path is None, name
    if name != "bpe_dropout":  # random merges: no two encodes agree
        _assert_same(tokenizer, [*TRICKY[:40], *_random_texts(200, seed=13)])


# --- the cache ------------------------------------------------------------------------------------------------


def test_cache_stays_bounded(builtin: HuggingFaceTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    fast = BpeFastPath.for_backend(builtin.backend)
    assert fast is not None
    backend = builtin.backend
    rng = random.Random(17)

    def check(text: str) -> None:
        assert fast.encode(text, False) == backend.encode(text, add_special_tokens=False).ids

    monkeypatch.setattr(bpe_fast_path, "MAX_CACHE_ENTRIES", 100)
    for _ in range(300):
        check(" ".join("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 12))) for _ in range(5)))
        assert fast.cache_size[0] <= 100
    assert fast.cache_size[0] > 0
    # punctuation runs are about one id per character: the ids bound holds them
    monkeypatch.setattr(bpe_fast_path, "MAX_CACHE_ENTRIES", 10_000)
    monkeypatch.setattr(bpe_fast_path, "MAX_CACHED_IDS", 500)
    for _ in range(300):
        check(" ".join("".join(rng.choices("!#$%&()*+,-./:;=?@[]^_`{|}~", k=rng.randint(10, 60))) for _ in range(3)))
        pieces, ids = fast.cache_size
        assert ids <= 500 and ids == sum(map(len, fast._cache.values()))
    fast._cache.clear()
    long_piece = "a" * (bpe_fast_path.MAX_CACHED_PIECE + 1)
    check(long_piece + " " * 500)
    assert fast.cache_size[0] == 0  # neither piece is short enough to keep
