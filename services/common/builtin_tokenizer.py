"""Byte-level tokenizer of the random test model (`--model builtin-random`): every UTF-8 byte is a
token, plus a few controls. (The default `builtin` model has an ordinary BPE tokenizer.json.)

Ids 0..255 are the raw bytes, 256..262 the special tokens below, 263 is padding so the embedding
table has an even size. Any text encodes without an unknown token, and decoding is exact; the
price is one token per byte, which the tiny model does not mind.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from services.common.tokenizer_base import Tokenizer

BYTE_TOKENS = 256
# Order fixes the ids: <|pad|> = 256 ... <|end|> = 262, <|unused0|> = 263.
SPECIAL_TOKENS = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "<|unused0|>",
)
SPECIAL_TOKEN_IDS = {token: BYTE_TOKENS + index for index, token in enumerate(SPECIAL_TOKENS)}

BUILTIN_PAD_ID = SPECIAL_TOKEN_IDS["<|pad|>"]
BUILTIN_BOS_ID = SPECIAL_TOKEN_IDS["<|bos|>"]
BUILTIN_EOS_ID = SPECIAL_TOKEN_IDS["<|eos|>"]
BUILTIN_END_ID = SPECIAL_TOKEN_IDS["<|end|>"]
BUILTIN_VOCAB_SIZE = BYTE_TOKENS + len(SPECIAL_TOKENS)  # 264
# A turn ends with <|end|>; <|eos|> ends a plain completion.
BUILTIN_EOS_IDS = (BUILTIN_EOS_ID, BUILTIN_END_ID)


def chat_template(name: str) -> str:
    """`<|role|>content<|end|>` per message, `<|assistant|>` to prompt a reply. Content may also be
    a list of OpenAI content parts; their text parts are joined. `name` names the template in the
    error a message of another role raises. The trained `builtin` model (scripts/train_builtin.py)
    ships this template too, under its own name.

    Tool conversations render without new tokens: an assistant's `tool_calls` follow its content as
    `{"name": ..., "parameters": ...}` joined by "; " (the very text a forced call generates, see
    services/router/tool_parsers.py's llama3_json format, so the next round's prompt repeats the
    reply token for token and hits the cache), and a `tool` message is a user turn saying it holds a
    tool's result."""
    return (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
        "{{ raise_exception('" + name + " chat template accepts roles system, user, assistant and tool, not ' + message['role']) }}"
        "{% endif %}"
        "{% if message['role'] == 'tool' %}{{ '<|user|>Tool result: ' }}"
        "{% else %}{{ '<|' + message['role'] + '|>' }}{% endif %}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
        "{% endif %}"
        "{% if message['role'] == 'assistant' and message['tool_calls'] %}"
        "{% for call in message['tool_calls'] %}{% if not loop.first %}{{ '; ' }}{% endif %}"
        "{{ '{\"name\": ' + call['function']['name'] | tojson + ', \"parameters\": ' + call['function']['arguments'] | tojson + '}' }}"
        "{% endfor %}{% endif %}"
        "{{ '<|end|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )


BUILTIN_CHAT_TEMPLATE = chat_template("the built-in")

# Longest first so no special token can shadow another that starts the same way.
_SPECIAL_TOKEN_PATTERN = re.compile(
    "|".join(re.escape(t) for t in sorted(SPECIAL_TOKENS, key=len, reverse=True))
)


class BuiltinTokenizer(Tokenizer):
    """Bytes in, bytes out; special-token strings in the text map to their ids like HF added tokens."""

    def __init__(self) -> None:
        super().__init__(
            bos_token_id=BUILTIN_BOS_ID,
            eos_token_ids=BUILTIN_EOS_IDS,
            pad_token_id=BUILTIN_PAD_ID,
            special_token_strings={"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"},
            chat_templates={"default": BUILTIN_CHAT_TEMPLATE},
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # A completion prompt starts with <|bos|> like the chat template does, so the model always
        # sees the same start of sequence.
        ids = [BUILTIN_BOS_ID] if add_special_tokens else []
        position = 0
        for match in _SPECIAL_TOKEN_PATTERN.finditer(text):
            ids += text[position : match.start()].encode("utf-8")
            ids.append(SPECIAL_TOKEN_IDS[match.group()])
            position = match.end()
        ids += text[position:].encode("utf-8")
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        pieces: list[str] = []
        pending = bytearray()  # bytes of the current run; a character may span several tokens
        for token_id in ids:
            if 0 <= token_id < BYTE_TOKENS:
                pending.append(token_id)
                continue
            if not BYTE_TOKENS <= token_id < BUILTIN_VOCAB_SIZE:
                raise ValueError(
                    f"token id {token_id} is outside the built-in vocabulary (0..{BUILTIN_VOCAB_SIZE - 1})"
                )
            if skip_special_tokens:
                continue  # the byte run continues across a skipped token, as text would
            pieces.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            pieces.append(SPECIAL_TOKENS[token_id - BYTE_TOKENS])
        pieces.append(pending.decode("utf-8", errors="replace"))
        return "".join(pieces)

    @property
    def vocab_size(self) -> int:
        return BUILTIN_VOCAB_SIZE

    def is_special(self, token_id: int) -> bool:
        return BYTE_TOKENS <= token_id < BUILTIN_VOCAB_SIZE

    def token_bytes(self) -> dict[int, bytes]:
        return {token_id: bytes([token_id]) for token_id in range(BYTE_TOKENS)}
