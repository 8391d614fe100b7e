"""OpenAI request validation: a JSON body in, a `GenerateSpec` (prompt ids + sampling) out.

Pure functions over the tokenizer: no I/O, no workers, so every bad input is tested in
milliseconds. Every field of vLLM's protocol is implemented with vLLM's meaning or refused with
a 400 naming it (services/router/request_fields.py); fields neither vLLM nor OpenAI defines are
ignored, as OpenAI does. Prompts and chat rendering: prompts.py; tools: tools.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from services.common.random_bits import randbits63
from services.common.sampling_params import UINT32_MAX, api_fields
from services.common.tokenizer import Tokenizer
from services.router.beam_request import beam_fields, check_beam_spec
from services.router.errors import bad_request, invalid_type, model_not_found
from services.router.getters import get_bool, get_float, get_int, get_str, is_int, is_number
from services.router.limits import (
    DEFAULT_LIMITS,
    RequestLimits,
    check_prompt_logprobs_size,
    check_request_size,
)
from services.router.prompts import (
    Prompt,
    adds_generation_prompt,
    chat_prompt,
    check_ids,
    completion_prompts,
    echo_text,
    normalize_chat_messages,
    truncate,
)
from services.router.reasoning import (
    INSIDE,
    MAX_THINKING_BUDGET,
    OFF,
    PROMPT_TAIL_TOKENS,
    REQUEST_FIELDS,
    think_first,
    thinking_mode,
)
from services.router.request_fields import refuse_unsupported
from services.router.structured import structured_output_field
from services.router.tools import parse_tools

MAX_STOP_STRINGS = 16  # OpenAI allows 4; vLLM any. A bound keeps stop matching cheap.
# Longest stop string, in characters: holding back a possible partial match costs O(length²)
# per generated token, so an unbounded string would let one request slow the router's loop.
MAX_STOP_LENGTH = 256
MAX_LOGPROBS = 20
MAX_N = 16  # completions per request (router fan-out: each is a full request on the workers)
MAX_LOGIT_BIAS_ENTRIES = 1024
UINT64_MASK = (1 << 64) - 1
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions API
MAX_CHOICES = 128  # prompts x n of one request: each is a full request on the workers
MAX_BAD_WORDS = 64
MAX_BAD_WORD_TOKENS = 32
MAX_REQUEST_ID_CHARS = 128
MAX_CACHE_SALT_CHARS = 1024  # vLLM suggests 43 (256 random bits in base64); this leaves room for any scheme
MAX_STREAM_INTERVAL = 1 << 20  # tokens per streamed event; above any max_tokens this server takes
# generation_config.json keys vLLM applies as defaults, and the request field each one fills
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class ModelInfo:
    """What validation needs to know about the served model."""

    name: str  # the name clients send as `model` (and /v1/models lists)
    tokenizer: Tokenizer
    context_length: int
    aliases: frozenset[str] = frozenset()  # other accepted spellings, e.g. the --model value
    tool_parser: str | None = None  # the chat template's tool-call format (services/router/tool_parsers.py)
    # the model's generation_config.json sampling defaults, keyed by request field (GENERATION_DEFAULTS);
    # a request's own value wins
    defaults: Mapping[str, Any] = field(default_factory=dict)
    # tokens the largest healthy decode's KV pool holds (None: not known yet): a default max_tokens
    # never asks for more than that
    capacity: Callable[[], int | None] | None = None
    limits: RequestLimits = DEFAULT_LIMITS  # what one request may send the workers (services/router/limits.py)
    root: str = ""  # the --model it was loaded from (vLLM's model card `root`)
    # the router's defaults for two vLLM serving flags: a streamed response carries usage even when
    # not asked (--enable-force-include-usage); logprobs name tokens "token_id:N" unless the
    # request says otherwise (--return-tokens-as-token-ids)
    force_include_usage: bool = False
    tokens_as_ids: bool = False
    # --reasoning-parser: chat replies' thinking told apart from their content (services/router/reasoning.py)
    reasoning_parser: str | None = None
    auto_tool_choice: bool = True  # --enable-auto-tool-choice: tool_choice auto is served
    response_role: str = "assistant"  # --response-role: a chat reply's role after a generation prompt
    max_logprobs: int = MAX_LOGPROBS  # --max-logprobs: alternatives a request may ask for per token
    scheduling_policy: str = "fcfs"  # --scheduling-policy: priority lets requests set `priority`
    # where a request without a seed gets one: the OS's randomness, or --seed's generator
    draw_seed: Callable[[], int] = randbits63
    # --lora-modules: each LoRA adapter's name (a request's `model` may name it) and its folder
    adapters: Mapping[str, str] = field(default_factory=dict)


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
    role: str = "assistant"  # a chat reply's role (--response-role, or the continued message's)
    # tool_choice named a function: a reply that makes the call finishes "stop", as OpenAI and vLLM
    # answer a forced named call ("tool_calls" is for auto and required)
    tool_named: bool = False
    min_p: float = 0.0
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences (vLLM's tokenization of the words)
    include_stop_str_in_output: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    request_id: str | None = None  # the client's (body request_id; an X-Request-Id header wins)
    session_id: str | None = None  # vLLM's session identity: logged
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprobs name tokens "token_id:N"
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's generated ids in the response
    # vLLM's prompt_logprobs: every prompt token's logprob, rank and this many alternatives (None: off)
    prompt_logprobs: int | None = None
    # vLLM's cache_salt: the workers' prefix cache (and the router's index of it) keys this
    # request's pages under it, so only requests with the same salt share them ("": none)
    cache_salt: str = ""
    # vLLM's priority: the workers' queues take lower values first (--scheduling-policy priority)
    priority: int = 0
    # vLLM's stream_interval: a stream's events carry this many tokens each (the first and the last
    # go out at once); a non-streamed request ignores it
    stream_interval: int = 1
    # a chat reply's reasoning told apart from its content (services/router/reasoning.py): the
    # parser (None: off), whether the reply starts inside the reasoning, and vLLM's
    # include_reasoning (false: the reasoning is left out of the reply)
    reasoning_parser: str | None = None
    reasoning_inside: bool = False
    include_reasoning: bool = True
    # completions' max_tokens 0 with echo (vLLM's): the reply is the prompt alone; the workers still
    # sample one token (every room ends with one), which the reply leaves out
    echo_only: bool = False
    # a batched completions request: one spec per prompt (each with its own prompt_ids, echo_text
    # and max_tokens); empty for a single prompt, whose spec is this one
    batch: tuple[GenerateSpec, ...] = ()
    # vLLM's LoRA: the adapter the request's model names ("": the base model); the workers compute
    # the request with it, and the prefix cache keys its pages apart
    lora_name: str = ""
    # vLLM's use_beam_search: the n choices are the n best beams (services/router/beam_search.py),
    # scored with length_penalty
    beam_search: bool = False
    length_penalty: float = 1.0

    @property
    def echo_logprobs(self) -> bool:
        """OpenAI's echo with logprobs on completions: the prompt's tokens lead the logprobs."""
        return self.kind == "completion" and self.echo and self.logprobs is not None

    @property
    def worker_prompt_logprobs(self) -> int | None:
        """The alternatives the workers compute per prompt position (None: no prompt logprobs)."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo_logprobs else None) if k is not None]
        return max(wanted) if wanted else None

    def choice_seed(self, index: int) -> int:
        return (self.seed + index) & UINT64_MASK

    @property
    def prompts(self) -> tuple[GenerateSpec, ...]:
        """One spec per prompt: the batch, or this request alone."""
        return self.batch or (self,)


