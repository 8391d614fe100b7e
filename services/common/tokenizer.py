"""One tokenizer interface for the router and the workers.

`load_tokenizer(path)` returns the tokenizer of a Hugging Face folder — the built-in model's
(models/pdmesh-tiny, for path None/"builtin"), or any local folder —, or the byte tokenizer of the
random test model ("builtin-random"). A folder is read (`tokenizer.json` + `tokenizer_config.json` + optional
`chat_template.jinja`, `generation_config.json`, `config.json`). Encoding, decoding and chat
rendering follow what `transformers` does for the same folder, so a prompt tokenized here equals the
prompt a user of transformers/vLLM would feed the model. No torch and no transformers import here:
the router uses this module and holds no model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from services.common.bpe_fast_path import BpeFastPath
from services.common.builtin_tokenizer import BuiltinTokenizer
from services.common.byte_level import byte_table
from services.common.tokenizer_base import (
    NAMED_SPECIAL_TOKENS,
    ChatTemplateError,
    Tokenizer,
    TokenizerLoadError,
    normalize_messages,
    render_chat_template,
)

# The built-in model is an ordinary Hugging Face folder shipped in the repository
# (scripts/train_builtin.py made it); "builtin" (the default) loads it like any downloaded checkpoint.
BUILTIN_MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "pdmesh-tiny"
# A random tiny Llama over a byte vocabulary, made from a seed with no files
# (services/engine/builtin_model.py): for tests that want byte-level tokens.
BUILTIN_RANDOM = "builtin-random"
# The names of the built-in models; the router serves either as "pdmesh-tiny".
BUILTIN_NAMES = ("", "builtin", BUILTIN_RANDOM)
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
EXTRA_CHAT_TEMPLATES_DIR = "additional_chat_templates"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"

# The batch encode below would mark the process as having used the tokenizers' thread pool, after
# which a fork prints a warning and turns it off; a batch of one gains nothing from it. A choice
# made in the environment stays.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

__all__ = ["BUILTIN_MODEL_DIR", "BUILTIN_NAMES", "BUILTIN_RANDOM", "ChatTemplateError", "HuggingFaceTokenizer",
           "Tokenizer", "TokenizerLoadError", "load_hf_tokenizer", "load_tokenizer", "normalize_messages",
           "render_chat_template", "resolve_model_path"]


class HuggingFaceTokenizer(Tokenizer):
    """A `tokenizers` backend configured like transformers' generic fast tokenizer."""

    def __init__(
        self, backend: BackendTokenizer, *, clean_up_tokenization_spaces: bool, **common: Any
    ) -> None:
        super().__init__(**common)
        self._backend = backend
        # transformers only applies the WordPiece-era space cleanup to non-BPE models.
        self._clean_up_spaces = clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE"
        named_ids = {self._backend.token_to_id(token) for token in self._special_token_strings.values()}
        flagged_ids = {
            token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special
        }
        self._special_ids = frozenset((named_ids | flagged_ids) - {None})
        # GPT-2-style byte-level BPE: ASCII prompts skip the backend's pre-tokenizer (bpe_fast_path.py)
        self._fast_path = BpeFastPath.for_backend(backend)

    @property
    def backend(self) -> BackendTokenizer:
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._fast_path is not None:
            ids = self._fast_path.encode(text, add_special_tokens)
            if ids is not None:
                return ids
        # the same ids as encode(): the batch form without character offsets, which nothing here
        # reads, costs about 30 % less (the router tokenizes every prompt)
        return self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_bytes(self) -> dict[int, bytes] | None:
        # the space clean-up rewrites text across token boundaries: no per-token promise then
        return None if self._clean_up_spaces else byte_table(self._backend)


def _clean_up_tokenization(text: str) -> str:
    for spaced, joined in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(spaced, joined)
    return text


def resolve_model_path(model_path: str | Path | None) -> str | Path:
    """The folder behind None/"" /"builtin" (the shipped models/pdmesh-tiny); other names unchanged."""
    if model_path is None or str(model_path) in ("", "builtin"):
        return BUILTIN_MODEL_DIR
    return model_path


def load_tokenizer(model_path: str | Path | None, tokenizer_path: str | Path | None = None) -> Tokenizer:
    """The tokenizer of a local HF folder (None/"builtin": the shipped built-in model's folder), or
    the byte tokenizer of the random test model for "builtin-random". `tokenizer_path` (vLLM's
    --tokenizer): a folder of its own for the tokenizer and its chat template, the model folder
    still listing the ids generation stops on (generation_config.json, config.json)."""
    if tokenizer_path:
        return load_hf_tokenizer(Path(resolve_model_path(tokenizer_path)),
                                 stop_ids_from=None if str(model_path) == BUILTIN_RANDOM
                                 else Path(resolve_model_path(model_path)))
    if str(model_path) == BUILTIN_RANDOM:
        return BuiltinTokenizer()
    return load_hf_tokenizer(Path(resolve_model_path(model_path)))


