"""OpenAI's request and response bodies for /v1/completions, /v1/chat/completions and /v1/models.

Requests are validated strictly (JSON types as OpenAI documents them: a string where a number
belongs is an error, not coerced); fields OpenAI or vLLM define that specmesh does not act on are
accepted and ignored, as vLLM does; unknown fields are ignored. The sampling fields take their
ranges from `shared.sampling_params`' types, so the request, its OpenAPI schema and the
`SamplingParams` it becomes agree; limits that depend on the model (context length, vocabulary)
are checked in `prepare`.
Responses follow OpenAI's shapes field for field, plus `usage.speculative` (specmesh's) and vLLM's
`choices[].stop_reason` and `prompt_logprobs` (in each completion choice; at the top of a chat
completion).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.json_types import INTEGRAL, JsonInt
from shared.sampling_params import (
    MAX_LOGIT_BIAS_TOKENS,
    LogitBias,
    Logprobs,
    MaxTokens,
    MinP,
    MinTokens,
    Penalty,
    RepetitionPenalty,
    Seed,
    Temperature,
    TokenId,
    TopK,
    TopP,
)
from shared.speculative_config import SpeculativeOverride

MAX_N = 128
"""Most choices one request may ask for (OpenAI's limit), over all of its prompts."""
MAX_STOP_STRINGS = 16
"""Most stop strings a request may give: each is checked against every step's new text."""
MAX_STOP_STRING_CHARS = 256
"""Longest stop string: the engine searches back this far in the text at every step."""
MAX_STOP_TOKEN_IDS = 64
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
PromptText = Annotated[str, Field(min_length=1)]

# ---- requests ------------------------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", use_attribute_docstrings=True)


class StreamOptions(_Request):
    include_usage: bool = False
    """Send a last chunk with `usage` (and `choices: []`) before `[DONE]`."""


class JsonSchemaFormat(_Request):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    """The JSON Schema the output must validate against."""
    strict: bool | None = None
    """true: objects take only their listed properties (no additional ones, whatever the schema
    says); false or absent: the schema's own `additionalProperties` rules."""


class ResponseFormat(_Request):
    """OpenAI's `response_format`: `text` (unconstrained), `json_object` (any JSON object) or
    `json_schema` (output constrained to the schema by the grammar engine)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only with it")
        return self


class SamplingFields(_Request):
    """What completions and chat requests share: model, sampling, stops, fan-out, streaming."""

    model: str | None = None
    """Must name the served model; absent means the served model (as vLLM)."""
    max_tokens: MaxTokens | None = None
    """Most tokens to generate; absent: whatever the context has left after the prompt."""
    temperature: Temperature | None = None
    """0: greedy."""
    top_p: TopP | None = None
    top_k: TopK | None = None
    """0 or -1: no top-k."""
    min_p: MinP | None = None
    seed: Seed | None = None
    """The same seed gives the same tokens, whatever else the batch holds."""
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    """Stop strings: the text ends before the first one."""
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: MinTokens = 0
    skip_special_tokens: bool = True
    n: Annotated[int, Field(ge=1, le=MAX_N), INTEGRAL] = 1
    """Independent choices for the prompt; seeded requests use seeds seed, seed + 1, ..."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    """Accepted and ignored."""
    logit_bias: dict[str, LogitBias] | None = Field(default=None, max_length=MAX_LOGIT_BIAS_TOKENS)
    """Token id (a string, as OpenAI's JSON) -> value in [-100, 100] added to its logit before sampling."""
    speculative: SpeculativeOverride | None = None
    """specmesh extension: this request's own speculative method / k, or `{"enabled": false}`."""
    prompt_logprobs: Logprobs | None = None
    """vLLM extension: return each prompt token's log-probability and the `prompt_logprobs` most
    likely tokens at its position (0: the prompt token's own); not with `stream`."""
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    """vLLM extension: a JSON Schema (an object, or its JSON text) the output must follow."""
    guided_regex: str | None = Field(default=None, min_length=1)
    """vLLM extension: a regular expression the whole output must match."""
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None
    """vLLM extension: the output is exactly one of these strings."""
    guided_whitespace_pattern: str | None = None
    """Accepted and ignored (vLLM's): JSON output is compact."""

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: object) -> object:
        """The type's checks, first, each with its own message."""
        if value is None:
            return value
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("must be a string or a list of strings")
        if "" in stops:
            raise ValueError("stop strings must not be empty")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise ValueError(
                f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters, got one of {longest}"
            )
        return value


class CompletionRequest(SamplingFields):
    prompt: (
        PromptText
        | Annotated[list[PromptText], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    """A string, a list of strings, a list of token ids, or a list of token-id lists; each list
    item is a separate prompt (OpenAI's batch form), its choices indexed prompt-major."""
    logprobs: Logprobs | None = None
    """Return the log-probability of each generated token and of the `logprobs` most likely ones
    (with `echo`, of each prompt token too: the first one's is null)."""
    echo: bool = False
    """Return the prompt before the completion, in the text and in `logprobs`."""
    best_of: JsonInt | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: object) -> object:
        """The type's checks, first, each with its own message (a union's errors name every branch)."""
        if value == "" or (isinstance(value, list) and "" in value):
            raise ValueError("the prompt is empty")
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not (
            all(isinstance(p, str) for p in value)
            or all(_is_token_ids(p) for p in value)
            or _is_token_ids(value)
        ):
            raise ValueError(
                "must be a string, a list of strings, a list of token ids or a list of token-id lists"
            )
        if not value or any(p == [] for p in value):
            raise ValueError("a prompt must not be an empty list")
        token_ids = value if _is_token_ids(value) else [t for p in value if isinstance(p, list) for t in p]
        if any(t < 0 for t in token_ids):
            raise ValueError("token ids must not be negative")
        return value


class TextPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """An assistant's earlier tool calls, handed to the chat template as they are."""
    tool_call_id: str | None = None
    """The call a `tool` message answers, handed to the chat template."""


class FunctionName(_Request):
    name: str = Field(min_length=1)


class NamedToolChoice(_Request):
    """`tool_choice` naming one function: the output is one call of it."""

    type: Literal["function"]
    function: FunctionName


class ChatTemplateFields(_Request):
    """How messages are rendered into a prompt: the chat template's inputs (vLLM's fields)."""

    add_generation_prompt: bool = True
    """vLLM extension: end the rendered prompt with the assistant's turn marker."""
    continue_final_message: bool = False
    """vLLM extension: leave the last message open (no end-of-turn marker) for the model to continue
    it, as a prefill of the answer; needs `add_generation_prompt: false`."""
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM extension: extra variables for the chat template (`enable_thinking`, ...)."""
    documents: list[dict[str, Any]] | None = None
    """vLLM extension: documents for retrieval-augmented templates, handed to the chat template."""
    tools: list[dict[str, Any]] | None = None
    """Function definitions, handed to the chat template."""


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    """Takes precedence over the older `max_tokens`."""
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """`auto` (the default with tools): the model may call tools, parsed out of its text by the
    gateway's `--tool-call-parser`; `required`: at least one call, constrained to the tools'
    schemas; a named function: exactly one call of it; `none`: text only."""
    parallel_tool_calls: bool | None = None
    """Accepted and ignored: `auto` and `required` may give several calls."""


class TokenizeRequest(ChatTemplateFields):
    """vLLM's /tokenize: a `prompt`, or `messages` rendered with the chat template (one of the two)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    """Add the tokenizer's special tokens (BOS); absent: true for a prompt, false for messages (the
    template writes them)."""
    return_token_strs: bool = False
    """Also return each token's string."""

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(_Request):
    """vLLM's /detokenize."""

    model: str | None = None
    tokens: list[TokenId]


def _is_none(value: object) -> bool:
    return value is None


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and all(_is_token_id(t) for t in value)


def _is_token_id(value: object) -> bool:
    """An integer, or a float without a fraction (`JsonInt`); not a bool."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer()
    )


# ---- responses -----------------------------------------------------------------------------------------


class _Response(BaseModel):
    """An answer's body. Its JSON Schema (serialization mode) marks every field required: each is
    always sent, null or not, except where a model says otherwise."""

    model_config = ConfigDict(use_attribute_docstrings=True, json_schema_serialization_defaults_required=True)


class _Chunk(_Response):
    """A body that is also a stream chunk: `usage` is left out of chunks unless the client asked
    for it, so not every field is always sent."""

    model_config = ConfigDict(json_schema_serialization_defaults_required=False)


class SpeculativeUsage(_Response):
    """specmesh extension: how speculation went for this request, summed over its choices."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    mean_accepted_length: float = 1.0
    """Tokens produced per verify step, the bonus token included."""


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculative: SpeculativeUsage | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(_Response):
    """vLLM's entry of one token at one prompt position."""

    logprob: float
    rank: int | None = None
    """The token's rank by logprob in the vocabulary (1: the most likely)."""
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""vLLM's `prompt_logprobs`: per prompt position, the prompt token and the top alternatives keyed by
token id (JSON keys are strings); null at position 0."""


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    """vLLM extension, when the request asked for it."""


class Completion(_Chunk):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str
    """The call's arguments as JSON text."""


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    """The text; null when the answer is only tool calls."""
    refusal: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    """Calls of the request's tools (empty when there are none)."""


class FunctionCallDelta(_Chunk):
    """A stream's piece of a call: the name once, then fragments of the arguments' JSON text."""

    name: str | None = Field(default=None, exclude_if=_is_none)
    arguments: str | None = Field(default=None, exclude_if=_is_none)


class ToolCallDelta(_Chunk):
    """A stream's piece of tool call `index`: its first piece carries `id`, `type` and the name."""

    index: int
    id: str | None = Field(default=None, exclude_if=_is_none)
    type: Literal["function"] | None = Field(default=None, exclude_if=_is_none)
    function: FunctionCallDelta


class ChatChoice(_Response):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    """vLLM extension, when the request asked for it (the prompt's, shared by every choice)."""


class ChatDelta(_Chunk):
    """Only the fields a chunk carries: `role` in the first, `content` or `tool_calls` after."""

    role: Literal["assistant"] | None = Field(default=None, exclude_if=_is_none)
    content: str | None = Field(default=None, exclude_if=_is_none)
    tool_calls: list[ToolCallDelta] | None = Field(default=None, exclude_if=_is_none)


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Chunk):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specmesh"
    root: str | None = None
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Response):
    prompt: str


class ErrorDetail(_Response):
    message: str
    type: str
    """The kind of failure: `invalid_request_error`, `rate_limit_error`, `server_error`, ..."""
    param: str | None = None
    """The request field at fault, where there is one (dotted: `messages.0.role`)."""
    code: str | None = None
    """A machine-readable reason where there is one: `context_length_exceeded`, `model_not_found`, ..."""


class ErrorResponse(_Response):
    """Every failure, as OpenAI answers it; also the last event of a stream that fails after its 200."""

    error: ErrorDetail


class HealthStatus(_Response):
    status: Literal["ok", "unavailable"]
    reason: str
    """Why not, or what is live (`1 live worker(s)`)."""