# --- shared fields ----------------------------------------------------------------------------


def served_model(body: dict, info: ModelInfo) -> str:
    """The served name: the model's, or a LoRA adapter's (--lora-modules). Left out (or null, or
    empty) it is this router's model, as vLLM and SGLang serve it: curl users often send no
    `model`, and there is only one base model to choose."""
    model = body.get("model")
    if model is None or model == "":
        return info.name
    if not isinstance(model, str):
        raise invalid_type("model", "a string", model)
    if model in info.adapters:
        return model
    if model != info.name and model not in info.aliases:
        raise model_not_found(model, info.name, list(info.adapters))
    return info.name


def lora_of(model: str, info: ModelInfo) -> str:
    """The LoRA adapter a served name stands for ("": the base model)."""
    return model if model in info.adapters else ""


def _check_unsupported(body: dict) -> None:
    n = get_int(body, "n", 1, 1, MAX_N)
    best_of = get_int(body, "best_of", None, 1)
    if best_of is not None and best_of != n:
        raise bad_request("'best_of' is not supported (only best_of equal to n).", param="best_of",
                          code="unsupported_value")


INT32_MAX = (1 << 31) - 1  # top_k is an int32 on the wire


def _with_defaults(body: dict, info: ModelInfo) -> dict:
    """The body with the model's generation_config.json sampling defaults filled in where it gives
    none (max_tokens aside: a default is capped by the room left, not checked against it)."""
    missing = {k: v for k, v in info.defaults.items() if k != "max_tokens" and body.get(k) is None}
    return {**body, **missing} if missing else body