def load_hf_tokenizer(folder: Path, stop_ids_from: Path | None = None) -> HuggingFaceTokenizer:
    """`stop_ids_from`: the model folder whose generation_config.json and config.json list more
    ids that end generation, when the tokenizer has a folder of its own (also read: `folder`'s)."""
    if not folder.is_dir():
        raise TokenizerLoadError(f"tokenizer folder {folder} does not exist or is not a directory")
    tokenizer_file = folder / TOKENIZER_FILE
    if not tokenizer_file.is_file():
        raise TokenizerLoadError(
            f"{tokenizer_file} is missing: pdmesh reads only the fast-tokenizer file {TOKENIZER_FILE} "
            "(convert a sentencepiece/tiktoken tokenizer with transformers' save_pretrained first)"
        )
    try:
        backend = BackendTokenizer.from_file(str(tokenizer_file))
    except Exception as exc:
        raise TokenizerLoadError(f"cannot read {tokenizer_file}: {exc}") from exc
    config = _read_json(folder / TOKENIZER_CONFIG_FILE)

    special_strings = {
        name: content
        for name in NAMED_SPECIAL_TOKENS
        if (content := _token_content(config.get(name))) is not None
    }
    _add_missing_tokens(backend, config, special_strings)
    # "split_special_tokens" makes special-token strings in user text plain text, as in transformers.
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
    # bos/eos are added by tokenizer.json's post-processor alone (Llama 3's TemplateProcessing adds
    # <|begin_of_text|>, Qwen2's adds nothing). transformers 5 ignores add_bos_token/add_eos_token
    # in tokenizer_config.json whenever tokenizer.json exists, and so do we, so prompts match.

    def id_of(name: str) -> int | None:
        return backend.token_to_id(special_strings[name]) if name in special_strings else None

    return HuggingFaceTokenizer(
        backend,
        clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        bos_token_id=id_of("bos_token"),
        eos_token_ids=_stop_token_ids([folder] if stop_ids_from is None else [stop_ids_from, folder],
                                      id_of("eos_token")),
        pad_token_id=id_of("pad_token"),
        special_token_strings=special_strings,
        chat_templates=_load_chat_templates(folder, config),
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"{path} must hold a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json spells a token as a string or as a serialized AddedToken dict.
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _add_missing_tokens(
    backend: BackendTokenizer, config: Mapping[str, Any], special_strings: Mapping[str, str]
) -> None:
    # Usually tokenizer.json already lists every added token. When tokenizer_config.json declares
    # more (added_tokens_decoder, named or extra special tokens), transformers appends them; so do we,
    # so that ids agree.
    known = {token.content for token in backend.get_added_tokens_decoder().values()}
    declared: list[AddedToken] = []
    for _, spec in sorted(config.get("added_tokens_decoder", {}).items(), key=lambda item: int(item[0])):
        declared.append(
            AddedToken(
                spec["content"],
                single_word=spec.get("single_word", False),
                lstrip=spec.get("lstrip", False),
                rstrip=spec.get("rstrip", False),
                normalized=spec.get("normalized", not spec.get("special", False)),
                special=spec.get("special", False),
            )
        )
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    extra_strings = extra.values() if isinstance(extra, Mapping) else extra
    for content in [*special_strings.values(), *(_token_content(token) for token in extra_strings)]:
        if content is not None:
            declared.append(AddedToken(content, special=True, normalized=False))
    for token in declared:
        if token.content in known:
            continue
        known.add(token.content)
        if token.special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])


def _load_chat_templates(folder: Path, config: Mapping[str, Any]) -> dict[str, str]:
    # transformers: templates saved as files (chat_template.jinja = "default", plus
    # additional_chat_templates/<name>.jinja) replace the ones inside tokenizer_config.json.
    from_files: dict[str, str] = {}
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        from_files["default"] = (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    extra_dir = folder / EXTRA_CHAT_TEMPLATES_DIR
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            from_files[path.stem] = path.read_text(encoding="utf-8")
    if from_files:
        return from_files
    template = config.get("chat_template")
    if isinstance(template, str):
        return {"default": template}
    if isinstance(template, list):
        return {entry["name"]: entry["template"] for entry in template}
    return {}


def _stop_token_ids(folders: list[Path], tokenizer_eos_id: int | None) -> list[int]:
    # Instruct models often stop on more than the tokenizer's eos (Llama 3: <|eot_id|> and
    # <|end_of_text|>); generation_config.json and config.json list them.
    ids = [] if tokenizer_eos_id is None else [tokenizer_eos_id]
    for folder in folders:
        for name in (GENERATION_CONFIG_FILE, MODEL_CONFIG_FILE):
            value = _read_json(folder / name).get("eos_token_id")
            ids += [value] if isinstance(value, int) else [v for v in value or [] if isinstance(v, int)]
    return list(dict.fromkeys(ids))
