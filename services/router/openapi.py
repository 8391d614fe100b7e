"""Request schemas of the OpenAI endpoints, for FastAPI's /openapi.json and /docs only.

The routes read and validate bodies themselves (services/router/protocol.py): the order of
checks (401 → 429 → 413 → 400) and OpenAI-style error bodies need the raw request. These
pydantic models only *describe* what protocol.py accepts, so clients can generate code and
fuzzers (schemathesis) can target the API; they are attached to the routes with
`openapi_extra`. Unknown fields are accepted (and ignored), as by the router.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

from services.router.prompts import MAX_CHAT_TEMPLATE_CHARS, MAX_DOCUMENTS, MAX_PROMPTS, REASONING_EFFORTS
from services.router.protocol import MAX_BAD_WORDS, MAX_STOP_LENGTH, MAX_STOP_STRINGS
from services.router.tools import MAX_TOOLS, NAME_PATTERN

StopStrings = str | list[str]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = Field(
        None, description="vLLM extension: with include_usage, every chunk carries its choice's usage so far")


class JsonSchemaFormat(_Body):
    name: str = Field(min_length=1)
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="Without one: any JSON")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, description="Required when type is 'json_schema'")


class StructuredOutputs(_Body):
    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON schema")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="Lark, llguidance's dialect")


class _Sampling(_Body):
    model: str | None = Field(None, description="The served model name (see GET /v1/models); left out, the model this router serves")
    max_tokens: int | None = Field(None, ge=1, description="Tokens to generate (prompt + max_tokens ≤ context)")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1, description="0 means only the most likely token")
    top_k: int | None = Field(None, ge=-1, description="vLLM extension; 0 or -1 disables")
    seed: int | None = Field(None, description="Same seed and parameters give the same text")
    stop: StopStrings | None = Field(
        None, description=f"Up to {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} characters"
    )
    stop_token_ids: list[int] | None = Field(None, description="vLLM extension")
    ignore_eos: bool | None = Field(None, description="vLLM extension")
    skip_special_tokens: bool | None = Field(None, description="vLLM extension")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=16, description="Choices; choice i samples with seed + i (vLLM's rule)")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="Over generated tokens (vLLM's definition)")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="Over generated tokens (vLLM's definition)")
    repetition_penalty: float | None = Field(None, gt=0, le=10,
                                             description="vLLM extension; over prompt + generated tokens")
    logit_bias: dict[str, float] | None = Field(None, description="Token id -> bias in [-100, 100], added to the logits")
    min_tokens: int | None = Field(None, ge=0, description="vLLM extension; stop tokens are held back until then")
    response_format: ResponseFormat | None = Field(None, description="Structured output (JSON); one constraint per request")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM extension: one of json, regex, choice, grammar")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM extension (older spelling)")
    guided_regex: str | None = Field(None, description="vLLM extension (older spelling)")
    guided_choice: list[str] | None = Field(None, description="vLLM extension (older spelling)")
    guided_grammar: str | None = Field(None, description="vLLM extension (older spelling); Lark, llguidance's dialect")
    min_p: float | None = Field(None, ge=0, le=1, description="vLLM extension; after temperature")
    allowed_token_ids: list[int] | None = Field(None, min_length=1, description="vLLM extension: the only ids sampled")
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS,
                                        description="vLLM extension: words the output never completes")
    include_stop_str_in_output: bool | None = Field(None, description="vLLM extension: keep the matched stop string")
    truncate_prompt_tokens: int | None = Field(None, ge=-1,
                                               description="vLLM extension: keep the last k prompt tokens (-1: the "
                                                           "max model length; 0 is refused)")
    truncation_side: Literal["left", "right"] | None = Field(None, description="vLLM extension; right keeps the first k")
    request_id: str | None = Field(None, pattern=r"^[!-~]{1,128}$",
                                   description="vLLM extension: names the response (an X-Request-Id header wins)")
    session_id: str | None = Field(None, pattern=r"^[!-~]{1,128}$", description="vLLM extension: logged")
    return_tokens_as_token_ids: bool | None = Field(None, description="vLLM extension: logprobs name tokens token_id:N")
    return_token_ids: bool | None = Field(None, description="vLLM extension: prompt and generated token ids")
    prompt_logprobs: int | None = Field(None, ge=0, le=20,
                                        description="vLLM extension: each prompt token's logprob and rank, and this "
                                                    "many alternatives (not with stream)")
    cache_salt: str | None = Field(None, min_length=1, max_length=1024,
                                   description="vLLM extension: only requests with the same salt share prefix-cache "
                                               "pages")
    priority: int | None = Field(None, ge=-(1 << 31), le=(1 << 31) - 1,
                                 description="vLLM extension: with the router's --scheduling-policy priority, lower "
                                             "is served first; under fcfs (the default) only 0")
    stream_interval: int | None = Field(None, ge=1, le=1 << 20,
                                        description="vLLM extension: tokens per streamed event (the first and the "
                                                    "last event go out at once)")
    use_beam_search: bool | None = Field(None, description="vLLM extension: the n choices are the n best beams "
                                                           "(width n, at most 10), best first")
    length_penalty: float | None = Field(None, ge=-100, le=100,
                                         description="vLLM extension, with use_beam_search: a beam's score is its "
                                                     "summed logprobs / length ^ length_penalty (default 1)")
    user: str | None = Field(None, description="Informational")
    metadata: dict[str, Any] | None = Field(None, description="Informational")
    store: bool | None = Field(None, description="Informational: nothing is stored")


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description=f"A string or token ids, or a batch of up to {MAX_PROMPTS} of either (choice i x n + j)"
    )
    add_special_tokens: bool | None = Field(None, description="vLLM extension (default true: bos is added)")
    max_tokens: int | None = Field(None, ge=0, description="Tokens to generate (prompt + max_tokens ≤ context); "
                                                           "0 only with echo: the prompt alone (vLLM's)")
    logprobs: int | None = Field(None, ge=0, le=20,
                                 description="With echo, the prompt's tokens lead the logprobs (the first's null)")
    echo: bool | None = None
    best_of: int | None = Field(None, description="Only equal to n is supported")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str = Field(description="The arguments as a JSON object's text")


class ToolCall(_Body):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="Calls an assistant made (role assistant only)")
    tool_call_id: str | None = Field(None, description="Required with role tool: the call this message answers")


class FunctionDefinition(_Body):
    name: str = Field(pattern=NAME_PATTERN.pattern)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="JSON schema of the arguments, an object (absent: no arguments)")
    strict: bool | None = Field(None, description="Accepted; forced calls always follow the schema")


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(
        None, min_length=1, max_length=MAX_TOOLS,
        description="Functions the model may call, rendered through the chat template; the reply's calls come "
                    "back as message.tool_calls (GET /v1/models: tool_call_parser names the format; null: "
                    "tools only with tool_choice 'none')")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="auto (default with tools): free reply, parsed for calls; none: never parsed; required "
                          "or a named function: enforced by a grammar (one call of it; required: one or more of "
                          "any tool)")
    parallel_tool_calls: bool | None = Field(None, description="false: tool_choice required makes exactly one call")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM extension")
    add_generation_prompt: bool | None = Field(None, description="vLLM extension")
    continue_final_message: bool | None = Field(None, description="vLLM extension: the last message left open")
    echo: bool | None = Field(None, description="vLLM extension: the reply extends the last assistant message")
    add_special_tokens: bool | None = Field(None, description="vLLM extension (default false)")
    documents: list[dict[str, str]] | None = Field(None, max_length=MAX_DOCUMENTS,
                                                   description="vLLM extension: handed to the chat template")
    chat_template: str | None = Field(None, max_length=MAX_CHAT_TEMPLATE_CHARS,
                                      description="vLLM extension: this request's own Jinja chat template")
    reasoning_effort: Literal[REASONING_EFFORTS] | None = Field(  # type: ignore[valid-type]
        None, description="Handed to the chat template (and enable_thinking), as vLLM does")
    include_reasoning: bool | None = Field(
        None, description="vLLM extension: false leaves the reasoning out of the reply (with --reasoning-parser; "
                          "without one only true is accepted)")
    thinking_token_budget: int | None = Field(
        None, ge=-1, le=1 << 20,
        description="vLLM extension: the most tokens the model may think before </think> is forced (with "
                    "--reasoning-parser; -1: no bound)")


class InputTextPart(_Body):
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(_Body):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputTextPart]


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="The arguments as a JSON object's text")


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputTextPart]


class FunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN.pattern)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, description="Required when type is 'json_schema'")
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ReasoningConfig(_Body):
    effort: Literal[REASONING_EFFORTS] | None = Field(  # type: ignore[valid-type]
        None, description="Handed to the chat template, as the chat route's reasoning_effort")


class ResponsesRequest(_Body):
    """OpenAI's Responses API, stateless (services/router/responses_request.py)."""

    model: str | None = Field(None, description="The served model name (see GET /v1/models); left out, the model this router serves")
    input: str | list[InputMessage | FunctionCallItem | FunctionCallOutputItem] = Field(min_length=1)
    instructions: str | None = Field(None, description="A system message before the input")
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    stream: bool | None = None
    tools: list[FunctionTool] | None = Field(None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    user: str | None = Field(None, description="Informational")
    metadata: dict[str, Any] | None = Field(None, description="Informational")
    store: bool | None = Field(None, description="With the router's --responses-store-size: keep the response "
                                                 "(the default there); without it only false (true is a 400)")
    previous_response_id: str | None = Field(
        None, description="With --responses-store-size: continue a stored response's conversation (404 when it "
                          "is not stored); without it a 400")


class MessagesText(_Body):
    type: Literal["text"]
    text: str


class MessagesToolResult(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[MessagesText] | None = None
    is_error: bool | None = Field(None, description="true: the model reads the result as 'Error: ' + its text")


class MessagesToolUse(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class MessagesThinking(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = Field(None, description="Not checked: this server signs nothing")


class MessagesMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[MessagesText | MessagesToolResult | MessagesToolUse | MessagesThinking]


class MessagesTool(_Body):
    type: Literal["custom"] | None = None
    name: str = Field(pattern=NAME_PATTERN.pattern)
    description: str | None = None
    input_schema: dict[str, Any]


class MessagesToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, description="Required when type is 'tool'")
    disable_parallel_tool_use: bool | None = None


class MessagesThinkingConfig(_Body):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=1, description="Required when enabled (needs --reasoning-parser)")


class MessagesJsonFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class MessagesOutputConfig(_Body):
    effort: Literal[REASONING_EFFORTS] | None = None  # type: ignore[valid-type]
    format: MessagesJsonFormat | None = None


class CountTokensRequest(_Body):
    """Anthropic's messages.count_tokens (services/router/messages_route.py)."""

    model: str | None = Field(None, description="The served model name (see GET /v1/models); left out, the model this router serves")
    messages: list[MessagesMessage] = Field(min_length=1)
    system: str | list[MessagesText] | None = None
    tools: list[MessagesTool] | None = Field(None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: MessagesToolChoice | None = None
    thinking: MessagesThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    """Anthropic's Messages API (services/router/messages_request.py)."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    stream: bool | None = None
    output_config: MessagesOutputConfig | None = None
    metadata: dict[str, Any] | None = Field(None, description="Informational")


MODELS = (CompletionRequest, ChatCompletionRequest, ResponsesRequest, CountTokensRequest, MessagesRequest)


def component_schemas(model_names: list[str]) -> dict[str, Any]:
    """JSON schemas of the request models and everything they use, keyed by name. `model` lists
    the names this router serves: any other is a 404, and a client (or fuzzer) should know."""
    _, top = models_json_schema([(m, "validation") for m in MODELS], ref_template="#/components/schemas/{model}")
    schemas = top.get("$defs", {})
    for model in MODELS:
        props = schemas[model.__name__]["properties"]
        props["model"] = {"type": "string", "enum": list(model_names), "description": props["model"]["description"]}
    return schemas


def request_body(*models: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose body (JSON) is `models[0]`, or one of several `models`."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
    schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def error_responses() -> dict[int | str, dict[str, Any]]:
    """The statuses a generation request may answer with, besides 200."""
    text = {
        400: "Invalid request (OpenAI-style error body)",
        401: "Missing or wrong API key",
        404: "Unknown model",
        408: "Headers or body did not arrive in time",
        413: "Body too large",
        429: "The admission budget (in choices) is spent, or too many bodies are being read",
        503: "No healthy worker, or the request failed on the workers",
        504: "Request deadline passed",
    }
    return {status: {"description": desc} for status, desc in text.items()}


def add_components(schema: dict[str, Any], model_names: list[str]) -> dict[str, Any]:
    schema.setdefault("components", {}).setdefault("schemas", {}).update(component_schemas(model_names))
    return schema
