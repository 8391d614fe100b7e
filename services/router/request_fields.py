"""What the router does with each request field of vLLM's OpenAI protocol that it does not
implement: refuse it with a 400 naming it, unless it holds its default value (clients such as
the openai SDK send some defaults explicitly).

Every field of vLLM's ChatCompletionRequest and CompletionRequest is either implemented
(services/router/protocol.py, prompts.py), informational (accepted, changes nothing: OpenAI
defines it so), or listed here, as are OpenAI's chat fields that ask for output other than
text. tests/unit/test_vllm_fields.py walks vLLM's list and checks that each one lands in
exactly one of those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.router.errors import bad_request

CHAT = "chat"
COMPLETION = "completion"
BOTH = frozenset({CHAT, COMPLETION})


@dataclass(frozen=True)
class Refused:
    reason: str
    defaults: tuple[Any, ...] = (None,)  # values that mean "not asked for" (None: absent or null)
    kinds: frozenset[str] = BOTH


REFUSED: dict[str, Refused] = {
    "suffix": Refused("text after the completion (fill-in-the-middle) is not supported", (None, ""),
                      frozenset({COMPLETION})),
    "watermarking": Refused("watermarking is not supported", (None, False)),
    "spaces_between_special_tokens": Refused(
        "only the tokenizer's own decoding (spaces_between_special_tokens true) is supported", (None, True)),
    "logprob_token_ids": Refused("logprobs of chosen token ids are not supported"),
    "prompt_embeds": Refused("prompt embeddings are not supported", kinds=frozenset({COMPLETION})),
    "media_io_kwargs": Refused("this model takes text only", kinds=frozenset({CHAT})),
    "mm_processor_kwargs": Refused("this model takes text only", kinds=frozenset({CHAT})),
    "return_token_offsets": Refused("token offsets are not supported", (None, False)),
    "return_prompt_text": Refused("returning the rendered prompt is not supported", (None, False)),
    "return_mm_kwargs": Refused("this model takes text only", (None, True)),
    "routed_experts_prompt_start": Refused("this model has no experts", (None, 0)),
    "kv_transfer_params": Refused("the router moves the KV cache itself; kv_transfer_params are not accepted"),
    "ec_transfer_params": Refused("encoder-cache transfer is not supported"),
    "vllm_xargs": Refused("custom extension arguments are not supported"),
    "repetition_detection": Refused("repetition detection is not supported"),
    "thinking_token_budget": Refused("a thinking budget bounds a chat reply's reasoning, and needs the router's "
                                     "--reasoning-parser", (None, -1)),
    "include_reasoning": Refused("no reasoning parser is configured, so there is no reasoning to leave out",
                                 (None, True), frozenset({CHAT})),
    # OpenAI's (vLLM does not define them): they ask for output this server cannot give, which a
    # 200 with text alone would hide
    "modalities": Refused("this model answers in text only", (None, ["text"]), frozenset({CHAT})),
    "audio": Refused("audio output is not supported: this model answers in text", kinds=frozenset({CHAT})),
    "web_search_options": Refused("web search is not supported", kinds=frozenset({CHAT})),
    "verbosity": Refused("replies are not steered by a verbosity level", (None, "medium"), frozenset({CHAT})),
}

# Accepted, and they change nothing, as OpenAI and vLLM define them: for the caller's own records
# (`user`, `metadata`, `store` — nothing is stored, `safety_identifier`), `session_id` (vLLM's,
# logged with the request), and OpenAI's hints that never change the output: `prediction`
# (predicted outputs only save latency), `prompt_cache_key` (the prefix cache keys by content
# already), `service_tier`.
INFORMATIONAL = frozenset({"user", "metadata", "store", "session_id", "safety_identifier", "prediction",
                           "prompt_cache_key", "service_tier"})


def refuse_unsupported(body: dict, kind: str, served: frozenset[str] = frozenset()) -> None:
    """A 400 naming the first refused field that holds anything but its default; `served`: fields
    of this list that the router's configuration implements (include_reasoning with a reasoning
    parser)."""
    for name, rule in REFUSED.items():
        if kind in rule.kinds and name in body and name not in served and not _is_default(body[name], rule.defaults):
            raise bad_request(f"'{name}' is not supported: {rule.reason}.", param=name, code="unsupported_value")


def _is_default(value: Any, defaults: tuple[Any, ...]) -> bool:
    # True == 1 in Python: a boolean default must not let an integer through, nor the reverse
    return any(value is d if d is None or isinstance(d, bool) or isinstance(value, bool) else value == d
               for d in defaults)
