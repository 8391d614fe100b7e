"""Prompts of a request: completion prompts (one or a batch), a chat rendered by its template,
and vLLM's truncate_prompt_tokens. Pure functions over the tokenizer, like protocol.py.

Chat rendering follows vLLM: the request's own `chat_template` (bounded, services/common/
template_limits.py) or the model's; `add_generation_prompt`, or `continue_final_message` (the
last message left open for the model to continue, cut where its text ends as transformers
cuts it); `documents` and `reasoning_effort` handed to the template; `add_special_tokens`
(default false: the template writes bos itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.common.tokenizer import ChatTemplateError, Tokenizer
from services.router.errors import bad_request, each_object, invalid_type
from services.router.getters import get_bool, get_int, get_str, is_int
from services.router.tools import ToolRequest, check_tool_fields

MAX_PROMPTS = 64  # prompts in one batched completions request (each is its own request on the workers)
MAX_CHAT_TEMPLATE_CHARS = 64 * 1024  # a request's own chat template
MAX_DOCUMENTS = 64
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
PROMPT_TYPES = "a string, an array of token ids, or an array of strings or of token-id arrays"


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str  # the prompt's text, for echo


def check_ids(ids: list[int], vocab_size: int, param: str) -> None:
    if not ids:
        raise bad_request("The prompt must not be empty.", param=param, code="invalid_value")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"Token id {bad} in '{param}' is outside the vocabulary (0..{vocab_size - 1}).",
            param=param,
            code="invalid_value",
        )


# --- /v1/completions ------------------------------------------------------------------------


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(is_int(t) for t in value)


def completion_prompts(body: dict, tokenizer: Tokenizer) -> list[Prompt]:
    """Every prompt of a completions request: a string, a token-id list, or a list of either."""
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("You must provide a prompt.", param="prompt", code="missing_required_parameter")
    prompt = body["prompt"]
    add_special = get_bool(body, "add_special_tokens", True)
    if isinstance(prompt, str) or _is_ids(prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        items = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        for i, p in enumerate(prompt):
            if not _is_ids(p):
                raise invalid_type(f"prompt[{i}]", "a non-empty array of token ids", p)
        items = list(prompt)
    else:
        raise invalid_type("prompt", PROMPT_TYPES, prompt)
    if len(items) > MAX_PROMPTS:
        raise bad_request(f"At most {MAX_PROMPTS} prompts may be batched in one request, got {len(items)}.",
                          param="prompt", code="invalid_value")
    out = []
    for i, item in enumerate(items):
        param = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            ids = tokenizer.encode(item, add_special_tokens=add_special)
            check_ids(ids, tokenizer.vocab_size, param)
            out.append(Prompt(ids, item))
        else:
            check_ids(item, tokenizer.vocab_size, param)
            out.append(Prompt(list(item), tokenizer.decode(item, skip_special_tokens=False)))
    return out


# --- /v1/chat/completions ------------------------------------------------------------------------


def normalize_chat_messages(messages: Any) -> list[dict[str, Any]]:
    if messages is None:
        raise bad_request("You must provide messages.", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise invalid_type("messages", "an array", messages)
    if not messages:
        raise bad_request("'messages' must contain at least one message.", param="messages", code="empty_array")
    out = []
    for where, message in each_object(messages, "messages"):
        role = message.get("role")
        if not isinstance(role, str):
            raise invalid_type(f"{where}.role", "a string", role)
        if role not in CHAT_ROLES:
            raise bad_request(
                f"Invalid value for '{where}.role': '{role}'. Supported values are: {', '.join(CHAT_ROLES)}.",
                param=f"{where}.role",
                code="invalid_value",
            )
        content = message.get("content")
        if content is None:
            if role != "assistant":
                raise bad_request(
                    f"'{where}.content' is required for role '{role}'.", param=f"{where}.content",
                    code="missing_required_parameter",
                )
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise invalid_type(f"{where}.content[{j}]", "a content part object", part)
                if part["type"] != "text":
                    raise bad_request(
                        f"Content part type '{part['type']}' is not supported; only 'text' is.",
                        param=f"{where}.content[{j}].type",
                        code="unsupported_value",
                    )
                if not isinstance(part.get("text"), str):
                    raise invalid_type(f"{where}.content[{j}].text", "a string", part.get("text"))
                texts.append(part["text"])
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise invalid_type(f"{where}.content", "a string or an array of content parts", content)
        plain = {k: v for k, v in message.items() if k not in ("role", "content")}
        plain["role"] = "system" if role == "developer" else role
        if content is not None:
            plain["content"] = content
        out.append(check_tool_fields(plain, where))
    return out


def _documents(body: dict) -> list[dict[str, str]] | None:
    docs = body.get("documents")
    if docs is None:
        return None
    if not isinstance(docs, list) or not all(
            isinstance(d, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in d.items())
            for d in docs):
        raise invalid_type("documents", "an array of objects with string values", docs)
    if len(docs) > MAX_DOCUMENTS:
        raise bad_request(f"At most {MAX_DOCUMENTS} documents are allowed.", param="documents", code="invalid_value")
    return docs


def _template_kwargs(body: dict) -> dict[str, Any]:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, dict):
        raise invalid_type("chat_template_kwargs", "an object", kwargs)
    reserved = {"messages", "tools", "add_generation_prompt", "documents", "chat_template", "untrusted_template"}
    kwargs = {k: v for k, v in kwargs.items() if k not in reserved}
    effort = get_str(body, "reasoning_effort", None)
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_request(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}.",
                              param="reasoning_effort", code="invalid_value")
        # as vLLM: the template sees the effort, and templates that gate thinking see it switched
        kwargs.setdefault("reasoning_effort", effort)
        kwargs.setdefault("enable_thinking", effort != "none")
    return kwargs


def continue_final(rendered: str, messages: list[dict[str, Any]]) -> str:
    """The rendered chat cut right after the final message's text, so the model continues it
    (transformers' continue_final_message)."""
    final = messages[-1].get("content") or ""
    if not final.strip() or final.strip() not in rendered:
        raise bad_request("'continue_final_message' needs a final message whose text the chat template writes out.",
                          param="continue_final_message", code="invalid_value")
    at = rendered.rindex(final.strip())
    if rendered[at: at + len(final.lstrip())] == final:
        return rendered[: at + len(final.lstrip())]
    return rendered[: at + len(final.strip())]  # the template trimmed trailing blanks


def chat_template_of(body: dict) -> str | None:
    template = get_str(body, "chat_template", None)
    if template is not None and len(template) > MAX_CHAT_TEMPLATE_CHARS:
        raise bad_request(f"'chat_template' may be at most {MAX_CHAT_TEMPLATE_CHARS} characters long.",
                          param="chat_template", code="invalid_value")
    return template


def adds_generation_prompt(body: dict) -> bool:
    """Whether the chat template ends with the reply's opening: `add_generation_prompt`, by
    default true unless the request continues its last message (continue_final_message)."""
    return get_bool(body, "add_generation_prompt", not get_bool(body, "continue_final_message", False))


def chat_prompt(body: dict, tokenizer: Tokenizer, tools: ToolRequest | None = None,
                messages: list[dict[str, Any]] | None = None) -> list[int]:
    if messages is None:
        messages = normalize_chat_messages(body.get("messages"))
    continue_final_message = get_bool(body, "continue_final_message", False)
    add_generation_prompt = adds_generation_prompt(body)
    if continue_final_message and add_generation_prompt:
        raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true.",
                          param="continue_final_message", code="invalid_value")
    add_special = get_bool(body, "add_special_tokens", False)
    template = chat_template_of(body)
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools.tools if tools else None,
            documents=_documents(body), chat_template=template, untrusted_template=True, **_template_kwargs(body))
    except ChatTemplateError as e:
        param = "chat_template" if template is not None else "messages"
        raise bad_request(f"The chat template rejected the conversation: {e}", param=param,
                          code="invalid_value") from e
    if continue_final_message:
        text = continue_final(text, messages)
    return tokenizer.encode(text, add_special_tokens=add_special)