def _field_reader(default: Any, api) -> Callable[[dict, str, Any], Any]:
    if type(default) is bool:
        return get_bool
    get = get_int if type(default) is int else get_float
    return lambda body, name, default: get(body, name, default, api.lo, api.hi)


# (name, default, reader) of each field _declared reads, made once: most bodies set few of them
_DECLARED = tuple((name, default, _field_reader(default, api)) for name, default, api in api_fields())


def _declared(body: dict, kw: dict) -> None:
    """The plain scalar sampling fields (temperature, top_p, top_k, min_p, the penalties,
    min_tokens, ignore_eos), each read under its own name with the API range SamplingParams
    declares for it (absent or null: its default)."""
    get = body.get
    for name, default, read in _DECLARED:
        kw[name] = default if get(name) is None else read(body, name, default)


def _sampling(body: dict, spec_kw: dict, draw_seed: Callable[[], int] = randbits63) -> None:
    _declared(body, spec_kw)
    top_k = spec_kw["top_k"]
    if top_k == -1 or top_k > INT32_MAX:
        top_k = 0  # vLLM spells "disabled" as -1; beyond any vocabulary it keeps every token anyway
    if spec_kw["top_p"] == 0.0:  # "only the most likely token", as OpenAI reads it
        spec_kw["top_p"], top_k = 1.0, 1
    if spec_kw["repetition_penalty"] == 0.0:
        raise bad_request("'repetition_penalty' must be greater than 0.", param="repetition_penalty",
                          code="invalid_value")
    seed = body.get("seed")
    if seed is None:
        seed = draw_seed()
    elif not is_int(seed):
        raise invalid_type("seed", "an integer", seed)
    elif not -(1 << 63) <= seed <= UINT64_MASK:
        raise bad_request("'seed' must fit in 64 bits.", param="seed", code="invalid_value")
    spec_kw.update(top_k=top_k, seed=seed & UINT64_MASK)


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
        if not is_number(value) or not -100 <= value <= 100:
            raise bad_request(f"logit_bias[{key!r}] must be a number between -100 and 100, got {value!r}.",
                              param="logit_bias", code="invalid_value")
        out[token] = float(value)
    return tuple(sorted(out.items()))


def _controls(body: dict, vocab_size: int, kw: dict) -> None:
    """n and logit_bias (vLLM's definitions, services/engine/logits_processors.py)."""
    kw.update(n=get_int(body, "n", 1, 1, MAX_N), logit_bias=_logit_bias(body, vocab_size))


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
    elif isinstance(stop, list):
        bad = next((i for i, s in enumerate(stop) if not isinstance(s, str)), None)
        if bad is not None:  # name the element: "got an array" would not say what is wrong with it
            raise invalid_type(f"stop[{bad}]", "a string", stop[bad])
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
    elif not isinstance(ids, list) or not all(is_int(t) for t in ids):
        raise invalid_type("stop_token_ids", "an array of integers", ids)
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"stop_token_ids: token id {bad} is outside the vocabulary (0..{vocab_size - 1}).",
            param="stop_token_ids",
            code="invalid_value",
        )
    return strings, list(ids)


def _stream(body: dict, force_usage: bool = False) -> tuple[bool, bool, bool]:
    """stream, include_usage, continuous_usage_stats (which, as vLLM's, needs include_usage);
    `force_usage`: include_usage whatever the request says (--enable-force-include-usage)."""
    stream = get_bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is None:
        return stream, stream and force_usage, False
    if not isinstance(opts, dict):
        raise invalid_type("stream_options", "an object", opts)
    if not stream:
        raise bad_request(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
            code="invalid_value",
        )
    include_usage = get_bool(opts, "include_usage", False) or force_usage
    return stream, include_usage, include_usage and get_bool(opts, "continuous_usage_stats", False)


