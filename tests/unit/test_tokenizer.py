"""Tokenizer, chat template and incremental detokenizer.

The Hugging Face side is checked against transformers itself (a test-only dependency) on tiny
tokenizers trained here from an in-test corpus, so nothing is downloaded.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

import pytest
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as BackendTokenizer

from services.common.builtin_tokenizer import (
    BUILTIN_BOS_ID,
    BUILTIN_EOS_ID,
    BUILTIN_PAD_ID,
    BUILTIN_VOCAB_SIZE,
    BuiltinTokenizer,
)
from services.common.detokenizer import IncrementalDetokenizer
from services.common.tokenizer import ChatTemplateError, Tokenizer, TokenizerLoadError, load_tokenizer

SAMPLE_TEXTS = [
    "Hello world",
    " leading space and  double  spaces",
    "naïve café résumé",
    "emoji 🤖🎉 and CJK 世界你好",
    "line1\nline2\n\n    indented\ttab",
    "numbers 1234567 + 89 = 1234656",
    "",
]

THREE_MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi! Ça va? 🤖"},
    {"role": "assistant", "content": "Oui."},
]


# --- byte tokenizer of the random test model (--model builtin-random) ---------------------------


@pytest.fixture(scope="module")
def builtin() -> Tokenizer:
    return load_tokenizer("builtin-random")


def test_builtin_constants_and_special_ids(builtin: Tokenizer) -> None:
    assert isinstance(load_tokenizer("builtin-random"), BuiltinTokenizer)
    assert not isinstance(load_tokenizer("builtin"), BuiltinTokenizer)  # the default is the shipped folder
    assert (BUILTIN_PAD_ID, BUILTIN_BOS_ID, BUILTIN_EOS_ID, BUILTIN_VOCAB_SIZE) == (256, 257, 258, 264)
    assert builtin.vocab_size == 264
    assert (builtin.bos_token_id, builtin.pad_token_id) == (257, 256)
    assert builtin.eos_token_ids == [258, 262]
    assert [builtin.is_special(i) for i in (0, 255, 256, 262, 263)] == [False, False, True, True, True]


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_builtin_round_trip_is_utf8_bytes(builtin: Tokenizer, text: str) -> None:
    ids = builtin.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    assert builtin.encode(text) == [BUILTIN_BOS_ID, *ids]
    assert builtin.decode(builtin.encode(text)) == text


def test_builtin_special_token_strings_map_to_their_ids(builtin: Tokenizer) -> None:
    text = "<|system|>a<|end|><|user|>é<|eos|><|pad|><|assistant|><|unused0|><|nope|>"
    ids = builtin.encode(text, add_special_tokens=False)
    assert ids == [259, 97, 262, 260, 0xC3, 0xA9, 258, 256, 261, 263, *b"<|nope|>"]
    assert builtin.decode(ids, skip_special_tokens=False) == text
    assert builtin.decode(ids) == "aé<|nope|>"


def test_builtin_chat_template_renders_tool_calls_as_the_forced_call_text(builtin: Tokenizer) -> None:
    """An agent's round trip: the assistant's calls come back as the text a forced call generates
    ({"name", "parameters"} joined by "; "), the tool's result as a user turn."""
    chat = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_2", "type": "function", "function": {"name": "clock", "arguments": {}}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "noon"}]},
    ]
    assert builtin.apply_chat_template(chat) == (
        '<|bos|><|user|>Weather?<|end|><|assistant|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "clock", "parameters": {}}<|end|><|user|>Tool result: sunny<|end|>'
        "<|user|>Tool result: noon<|end|><|assistant|>"
    )
    spoken = [{"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"q": "é"}}}]}]
    assert builtin.apply_chat_template(spoken, add_generation_prompt=False) == (
        '<|bos|><|assistant|>Let me look.{"name": "f", "parameters": {"q": "é"}}<|end|>'
    )


def test_builtin_decode_rejects_ids_outside_vocabulary(builtin: Tokenizer) -> None:
    with pytest.raises(ValueError, match="264"):
        builtin.decode([1, 264])


def test_builtin_chat_template_exact_output(builtin: Tokenizer) -> None:
    rendered = builtin.apply_chat_template(THREE_MESSAGES, add_generation_prompt=True)
    assert rendered == (
        "<|bos|><|system|>You are terse.<|end|><|user|>Hi! Ça va? 🤖<|end|>"
        "<|assistant|>Oui.<|end|><|assistant|>"
    )
    without_prompt = builtin.apply_chat_template(THREE_MESSAGES, add_generation_prompt=False)
    assert without_prompt == rendered.removesuffix("<|assistant|>")

    ids = builtin.encode_chat(THREE_MESSAGES)
    assert ids[:2] == [257, 259] and ids.count(257) == 1  # one bos: encode_chat adds none of its own
    assert ids[-2:] == [262, 261]
    assert builtin.decode(ids, skip_special_tokens=False) == rendered


def test_builtin_chat_template_accepts_content_parts_and_rejects_unknown_roles(builtin: Tokenizer) -> None:
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}],
        }
    ]
    assert builtin.apply_chat_template(parts) == "<|bos|><|user|>ab<|end|><|assistant|>"
    with pytest.raises(ChatTemplateError, match="roles system, user, assistant and tool, not ipython"):
        builtin.apply_chat_template([{"role": "ipython", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="empty"):
        builtin.apply_chat_template([])
    # A tool-calling assistant turn has content None; it renders as empty content.
    assert builtin.apply_chat_template(
        [{"role": "assistant", "content": None}], add_generation_prompt=False
    ) == ("<|bos|><|assistant|><|end|>")


# --- Hugging Face folders, compared with transformers ----------------------------------------

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thanks.",
    "Tokenizers split text into pieces; models read the pieces and write new ones.",
    "naïve café résumé über straße",
    "numbers 1234 5678 + 90 = 6912, and more numbers: 3.14159",
    "def main():\n    print('hello')\n    return 0\n",
] * 10

# Llama 3 instruct template (verbatim from the Hub).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# Qwen2.5-style ChatML with tools, written on several lines so trim_blocks/lstrip_blocks matter,
# and with a `continue` that needs the loopcontrols extension.
CHATML_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{% for message in messages %}
    {% if message.role == "system" and loop.first %}{% continue %}{% endif %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{% endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Mistral / Llama 2 [INST] template, shipped as chat_template.jinja.
INST_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

QWEN2_SPLIT_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _train_bpe(tokenizer: BackendTokenizer, special_tokens: list[str], alphabet: list[str]) -> None:
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=special_tokens, initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS, trainer)


def _write_folder(
    folder: Path, backend: BackendTokenizer, tokenizer_config: dict, **extra_files: object
) -> Path:
    folder.mkdir(parents=True)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    for name, content in extra_files.items():
        text = content if isinstance(content, str) else json.dumps(content)
        (folder / name.replace("__", ".")).write_text(text, encoding="utf-8")
    return folder


def build_llama3_folder(folder: Path) -> Path:
    """Byte-level BPE whose post-processor adds <|begin_of_text|>, Llama 3 style."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    specials = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ]
    _train_bpe(backend, specials, pre_tokenizers.ByteLevel.alphabet())
    bos_id = backend.token_to_id("<|begin_of_text|>")
    backend.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                special_tokens=[("<|begin_of_text|>", bos_id)],
            ),
        ]
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3_TEMPLATE,
    }
    generation = {"eos_token_id": [backend.token_to_id("<|end_of_text|>"), backend.token_to_id("<|eot_id|>")]}
    return _write_folder(folder, backend, config, generation_config__json=generation)


def build_qwen2_folder(folder: Path) -> Path:
    """Qwen2-style byte-level BPE (NFC + split regex), no bos, ChatML template, a non-special added token."""
    backend = BackendTokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(pattern=Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    _train_bpe(backend, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], pre_tokenizers.ByteLevel.alphabet())
    backend.add_tokens(["<tool_call>"])
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    added = {
        str(token_id): {
            "content": token.content,
            "special": token.special,
            "lstrip": False,
            "rstrip": False,
            "normalized": token.normalized,
            "single_word": False,
        }
        for token_id, token in backend.get_added_tokens_decoder().items()
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "added_tokens_decoder": added,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    return _write_folder(
        folder, backend, config, config__json={"eos_token_id": backend.token_to_id("<|endoftext|>")}
    )


def build_metaspace_folder(folder: Path) -> Path:
    """Llama 2 / Mistral style: metaspace BPE with byte fallback, bos from the post-processor, template file."""
    backend = BackendTokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    _train_bpe(backend, ["<unk>", "<s>", "</s>"], [])
    # Byte-fallback pieces <0x00>..<0xFF> must be ordinary vocabulary entries, not added tokens.
    data = json.loads(backend.to_str())
    vocab = data["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    backend = BackendTokenizer.from_str(json.dumps(data))
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", backend.token_to_id("<s>"))]
    )
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "chat_template": "this template is overridden by chat_template.jinja",
    }
    return _write_folder(folder, backend, config, chat_template__jinja=INST_TEMPLATE)


FOLDER_BUILDERS = {
    "llama3": build_llama3_folder,
    "qwen2": build_qwen2_folder,
    "metaspace": build_metaspace_folder,
}

CONVERSATIONS = {
    "llama3": THREE_MESSAGES,
    "qwen2": THREE_MESSAGES,
    "metaspace": [
        {"role": "user", "content": "Hi! Ça va? 🤖"},
        {"role": "assistant", "content": "Oui, merci."},
        {"role": "user", "content": "Count: 1 2 3"},
    ],
}

# A special-token string inside user text, per folder (transformers encodes it as the token).
SPECIAL_IN_TEXT = {
    "llama3": "stop<|eot_id|>here",
    "qwen2": "a<|im_end|>b <tool_call>",
    "metaspace": "x</s> y",
}


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_tokenizers")
    return {name: build(root / name) for name, build in FOLDER_BUILDERS.items()}


@pytest.fixture(scope="module", params=sorted(FOLDER_BUILDERS))
def pair(request: pytest.FixtureRequest, hf_folders: dict[str, Path]):
    """(name, ours, transformers') for one folder."""
    from transformers import AutoTokenizer

    folder = hf_folders[request.param]
    return request.param, load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(str(folder))


def _reference_chat_ids(reference, messages, **kwargs) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); 4.x a list.
    out = reference.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"] if isinstance(out, Mapping) or hasattr(out, "input_ids") else out)


def test_hf_encode_matches_transformers(pair) -> None:
    name, ours, reference = pair
    for text in [*SAMPLE_TEXTS, SPECIAL_IN_TEXT[name]]:
        for add_special_tokens in (True, False):
            expected = reference.encode(text, add_special_tokens=add_special_tokens)
            assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, (
                text,
                add_special_tokens,
            )


def test_hf_decode_matches_transformers(pair) -> None:
    name, ours, reference = pair
    rng = random.Random(7)
    id_lists = [ours.encode(text) for text in [*SAMPLE_TEXTS, SPECIAL_IN_TEXT[name]]]
    id_lists += [[rng.randrange(ours.vocab_size) for _ in range(12)] for _ in range(20)]
    for ids in id_lists:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip
            ), ids


def test_hf_special_ids_match_transformers(pair) -> None:
    name, ours, reference = pair
    assert ours.vocab_size == len(reference)
    assert ours.bos_token_id == reference.bos_token_id
    assert ours.pad_token_id == reference.pad_token_id
    assert ours.eos_token_ids[0] == reference.eos_token_id
    reference_special = set(reference.all_special_ids) | {
        token_id for token_id, token in reference.added_tokens_decoder.items() if token.special
    }
    assert {i for i in range(ours.vocab_size) if ours.is_special(i)} == reference_special


def test_hf_chat_template_matches_transformers(pair) -> None:
    name, ours, reference = pair
    messages = CONVERSATIONS[name]
    for add_generation_prompt in (True, False):
        expected = reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    assert ours.encode_chat(messages) == _reference_chat_ids(reference, messages, add_generation_prompt=True)


def test_hf_chat_with_tools_matches_transformers(hf_folders: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    ours, reference = (
        load_tokenizer(str(hf_folders["qwen2"])),
        AutoTokenizer.from_pretrained(str(hf_folders["qwen2"])),
    )
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Météo d'une ville",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    messages = [{"role": "user", "content": "Weather in Zürich?"}]
    expected = reference.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert ours.apply_chat_template(messages, tools=tools) == expected
    assert "Météo" in expected  # tojson keeps non-ASCII as is
    assert ours.encode_chat(messages, tools=tools) == _reference_chat_ids(
        reference, messages, tools=tools, add_generation_prompt=True
    )


def test_hf_messages_are_normalized_like_transformers(hf_folders: dict[str, Path], tmp_path: Path) -> None:
    # OpenAI clients send `"tool_calls": null`; older clients name reasoning `reasoning`.
    from transformers import AutoTokenizer

    template = (
        "{% for m in messages %}{{ m.role }}:{{ m.reasoning_content }}|{{ m.thinking }}|"
        "{{ m.tool_calls is defined }}|{{ m.content is defined }};{% endfor %}{{ documents is none }}"
    )
    folder = _copy_folder(hf_folders["llama3"], tmp_path / "normalize", {"chat_template": template})
    ours, reference = load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(str(folder))
    messages = [{"role": "assistant", "content": None, "reasoning": "why", "tool_calls": None}]
    expected = reference.apply_chat_template(messages, tokenize=False)
    assert ours.apply_chat_template(messages) == expected == "assistant:why|why|False|False;True"
    assert messages[0]["content"] is None  # the caller's messages are left alone


def test_hf_template_exception_becomes_chat_template_error(hf_folders: dict[str, Path]) -> None:
    ours = load_tokenizer(str(hf_folders["metaspace"]))
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        ours.apply_chat_template([{"role": "assistant", "content": "first"}])


def test_hf_stop_ids_come_from_tokenizer_generation_and_model_config(hf_folders: dict[str, Path]) -> None:
    llama3 = load_tokenizer(str(hf_folders["llama3"]))
    eot, end = (llama3.encode(t, add_special_tokens=False)[0] for t in ("<|eot_id|>", "<|end_of_text|>"))
    assert llama3.eos_token_ids == [eot, end]  # tokenizer eos first, then generation_config's
    qwen2 = load_tokenizer(str(hf_folders["qwen2"]))
    im_end, endoftext = (qwen2.encode(t)[0] for t in ("<|im_end|>", "<|endoftext|>"))
    assert qwen2.eos_token_ids == [im_end, endoftext]  # config.json's eos_token_id is a stop id too
    assert qwen2.bos_token_id is None and qwen2.pad_token_id == endoftext


def _copy_folder(source: Path, target: Path, config_changes: dict, drop: tuple[str, ...] = ()) -> Path:
    target.mkdir()
    for path in source.iterdir():
        if path.name not in drop:
            (target / path.name).write_bytes(path.read_bytes())
    config = json.loads((target / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.update(config_changes)
    (target / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return target


def test_hf_bos_comes_from_post_processor_not_add_bos_token(
    hf_folders: dict[str, Path], tmp_path: Path
) -> None:
    # transformers 5 ignores add_bos_token/add_eos_token when tokenizer.json exists: the
    # post-processor alone decides. Both directions are checked against it.
    from transformers import AutoTokenizer

    keeps_bos = _copy_folder(hf_folders["llama3"], tmp_path / "keeps", {"add_bos_token": False})
    no_post_processor = json.loads((hf_folders["qwen2"] / "tokenizer.json").read_text(encoding="utf-8"))
    no_post_processor["post_processor"] = None
    gains_nothing = _copy_folder(
        hf_folders["qwen2"],
        tmp_path / "nothing",
        {"add_bos_token": True, "add_eos_token": True, "bos_token": "<|endoftext|>"},
    )
    (gains_nothing / "tokenizer.json").write_text(json.dumps(no_post_processor), encoding="utf-8")
    for folder, starts_with_bos in ((keeps_bos, True), (gains_nothing, False)):
        ours, reference = load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(str(folder))
        ids = ours.encode("Hello world")
        assert ids == reference.encode("Hello world")
        assert (ids[0] == ours.bos_token_id) is starts_with_bos
        assert ids[-1] not in ours.eos_token_ids


def test_hf_split_special_tokens_encodes_them_as_text(hf_folders: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = _copy_folder(hf_folders["qwen2"], tmp_path / "split", {"split_special_tokens": True})
    ours, reference = load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(str(folder))
    ids = ours.encode("a<|im_end|>b")
    assert ids == reference.encode("a<|im_end|>b")
    assert ours.eos_token_ids[0] not in ids


def test_hf_named_templates_pick_default_or_tool_use(hf_folders: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    templates = [
        {"name": "default", "template": "D{% for m in messages %}|{{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": "T{{ tools | tojson(indent=2) }}{{ strftime_now('%Y') }}"},
    ]
    folder = _copy_folder(hf_folders["llama3"], tmp_path / "named", {"chat_template": templates})
    ours, reference = load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(str(folder))
    messages = [{"role": "user", "content": "ü"}]
    assert (
        ours.apply_chat_template(messages) == reference.apply_chat_template(messages, tokenize=False) == "D|ü"
    )
    tools = [{"name": "f", "description": "ß"}]
    with_tools = ours.apply_chat_template(messages, tools=tools)
    assert with_tools == reference.apply_chat_template(messages, tools=tools, tokenize=False)
    assert with_tools == "T" + json.dumps(tools, ensure_ascii=False, indent=2) + str(datetime.now().year)


def test_hf_folder_without_template_or_tokenizer_json_fails_clearly(
    hf_folders: dict[str, Path], tmp_path: Path
) -> None:
    no_template = _copy_folder(hf_folders["llama3"], tmp_path / "plain", {"chat_template": None})
    with pytest.raises(ChatTemplateError, match="no chat template"):
        load_tokenizer(str(no_template)).apply_chat_template([{"role": "user", "content": "x"}])

    no_tokenizer_json = _copy_folder(hf_folders["llama3"], tmp_path / "broken", {}, drop=("tokenizer.json",))
    with pytest.raises(TokenizerLoadError, match=r"tokenizer\.json"):
        load_tokenizer(str(no_tokenizer_json))
    with pytest.raises(TokenizerLoadError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nowhere"))


# --- incremental detokenizer ------------------------------------------------------------------

DETOKENIZER_TEXTS = [
    "Hello, world! How are you?",
    "emoji 🤖🎉👍🏽 split over bytes",
    "CJK 世界你好 and naïve café",
    "  spaces\n\nnewlines\tand tabs  ",
    "🤖",
]


def _stream(tokenizer: Tokenizer, ids: list[int], **kwargs) -> tuple[list[str], str]:
    detokenizer = IncrementalDetokenizer(tokenizer, **kwargs)
    chunks = [detokenizer.add(token_id) for token_id in ids]
    chunks.append(detokenizer.flush())
    assert "".join(chunks) == detokenizer.text
    return chunks, detokenizer.text


def _check_streaming(tokenizer: Tokenizer, text: str) -> None:
    for ids in (tokenizer.encode(text), tokenizer.encode(text, add_special_tokens=False)):
        for skip in (True, False):
            chunks, streamed = _stream(tokenizer, ids, skip_special_tokens=skip)
            assert streamed == tokenizer.decode(ids, skip_special_tokens=skip)
            assert not any("\ufffd" in chunk for chunk in chunks), chunks


@pytest.mark.parametrize("text", DETOKENIZER_TEXTS)
def test_detokenizer_builtin_streams_exactly_the_decoded_text(builtin: Tokenizer, text: str) -> None:
    _check_streaming(builtin, text)


def test_detokenizer_holds_back_split_characters(builtin: Tokenizer) -> None:
    chunks, _ = _stream(builtin, builtin.encode("a🤖b", add_special_tokens=False))
    assert chunks == ["a", "", "", "", "🤖", "b", ""]

    # A character cut off by the end of generation is only emitted by flush().
    detokenizer = IncrementalDetokenizer(builtin)
    assert [detokenizer.add(i) for i in "x🤖".encode()[:3]] == ["x", "", ""]
    assert detokenizer.flush() == "\ufffd"
    assert detokenizer.text == builtin.decode(list("x🤖".encode()[:3]))


def test_detokenizer_with_prompt_context(builtin: Tokenizer) -> None:
    prompt = builtin.encode_chat([{"role": "user", "content": "hi"}])
    generated = builtin.encode("¿Qué? 🤖<|end|>", add_special_tokens=False)
    _, streamed = _stream(builtin, generated, prompt_ids=prompt)
    assert streamed == "¿Qué? 🤖"


def test_detokenizer_hf_streams_exactly_the_decoded_text(pair) -> None:
    name, ours, _ = pair
    for text in DETOKENIZER_TEXTS:
        _check_streaming(ours, text)
    # After a prompt, the first generated word keeps its leading space (metaspace drops it at the
    # start of a sequence), so streamed text equals decode(prompt + generated) minus the prompt.
    prompt = ours.encode("The quick brown")
    generated = ours.encode(" fox 🤖 jumps", add_special_tokens=False)
    _, streamed = _stream(ours, generated, prompt_ids=prompt)
    whole, prompt_text = ours.decode(prompt + generated), ours.decode(prompt)
    assert whole.startswith(prompt_text) and streamed == whole[len(prompt_text) :], name
    assert streamed.startswith(" fox"), name


def test_detokenizer_hf_holds_back_byte_pieces_of_an_emoji(pair) -> None:
    name, ours, _ = pair
    ids = ours.encode("🤖", add_special_tokens=False)
    assert len(ids) >= 2, name  # the tiny vocabularies have no emoji token: it is split into bytes
    chunks, streamed = _stream(ours, ids)
    assert streamed == "🤖" and chunks.count("🤖") == 1


def test_hf_encode_gives_the_backends_own_encode_ids(hf_folders: dict[str, Path]) -> None:
    # encode() uses the batch form without character offsets: its ids must be the plain encode's
    texts = [*DETOKENIZER_TEXTS, "", " ", "a<|im_end|>b", "stop<|eot_id|>here", "x</s> y", "\n\n\t  end ", "ü" * 300,
             "The quick brown fox " * 200]
    for name, tokenizer in [(n, load_tokenizer(str(f))) for n, f in hf_folders.items()] + [("builtin", load_tokenizer(None))]:
        for text in texts:
            for special in (True, False):
                assert tokenizer.encode(text, add_special_tokens=special) == tokenizer.backend.encode(
                    text, add_special_tokens=special).ids, (name, text[:40], special)
