"""OpenAI request validation: a JSON body in, a `GenerateSpec` (prompt ids + sampling) out.

Pure functions over the tokenizer: no I/O, no workers, so every bad input is tested in
milliseconds. Unknown fields are ignored, as OpenAI does; fields we know but cannot honour
(best_of, tools with a model whose template shows no tool-call format, ...) are a 400 with a
clear message rather than a silent surprise. Tools: services/router/tools.py.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Any

from services.common.tokenizer import ChatTemplateError, Tokenizer
from services.router.errors import bad_request, invalid_type, model_not_found
from services.router.limits import DEFAULT_LIMITS, RequestLimits, check_request_size
from services.router.structured import structured_output_field
from services.router.tools import ToolRequest, check_tool_fields, parse_tools

MAX_STOP_STRINGS = 16  # OpenAI allows 4; vLLM any. A bound keeps stop matching cheap.
# Longest stop string, in characters: holding back a possible partial match costs O(length²)
# per generated token, so an unbounded string would let one request slow the router's loop.
MAX_STOP_LENGTH = 256
MAX_LOGPROBS = 20
MAX_N = 16  # completions per request (router fan-out: each is a full request on the workers)
MAX_LOGIT_BIAS_ENTRIES = 1024
UINT32_MAX = (1 << 32) - 1
UINT64_MASK = (1 << 64) - 1
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions API
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ModelInfo:
    """What validation needs to know about the served model."""

    name: str  # the name clients send as `model` (and /v1/models lists)
    tokenizer: Tokenizer
    context_length: int
    aliases: frozenset[str] = frozenset()  # other accepted spellings, e.g. the --model value
    tool_parser: str | None = None  # the chat template's tool-call format (services/router/tool_parsers.py)
    limits: RequestLimits = DEFAULT_LIMITS  # what one request may send the workers (services/router/limits.py)


@dataclass
class GenerateSpec:
    kind: str  # "completion" | "chat"
    model: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0  # always set (random when the client gave none) so P and D sample alike
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # the client's own (vLLM extension)
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # None: off; k >= 0: the chosen token's logprob (+ up to k alternatives)
    echo: bool = False
    echo_text: str = ""  # the prompt's text when echo is on
    skip_special_tokens: bool = True
    n: int = 1  # choices; choice i samples with seed + i (vLLM's rule), so n=1 with that seed reproduces it
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    min_tokens: int = 0
    # Structured output (response_format, a forced tool call): (kind, source) as
    # services/common/sampling_params.GRAMMAR_KINDS; the workers constrain every token with it.
    grammar: tuple[str, str] | None = None
    grammar_param: str = ""  # the request field the grammar came from, for errors about it
    # The reply's tool-call format when it is parsed for calls (tools given, tool_choice not none).
    tool_parser: str | None = None

    def choice_seed(self, index: int) -> int:
        return (self.seed + index) & UINT64_MASK


# --- typed getters ----------------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def get_int(body: dict, name: str, default: Any, lo: int | None = None, hi: int | None = None) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise invalid_type(name, "an integer", v)
    if lo is not None and v < lo:
        raise bad_request(f"'{name}' must be at least {lo}, got {v}.", param=name, code="invalid_value")
    if hi is not None and v > hi:
        raise bad_request(f"'{name}' must be at most {hi}, got {v}.", param=name, code="invalid_value")
    return v


def get_float(body: dict, name: str, default: Any, lo: float | None = None, hi: float | None = None) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v):
        raise invalid_type(name, "a number", v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad_request(
            f"'{name}' must be between {lo:g} and {hi:g}, got {v}.", param=name, code="invalid_value"
        )
    return float(v)


def get_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid_type(name, "a boolean", v)
    return v


def get_str(body: dict, name: str, default: Any) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise invalid_type(name, "a string", v)
    return v


# --- shared fields ----------------------------------------------------------------------------


def _check_model(body: dict, info: ModelInfo) -> str:
    model = body.get("model")
    if model is None:
        raise bad_request("You must provide a model parameter.", param="model", code="missing_required_parameter")
    if not isinstance(model, str):
        raise invalid_type("model", "a string", model)
    if model != info.name and model not in info.aliases:
        raise model_not_found(model, info.name)
    return info.name


def _check_unsupported(body: dict) -> None:
    n = get_int(body, "n", 1, 1, MAX_N)
    best_of = get_int(body, "best_of", None, 1)
    if best_of is not None and best_of != n:
        raise bad_request("'best_of' is not supported (only best_of equal to n).", param="best_of",
                          code="unsupported_value")


INT32_MAX = (1 << 31) - 1  # top_k is an int32 on the wire


def _sampling(body: dict, spec_kw: dict) -> None:
    temperature = get_float(body, "temperature", 1.0, 0.0, 2.0)
    top_p = get_float(body, "top_p", 1.0, 0.0, 1.0)
    top_k = get_int(body, "top_k", 0, -1)
    if top_k == -1 or top_k > INT32_MAX:
        top_k = 0  # vLLM spells "disabled" as -1; beyond any vocabulary it keeps every token anyway
    if top_p == 0.0:  # "only the most likely token", as OpenAI reads it
        top_p, top_k = 1.0, 1
    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbits(63)
    elif not _is_int(seed):
        raise invalid_type("seed", "an integer", seed)
    elif not -(1 << 63) <= seed <= UINT64_MASK:
        raise bad_request("'seed' must fit in 64 bits.", param="seed", code="invalid_value")
    spec_kw.update(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed & UINT64_MASK)


def _logit_bias(body: dict, vocab_size: int) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise invalid_type("logit_bias", "an object mapping token ids to numbers", bias)
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries.", param="logit_bias",
                          code="invalid_value")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad_request(f"'logit_bias' keys must be token ids, got {key!r}.", param="logit_bias",
                              code="invalid_value") from None
        if not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias: token id {token} is outside the vocabulary (0..{vocab_size - 1}).",
                              param="logit_bias", code="invalid_value")
        if not _is_number(value) or not -100 <= value <= 100:
            raise bad_request(f"logit_bias[{key!r}] must be a number between -100 and 100, got {value!r}.",
                              param="logit_bias", code="invalid_value")
        out[token] = float(value)
    return tuple(sorted(out.items()))


def _controls(body: dict, vocab_size: int, kw: dict) -> None:
    """n, the penalties, logit_bias and min_tokens (vLLM's definitions, services/engine/logits_processors.py)."""
    kw.update(
        n=get_int(body, "n", 1, 1, MAX_N),
        presence_penalty=get_float(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=get_float(body, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(body, vocab_size),
        min_tokens=get_int(body, "min_tokens", 0, 0, UINT32_MAX),
    )
    rep = get_float(body, "repetition_penalty", 1.0, 0.0, 10.0)
    if rep == 0.0:
        raise bad_request("'repetition_penalty' must be greater than 0.", param="repetition_penalty",
                          code="invalid_value")
    kw["repetition_penalty"] = rep


def _check_min_tokens(kw: dict, max_tokens: int) -> None:
    if kw["min_tokens"] > max_tokens:
        raise bad_request(f"'min_tokens' ({kw['min_tokens']}) must not exceed max_tokens ({max_tokens}).",
                          param="min_tokens", code="invalid_value")


def _stop(body: dict, vocab_size: int) -> tuple[list[str], list[int]]:
    stop = body.get("stop")
    if stop is None and body.get("stop_token_ids") is None:
        return [], []  # the usual request: nothing to check
    if stop is None:
        strings: list[str] = []
    elif isinstance(stop, str):
        strings = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        strings = list(stop)
    else:
        raise invalid_type("stop", "a string or an array of strings", stop)
    if len(strings) > MAX_STOP_STRINGS:
        raise bad_request(f"At most {MAX_STOP_STRINGS} stop strings are allowed.", param="stop", code="invalid_value")
    too_long = next((s for s in strings if len(s) > MAX_STOP_LENGTH), None)
    if too_long is not None:
        raise bad_request(
            f"Stop strings may be at most {MAX_STOP_LENGTH} characters long (got one of {len(too_long)}).",
            param="stop",
            code="invalid_value",
        )
    strings = [s for s in dict.fromkeys(strings) if s]  # an empty stop string would match at once
    ids = body.get("stop_token_ids")
    if ids is None:
        ids = []
    elif not isinstance(ids, list) or not all(_is_int(t) for t in ids):
        raise invalid_type("stop_token_ids", "an array of integers", ids)
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"stop_token_ids: token id {bad} is outside the vocabulary (0..{vocab_size - 1}).",
            param="stop_token_ids",
            code="invalid_value",
        )
    return strings, list(ids)


def _stream(body: dict) -> tuple[bool, bool]:
    stream = get_bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not isinstance(opts, dict):
        raise invalid_type("stream_options", "an object", opts)
    if not stream:
        raise bad_request(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
            code="invalid_value",
        )
    return stream, get_bool(opts, "include_usage", False)


def _max_tokens(body: dict, names: tuple[str, ...], prompt_len: int, info: ModelInfo, default: int | None,
                prompt_param: str) -> int:
    requested, used = None, names[0]
    for name in names:
        value = get_int(body, name, None, 1, UINT32_MAX)
        if value is not None and requested is None:
            requested, used = value, name
    room = info.context_length - prompt_len
    if room <= 0:
        raise bad_request(
            f"This model's maximum context length is {info.context_length} tokens. However, your "
            f"prompt is {prompt_len} tokens long, leaving no room for a completion. Please shorten the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return min(default, room) if default is not None else room
    if prompt_len + requested > info.context_length:
        raise bad_request(
            f"This model's maximum context length is {info.context_length} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the completion). "
            "Please reduce the prompt or the completion length.",
            param=used,
            code="context_length_exceeded",
        )
    return requested


def _check_ids(ids: list[int], vocab_size: int, param: str) -> None:
    if not ids:
        raise bad_request("The prompt must not be empty.", param=param, code="invalid_value")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"Token id {bad} in '{param}' is outside the vocabulary (0..{vocab_size - 1}).",
            param=param,
            code="invalid_value",
        )


# --- /v1/completions ----------------------------------------------------------------------------


def completion_prompt(body: dict, tokenizer: Tokenizer) -> tuple[list[int], str]:
    """The prompt's ids and text (the text is for echo)."""
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("You must provide a prompt.", param="prompt", code="missing_required_parameter")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and not all(_is_int(t) for t in prompt):
        # a batch: one string or one token list is fine; more is not
        if len(prompt) != 1:
            if all(isinstance(p, (str, list)) for p in prompt):
                raise bad_request(
                    "Batched prompts are not supported; send one prompt per request.",
                    param="prompt",
                    code="unsupported_value",
                )
            raise invalid_type("prompt", "a string, an array of token ids, or an array of one of those", prompt)
        prompt = prompt[0]
        if isinstance(prompt, list) and not all(_is_int(t) for t in prompt):
            raise invalid_type("prompt", "a string, an array of token ids, or an array of one of those", body["prompt"])
    if isinstance(prompt, str):
        return tokenizer.encode(prompt), prompt
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        _check_ids(prompt, tokenizer.vocab_size, "prompt")
        return list(prompt), tokenizer.decode(prompt, skip_special_tokens=False)
    raise invalid_type("prompt", "a string, an array of token ids, or an array of one of those", prompt)


def _grammar(body: dict, ignore_eos: bool, limits: RequestLimits, kw: dict) -> None:
    found = structured_output_field(body, ignore_eos, limits)
    kw["grammar"], kw["grammar_param"] = (found[1], found[0]) if found is not None else (None, "")


def parse_completion(body: Any, info: ModelInfo) -> GenerateSpec:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    model = _check_model(body, info)
    _check_unsupported(body)
    if get_str(body, "suffix", ""):
        raise bad_request("'suffix' is not supported.", param="suffix", code="unsupported_value")
    kw: dict[str, Any] = {}
    _sampling(body, kw)
    _controls(body, info.tokenizer.vocab_size, kw)
    stop, stop_ids = _stop(body, info.tokenizer.vocab_size)
    stream, include_usage = _stream(body)
    logprobs = get_int(body, "logprobs", None, 0, MAX_LOGPROBS)
    echo = get_bool(body, "echo", False)
    ignore_eos = get_bool(body, "ignore_eos", False)
    skip_special = get_bool(body, "skip_special_tokens", True)
    _grammar(body, ignore_eos, info.limits, kw)
    if echo and logprobs is not None:
        raise bad_request("'echo' together with 'logprobs' is not supported.", param="echo", code="unsupported_value")
    ids, text = completion_prompt(body, info.tokenizer)
    if not ids:
        raise bad_request("The prompt must not be empty.", param="prompt", code="invalid_value")
    max_tokens = _max_tokens(body, ("max_tokens",), len(ids), info, COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt")
    _check_min_tokens(kw, max_tokens)
    check_request_size(kw["n"], len(ids), kw["grammar"], "n" if kw["n"] > 1 else "prompt", info.limits)
    return GenerateSpec(
        kind="completion",
        model=model,
        prompt_ids=ids,
        max_tokens=max_tokens,
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=ignore_eos,
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        echo=echo,
        echo_text=text if echo else "",
        skip_special_tokens=skip_special,
        **kw,
    )


# --- /v1/chat/completions -------------------------------------------------------------------------


def normalize_chat_messages(messages: Any) -> list[dict[str, Any]]:
    if messages is None:
        raise bad_request("You must provide messages.", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise invalid_type("messages", "an array", messages)
    if not messages:
        raise bad_request("'messages' must contain at least one message.", param="messages", code="empty_array")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid_type(where, "an object", message)
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


def chat_prompt(body: dict, tokenizer: Tokenizer, tools: ToolRequest | None = None) -> list[int]:
    messages = normalize_chat_messages(body.get("messages"))
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, dict):
        raise invalid_type("chat_template_kwargs", "an object", kwargs)
    add_generation_prompt = get_bool(body, "add_generation_prompt", True)
    reserved = {"messages", "tools", "add_generation_prompt", "documents", "chat_template"}
    kwargs = {k: v for k, v in kwargs.items() if k not in reserved}
    try:
        return tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt,
                                     tools=tools.tools if tools else None, **kwargs)
    except ChatTemplateError as e:
        raise bad_request(f"The chat template rejected the conversation: {e}", param="messages",
                          code="invalid_value") from e


def parse_chat(body: Any, info: ModelInfo) -> GenerateSpec:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    model = _check_model(body, info)
    _check_unsupported(body)
    tools = parse_tools(body, info.tool_parser, info.tokenizer, info.limits)
    kw: dict[str, Any] = {}
    _sampling(body, kw)
    _controls(body, info.tokenizer.vocab_size, kw)
    stop, stop_ids = _stop(body, info.tokenizer.vocab_size)
    stream, include_usage = _stream(body)
    want_logprobs = get_bool(body, "logprobs", False)
    top_logprobs = get_int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top_logprobs is not None and not want_logprobs:
        raise bad_request(
            "'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs", code="invalid_value"
        )
    ignore_eos = get_bool(body, "ignore_eos", False)
    skip_special = get_bool(body, "skip_special_tokens", True)
    _grammar(body, ignore_eos, info.limits, kw)
    if tools is not None and tools.grammar is not None:
        if kw["grammar"] is not None:
            raise bad_request("Structured output (response_format, structured_outputs, guided_*) cannot be combined "
                              "with a forced tool call (tool_choice 'required' or a named function): both constrain "
                              "the whole reply.", param="tool_choice", code="invalid_value")
        if ignore_eos:
            raise bad_request("'ignore_eos' cannot be combined with a forced tool call: the grammar ends the output.",
                              param="ignore_eos", code="unsupported_value")
        kw["grammar"], kw["grammar_param"] = tools.grammar, "tools"
    ids = chat_prompt(body, info.tokenizer, tools)
    _check_ids(ids, info.tokenizer.vocab_size, "messages")
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), len(ids), info, None, "messages")
    _check_min_tokens(kw, max_tokens)
    check_request_size(kw["n"], len(ids), kw["grammar"], "n" if kw["n"] > 1 else "messages", info.limits)
    return GenerateSpec(
        kind="chat",
        model=model,
        prompt_ids=ids,
        max_tokens=max_tokens,
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=ignore_eos,
        stream=stream,
        include_usage=include_usage,
        logprobs=(top_logprobs or 0) if want_logprobs else None,
        skip_special_tokens=skip_special,
        tool_parser=tools.parser if tools else None,
        **kw,
    )