def _token_masks(body: dict, tokenizer: Tokenizer, kw: dict) -> None:
    """vLLM's allowed_token_ids and bad_words (tokenized here as vLLM tokenizes them)."""
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        if not isinstance(allowed, list) or not all(is_int(t) for t in allowed):
            raise invalid_type("allowed_token_ids", "an array of integers", allowed)
        if not allowed:
            raise bad_request("'allowed_token_ids' must not be empty.", param="allowed_token_ids", code="invalid_value")
        bad = next((t for t in allowed if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise bad_request(f"allowed_token_ids: token id {bad} is outside the vocabulary "
                              f"(0..{tokenizer.vocab_size - 1}).", param="allowed_token_ids", code="invalid_value")
        kw["allowed_token_ids"] = tuple(sorted(set(allowed)))
    words = body.get("bad_words")
    if words is None:
        return
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise invalid_type("bad_words", "an array of strings", words)
    if len(words) > MAX_BAD_WORDS:
        raise bad_request(f"At most {MAX_BAD_WORDS} bad_words are allowed.", param="bad_words", code="invalid_value")
    kw["bad_words"] = tuple(dict.fromkeys(seq for w in words for seq in bad_word_sequences(w, tokenizer)))


def bad_word_sequences(word: str, tokenizer: Tokenizer) -> list[tuple[int, ...]]:
    """The token sequences of one bad word, as vLLM bans it: the word as written (without leading
    blanks), and with one leading space when that spelling starts with a different token and has
    as many tokens (the word in the middle of a text)."""
    bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
    if not bare:
        return []
    if len(bare) > MAX_BAD_WORD_TOKENS:
        raise bad_request(f"Each bad word may be at most {MAX_BAD_WORD_TOKENS} tokens long.", param="bad_words",
                          code="invalid_value")
    out = [bare]
    spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
    if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
        out.append(spaced)
    return out


def _ids_of_request(body: dict) -> tuple[str | None, str | None]:
    """vLLM's request_id (the response id; an X-Request-Id header wins) and session_id."""
    out = []
    for name in ("request_id", "session_id"):
        value = get_str(body, name, None)
        if value is not None and not valid_request_id(value):
            raise bad_request(f"'{name}' must be 1 to {MAX_REQUEST_ID_CHARS} visible ASCII characters.",
                              param=name, code="invalid_value")
        out.append(value)
    return out[0], out[1]


def valid_request_id(value: str) -> bool:
    return 0 < len(value) <= MAX_REQUEST_ID_CHARS and all("!" <= c <= "~" for c in value)


def _common(body: dict, info: ModelInfo, kind: str) -> dict[str, Any]:
    """The fields both routes share, as GenerateSpec keywords."""
    refuse_unsupported(body, kind, REQUEST_FIELDS if info.reasoning_parser and kind == "chat" else frozenset())
    _check_unsupported(body)
    kw: dict[str, Any] = {}
    _sampling(body, kw, info.draw_seed)
    _controls(body, info.tokenizer.vocab_size, kw)
    _token_masks(body, info.tokenizer, kw)
    kw["stop"], kw["stop_token_ids"] = _stop(body, info.tokenizer.vocab_size)
    kw["stream"], kw["include_usage"], kw["continuous_usage"] = _stream(body, info.force_include_usage)
    kw["skip_special_tokens"] = get_bool(body, "skip_special_tokens", True)
    kw["include_stop_str_in_output"] = get_bool(body, "include_stop_str_in_output", False)
    kw["request_id"], kw["session_id"] = _ids_of_request(body)
    kw["tokens_as_ids"] = get_bool(body, "return_tokens_as_token_ids", info.tokens_as_ids)
    kw["return_token_ids"] = get_bool(body, "return_token_ids", False)
    kw["prompt_logprobs"] = _prompt_logprobs(body, kw["stream"], info.max_logprobs)
    kw["cache_salt"] = _cache_salt(body)
    kw["priority"] = _priority(body, info.scheduling_policy)
    kw["stream_interval"] = get_int(body, "stream_interval", 1, 1, MAX_STREAM_INTERVAL)
    found = structured_output_field(body, kw["ignore_eos"], info.limits)
    kw["grammar"], kw["grammar_param"] = (found[1], found[0]) if found is not None else (None, "")
    return kw


def _prompt_logprobs(body: dict, stream: bool, max_logprobs: int) -> int | None:
    """vLLM's prompt_logprobs: 0..--max-logprobs alternatives (vLLM's -1, the whole vocabulary, is
    above this server's max). vLLM refuses them on a stream; so does this router."""
    k = get_int(body, "prompt_logprobs", None, 0, max_logprobs)
    if k is not None and stream:
        raise bad_request("'prompt_logprobs' is not available when 'stream' is true.", param="prompt_logprobs",
                          code="invalid_value")
    return k


def _priority(body: dict, policy: str) -> int:
    """vLLM's priority: any 32-bit integer under --scheduling-policy priority (lower is served
    first); under fcfs only 0, as vLLM refuses a priority its scheduler would not honour."""
    priority = get_int(body, "priority", 0, -(1 << 31), (1 << 31) - 1)
    if priority != 0 and policy != "priority":
        raise bad_request("'priority' needs priority scheduling: the router serves requests in arrival order "
                          "(--scheduling-policy fcfs); start it with --scheduling-policy priority.",
                          param="priority", code="unsupported_value")
    return priority


def _cache_salt(body: dict) -> str:
    """vLLM's cache_salt: a non-empty string when given (vLLM refuses an empty one), at most
    MAX_CACHE_SALT_CHARS (it travels with every attempt of the request, to every worker)."""
    salt = get_str(body, "cache_salt", None)
    if salt is None:
        return ""
    if not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise bad_request(f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters.",
                          param="cache_salt", code="invalid_value")
    return salt


def _echo_only(body: dict, echo: bool) -> dict:
    """vLLM's max_tokens 0 with echo: the prompt alone. The body then asks the workers for one token
    (dropped from the reply); without echo, 0 is refused as any max_tokens below 1."""
    value = body.get("max_tokens")
    if echo and is_int(value) and value == 0:
        return {**body, "max_tokens": 1}
    return body


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
        limit = min(default, room) if default is not None else room
        capacity = info.capacity() if info.capacity is not None else None
        if capacity:
            limit = min(limit, max(1, capacity - prompt_len))
        return limit
    if prompt_len + requested > info.context_length:
        raise bad_request(
            f"This model's maximum context length is {info.context_length} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the completion). "
            "Please reduce the prompt or the completion length.",
            param=used,
            code="context_length_exceeded",
        )
    return requested


# --- /v1/completions ----------------------------------------------------------------------------


def parse_completion(body: Any, info: ModelInfo) -> GenerateSpec:
    """One spec; a batched prompt gives one per prompt in `batch` (choices indexed prompt i x n + j)."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    model = served_model(body, info)
    beam = beam_fields(body)
    body = _with_defaults(body, info)
    kw = _common(body, info, "completion")
    kw.update(beam)
    logprobs = get_int(body, "logprobs", None, 0, info.max_logprobs)
    echo = get_bool(body, "echo", False)
    asked = body
    body = _echo_only(body, echo)
    kw["echo_only"] = body is not asked
    if beam:
        check_beam_spec(kw["n"], kw["grammar_param"], kw["grammar"])
    prompts = completion_prompts(body, info.tokenizer)
    if len(prompts) * kw["n"] > MAX_CHOICES:
        raise bad_request(f"prompts x n must be at most {MAX_CHOICES}, got {len(prompts)} x {kw['n']}.",
                          param="n", code="invalid_value")
    specs = []
    for i, prompt in enumerate(prompts):
        ids = truncate(prompt.ids, body, info.context_length)
        text = prompt.text if ids is prompt.ids else info.tokenizer.decode(ids, skip_special_tokens=False)
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        max_tokens = _max_tokens(body, ("max_tokens",), len(ids), info, COMPLETIONS_DEFAULT_MAX_TOKENS, param)
        _check_min_tokens(kw, max_tokens)
        # every prompt's n choices are calls on the workers' lanes, like the batch's other prompts
        check_request_size(kw["n"] * len(prompts), len(ids), kw["grammar"], "n" if kw["n"] > 1 else param,
                           info.limits)
        spec = GenerateSpec(kind="completion", model=model, prompt_ids=ids, max_tokens=max_tokens,
                            logprobs=logprobs, echo=echo, echo_text=text if echo else "",
                            lora_name=lora_of(model, info), **kw)
        check_prompt_logprobs_size(len(ids), spec.worker_prompt_logprobs, param)
        specs.append(spec)
    if len(specs) == 1:
        return specs[0]
    return replace(specs[0], batch=tuple(specs))


def _reasoning(body: dict, info: ModelInfo, ids: list[int], kw: dict[str, Any]) -> dict[str, Any]:
    """The chat reply's reasoning split (GenerateSpec's reasoning_* fields and include_reasoning);
    a grammar in `kw` is made to hold after the thinking (services/router/reasoning.py)."""
    if info.reasoning_parser is None:
        return {}
    tail = info.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    mode = thinking_mode(info.reasoning_parser, tail)
    budget = get_int(body, "thinking_token_budget", -1, -1, MAX_THINKING_BUDGET)  # vLLM's -1: no budget
    budget = None if budget < 0 else budget
    if kw["grammar"] is None and budget is not None and mode != OFF:
        kw["grammar_param"] = "thinking_token_budget"
    kw["grammar"] = think_first(kw["grammar"], mode, info.tokenizer, budget)
    return {"reasoning_parser": info.reasoning_parser, "reasoning_inside": mode == INSIDE,
            "include_reasoning": get_bool(body, "include_reasoning", True)}


def completion_prompt(body: dict, tokenizer: Tokenizer) -> Prompt:
    """The one prompt of a request that must not be a batch (e.g. /tokenize)."""
    prompts = completion_prompts(body, tokenizer)
    if len(prompts) != 1:
        raise bad_request("Send one prompt, not a batch.", param="prompt", code="invalid_value")
    return prompts[0]


# --- /v1/chat/completions -------------------------------------------------------------------------


def parse_chat(body: Any, info: ModelInfo) -> GenerateSpec:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    model = served_model(body, info)
    beam = beam_fields(body)
    body = _with_defaults(body, info)
    tools = parse_tools(body, info.tool_parser, info.tokenizer, info.limits, info.auto_tool_choice)
    kw = _common(body, info, "chat")
    kw.update(beam)
    want_logprobs = get_bool(body, "logprobs", False)
    top_logprobs = get_int(body, "top_logprobs", None, 0, info.max_logprobs)
    if top_logprobs is not None and not want_logprobs:
        raise bad_request(
            "'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs", code="invalid_value"
        )
    if tools is not None and tools.grammar is not None:
        if kw["grammar"] is not None:
            raise bad_request("Structured output (response_format, structured_outputs, guided_*) cannot be combined "
                              "with a forced tool call (tool_choice 'required' or a named function): both constrain "
                              "the whole reply.", param="tool_choice", code="invalid_value")
        if kw["ignore_eos"]:
            raise bad_request("'ignore_eos' cannot be combined with a forced tool call: the grammar ends the output.",
                              param="ignore_eos", code="unsupported_value")
        kw["grammar"], kw["grammar_param"] = tools.grammar, "tools"
    messages = normalize_chat_messages(body.get("messages"))
    ids = truncate(chat_prompt(body, info.tokenizer, tools, messages), body, info.context_length)
    check_ids(ids, info.tokenizer.vocab_size, "messages")
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), len(ids), info,
                             info.defaults.get("max_tokens"), "messages")
    _check_min_tokens(kw, max_tokens)
    check_request_size(kw["n"], len(ids), kw["grammar"], "n" if kw["n"] > 1 else "messages", info.limits)
    check_prompt_logprobs_size(len(ids), kw["prompt_logprobs"], "messages")
    echoed = echo_text(body, messages)
    reasoning = _reasoning(body, info, ids, kw)
    if beam:
        check_beam_spec(kw["n"], kw["grammar_param"], kw["grammar"])
    # vLLM's rule: after a generation prompt the reply is --response-role's; a continued
    # message keeps its own role
    return GenerateSpec(
        **reasoning,
        kind="chat",
        role=info.response_role if adds_generation_prompt(body) else messages[-1]["role"],
        model=model,
        lora_name=lora_of(model, info),
        prompt_ids=ids,
        max_tokens=max_tokens,
        logprobs=(top_logprobs or 0) if want_logprobs else None,
        echo=bool(echoed),
        echo_text=echoed,
        tool_parser=tools.parser if tools else None,
        tool_named=tools is not None and tools.choice == "function",
        **kw,
    )
