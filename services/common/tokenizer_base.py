"""The tokenizer interface (`Tokenizer`) and the chat rendering every backend shares: the
messages normalised as transformers does, the chat template compiled in a sandbox (a client's
own template under limits of time and size) and rendered.

The backends subclass it: services/common/tokenizer.py (Hugging Face folders, and loading),
services/common/builtin_tokenizer.py (the random test model's bytes). No torch here.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.common.template_limits import (
    MAX_RENDERED_CHARS,
    LimitedSandbox,
    TemplateLimitError,
    run_with_deadline,
)

UNTRUSTED_RENDER_SECONDS = 2.0  # a client's own chat template gets this long to render

# The named special tokens transformers hands to every chat template (its `special_tokens_map`).
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# Older names for a message's reasoning; transformers copies them to `reasoning_content` (and
# `thinking`) so every template finds the reasoning under the name it reads.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TokenizerLoadError(ValueError):
    """The tokenizer folder is missing a file or holds something we cannot read."""


class ChatTemplateError(ValueError):
    """There is no chat template, it does not compile, or it refused the conversation."""


_UNSET = object()


def _whole_texts(table: Mapping[int, bytes]) -> dict[int, str]:
    out = {}
    for token_id, raw in table.items():
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # part of a character: its text depends on its neighbours
        if text and not text.endswith("\ufffd"):
            out[token_id] = text
    return out


class Tokenizer(ABC):
    """What the router and workers need from a tokenizer; chat rendering is shared by all backends."""

    def __init__(
        self,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        pad_token_id: int | None,
        special_token_strings: Mapping[str, str],
        chat_templates: Mapping[str, str],
    ) -> None:
        self._bos_token_id = bos_token_id
        self._eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self._pad_token_id = pad_token_id
        self._special_token_strings = dict(special_token_strings)
        self._chat_templates = dict(chat_templates)

    # --- backend-specific -------------------------------------------------------------------

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, the bos/eos the tokenizer adds to a sequence."""

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 at the end shows as U+FFFD."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (max id + 1)."""

    @abstractmethod
    def is_special(self, token_id: int) -> bool:
        """Whether `token_id` is a special (control) token that decode skips."""

    def token_bytes(self) -> Mapping[int, bytes] | None:
        """The bytes each ordinary token stands for, where `decode` of any run of such tokens is
        exactly the UTF-8 decoding (U+FFFD for what is not UTF-8) of their bytes joined: a
        byte-level tokenizer. An incremental detokenizer then appends a token's text without
        decoding its neighbours again (services/common/detokenizer.py). None: no such promise
        (a sentencepiece decoder, a space clean-up, ...); special and added tokens are never in it."""
        return None

    def byte_tables(self) -> tuple[Mapping[int, bytes], Mapping[int, str]] | None:
        """`token_bytes()`, and of those the tokens whose bytes are whole UTF-8 characters, not
        ending in U+FFFD, with their text: after text that ends on a whole character, such a
        token adds exactly that text. None without `token_bytes()`. Computed once per tokenizer."""
        cached = self.__dict__.get("_byte_tables", _UNSET)
        if cached is _UNSET:
            table = self.token_bytes()
            cached = None if table is None else (table, _whole_texts(table))
            self._byte_tables = cached
        return cached

    # --- shared -----------------------------------------------------------------------------

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation (tokenizer eos, then generation_config/config eos ids)."""
        return list(self._eos_token_ids)

    @property
    def pad_token_id(self) -> int | None:
        return self._pad_token_id

    @property
    def chat_template(self) -> str | None:
        """The template used when no tools are given, or None when the tokenizer has none."""
        return self._chat_templates.get("default")

    @property
    def tool_chat_template(self) -> str | None:
        """The template used when tools are given: the "tool_use" one, else the default."""
        return self._chat_templates.get("tool_use", self._chat_templates.get("default"))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        untrusted_template: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the chat template, as transformers' apply_chat_template(tokenize=False).

        `chat_template` may be a template string or the name of one of the tokenizer's templates;
        with `untrusted_template` a string that names none of them (a client's own template) renders
        under services/common/template_limits.py's bounds.
        Extra keyword arguments become template variables (e.g. enable_thinking=False).
        """
        template = self._select_chat_template(chat_template, tools)
        untrusted = untrusted_template and chat_template is not None and chat_template not in self._chat_templates
        if not messages:
            raise ChatTemplateError("cannot apply a chat template to an empty conversation")
        if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
            raise ChatTemplateError("tools must be JSON-schema dicts")
        variables = {**self._special_token_strings, **kwargs}  # caller's variables win, as in transformers
        return render_chat_template(
            template,
            messages=normalize_messages(messages),
            tools=None if tools is None else [dict(tool) for tool in tools],
            documents=None if documents is None else [dict(doc) for doc in documents],
            add_generation_prompt=add_generation_prompt,
            untrusted=untrusted,
            **variables,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Prompt ids for a chat: the template writes bos and role tokens itself, so none are added."""
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
        )
        return self.encode(text, add_special_tokens=False)

    def override_chat_template(self, template: str) -> None:
        """Use `template` for every chat, tools or not (a server's --chat-template)."""
        self._chat_templates = {"default": template}

    def _select_chat_template(self, requested: str | None, tools: object) -> str:
        # Same choice as transformers: a named template if asked for, the "tool_use" one when tools
        # are given and it exists, otherwise "default".
        if requested is not None:
            return self._chat_templates.get(requested, requested)
        if tools is not None and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"]
        if "default" in self._chat_templates:
            return self._chat_templates["default"]
        if self._chat_templates:
            names = ", ".join(sorted(self._chat_templates))
            raise ChatTemplateError(
                f"the tokenizer has several chat templates ({names}) and none named 'default'"
            )
        raise ChatTemplateError(
            "the tokenizer has no chat template (tokenizer_config.json or chat_template.jinja)"
        )


# --- chat template rendering ----------------------------------------------------------------


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copy messages into plain dicts the way transformers does before rendering.

    Keys whose value is None are dropped: OpenAI clients send `content: null` next to tool calls,
    and templates test for a missing key, not for None. Reasoning under an older name is copied
    to `reasoning_content` and `thinking`.
    """
    normalized = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"chat messages must be dicts, got {type(message).__name__}")
        plain = {key: value for key, value in message.items() if value is not None}
        reasoning = next((plain[key] for key in REASONING_FIELDS if key in plain), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        normalized.append(plain)
    return normalized


def render_chat_template(template: str, untrusted: bool = False, **variables: Any) -> str:
    """Render a Hugging Face chat template in the same sandbox transformers uses (`untrusted`: a
    client's template, in a stricter one and under a time and size bound)."""
    try:
        compiled = _compile_chat_template(template, untrusted)
        if not untrusted:
            return compiled.render(**variables)
        text = run_with_deadline(lambda: compiled.render(**variables), UNTRUSTED_RENDER_SECONDS)
        if len(text) > MAX_RENDERED_CHARS:
            raise TemplateLimitError(f"the rendered prompt is longer than {MAX_RENDERED_CHARS} characters")
        return text
    except ChatTemplateError:
        raise
    except Exception as exc:  # anything the template raises is the conversation's fault, not ours
        raise ChatTemplateError(f"chat template failed: {exc}") from exc


def _compile_chat_template(template: str, untrusted: bool = False) -> jinja2.Template:
    # clients' templates have a cache of their own, so they never evict the model's
    return _compile_untrusted(template) if untrusted else _compile_trusted(template)


@lru_cache(maxsize=16)
def _compile_trusted(template: str) -> jinja2.Template:
    return _compile(template, ImmutableSandboxedEnvironment)


@lru_cache(maxsize=16)
def _compile_untrusted(template: str) -> jinja2.Template:
    return _compile(template, LimitedSandbox)


def _compile(template: str, sandbox: type[ImmutableSandboxedEnvironment]) -> jinja2.Template:
    # trim_blocks/lstrip_blocks and these helpers are what HF templates are written against;
    # without them the whitespace (and therefore the tokens) differ from transformers.
    env = sandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators=None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes and sorts keys; chat templates expect plain json.dumps output.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


# --- Hugging Face folder ----------------------------------------------------------------------