def echo_text(body: dict, messages: list[dict[str, Any]]) -> str:
    """vLLM's `echo` on chat: the last message's text when it is the assistant's, which the reply
    then extends; nothing otherwise."""
    if not get_bool(body, "echo", False):
        return ""
    last = messages[-1]
    return last.get("content") or "" if last.get("role") == "assistant" else ""


# --- truncate_prompt_tokens ----------------------------------------------------------------------


def truncate(ids: list[int], body: dict, context_length: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last k ids (truncation_side "right": the first k);
    -1 means the model's context length."""
    k = get_int(body, "truncate_prompt_tokens", None, -1)
    side = get_str(body, "truncation_side", "left")
    if side not in ("left", "right"):
        raise bad_request("'truncation_side' must be 'left' or 'right'.", param="truncation_side",
                          code="invalid_value")
    if k is None:
        return ids
    if k == -1:
        k = context_length
    if k > context_length:
        raise bad_request(f"'truncate_prompt_tokens' ({k}) must not exceed the model's maximum context length "
                          f"({context_length}).", param="truncate_prompt_tokens", code="invalid_value")
    if k == 0:
        raise bad_request("'truncate_prompt_tokens' must be -1 or at least 1.", param="truncate_prompt_tokens",
                          code="invalid_value")
    if len(ids) <= k:
        return ids
    return ids[-k:] if side == "left" else ids[:k]
