"""From a validated OpenAI request to the mesh's `GenerateRequest`s: one per choice.

Here the prompt is rendered (chat template) and tokenized, checked against the context length and
the vocabulary, and the sampling fields become a `SamplingParams` (which checks their ranges).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from jinja2 import TemplateError
from pydantic import ValidationError

from services.gateway.errors import APIError
from services.gateway.openai_api import (
    MAX_N,
    ChatCompletionRequest,
    ChatMessage,
    ChatTemplateFields,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    SamplingFields,
    TokenizeRequest,
    TokenizeResponse,
)
from services.gateway.tool_calls import ToolPlan, plan_tools
from shared.errors import ModelConfigError
from shared.protocol import GenerateRequest
from shared.sampling_params import SamplingParams
from shared.structured_output import StructuredOutput, StructuredOutputError
from shared.tokenizer import NoChatTemplateError, Tokenizer

SEED_MODULUS = 2**63
"""Seeds of the n choices are seed + i, wrapped into SamplingParams' range."""

_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "speculative",
)


@dataclass(frozen=True)
class ServedModel:
    """The one model this gateway serves: its name, tokenizer and context length."""

    name: str
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    created: int
    tool_call_parser: str | None = None
    """How `tool_choice: auto` finds calls in the text (services/gateway/tool_calls.py); None: refused."""

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        name: str | None = None,
        max_model_len: int | None = None,
        tool_call_parser: str | None = None,
    ) -> ServedModel:
        """Reads tokenizer and config.json only (no weights)."""
        model_dir = Path(model_dir)
        config_path = model_dir / "config.json"
        try:
            config = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelConfigError(f"cannot read {config_path}: {exc}") from exc
        tokenizer = Tokenizer(model_dir)
        context = max_model_len or int(config.get("max_position_embeddings", 0))
        if context <= 0:
            raise ModelConfigError(f"{config_path} has no max_position_embeddings; pass --max-model-len")
        return cls(
            name=name or model_dir.resolve().name,
            tokenizer=tokenizer,
            max_model_len=context,
            vocab_size=int(config.get("vocab_size") or tokenizer.vocab_size),
            created=int(time.time()),
            tool_call_parser=tool_call_parser,
        )


@dataclass(frozen=True)
class Job:
    """One HTTP request as the mesh sees it: choice i is `requests[i]`."""

    kind: Literal["completion", "chat"]
    request_id: str
    created: int
    requests: list[GenerateRequest]
    num_prompt_tokens: int
    """Prompt tokens of the distinct prompts (a prompt asked n times counts once, as OpenAI)."""
    stream: bool
    include_usage: bool
    logprobs: int | None
    echo_texts: tuple[str, ...] = ()
    """With `echo`: the prompt text of each choice, which its text starts with; else empty."""
    prompt_logprobs: int | None = None
    """vLLM's `prompt_logprobs` field: alternatives per prompt position to return (None: not asked)."""
    tools: ToolPlan | None = None
    """Chat with tools the model may call: how calls are read out of its text."""


def completion_job(body: CompletionRequest, served: ServedModel) -> Job:
    _check_common(body, served)
    if body.suffix:
        raise APIError.bad_request("suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError.bad_request("best_of is not supported (other than equal to n)", param="best_of")
    prompt_list = _split_prompts(body.prompt)
    if len(prompt_list) * body.n > MAX_N:
        raise APIError.bad_request(
            f"n ({body.n}) times the number of prompts ({len(prompt_list)}) is more than the "
            f"{MAX_N} choices a request may have",
            param="n",
        )
    prompts = [_completion_prompt_ids(p, served) for p in prompt_list]
    structured = structured_output(body)
    scored = _most(
        body.prompt_logprobs, body.logprobs if body.echo else None
    )  # echo's logprobs score the prompt
    job = _job(
        "completion", f"cmpl-{uuid.uuid4().hex}", body, served, prompts, body.logprobs, structured, scored
    )
    if not body.echo:
        return job
    texts = [p if isinstance(p, str) else served.tokenizer.decode(p) for p in prompt_list]
    return replace(job, echo_texts=tuple(text for text in texts for _ in range(body.n)))


def chat_job(body: ChatCompletionRequest, served: ServedModel) -> Job:
    _check_common(body, served)
    tools, tool_grammar = plan_tools(body.tools, body.tool_choice, served.tool_call_parser)
    structured = structured_output(body)
    if tool_grammar is not None:
        if structured is not None:
            raise APIError.bad_request(
                "tool_choice 'required' or a named function constrains the output already: "
                "give no response_format or guided_* with it",
                param="tool_choice",
            )
        structured = tool_grammar
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError.bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    if body.max_completion_tokens is not None:
        body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
    prompt_ids = served.tokenizer.encode(render_chat(body.messages, body, served), add_special_tokens=False)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    job = _job(
        "chat",
        f"chatcmpl-{uuid.uuid4().hex}",
        body,
        served,
        [prompt_ids],
        logprobs,
        structured,
        body.prompt_logprobs,
    )
    return replace(job, tools=tools)


def tokenize(body: TokenizeRequest, served: ServedModel) -> TokenizeResponse:
    """vLLM's /tokenize: the ids a prompt, or messages rendered with the chat template, become."""
    check_model(body.model, served)
    if body.messages is not None:
        text = render_chat(body.messages, body, served)
        add_special_tokens = bool(body.add_special_tokens)
    else:
        text = body.prompt or ""
        add_special_tokens = body.add_special_tokens is not False
    token_ids = served.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    token_strs = None
    if body.return_token_strs:
        token_strs = [served.tokenizer.backend.id_to_token(t) or "" for t in token_ids]
    return TokenizeResponse(
        count=len(token_ids), max_model_len=served.max_model_len, tokens=token_ids, token_strs=token_strs
    )


def detokenize(body: DetokenizeRequest, served: ServedModel) -> DetokenizeResponse:
    """vLLM's /detokenize: the text of token ids, special tokens included."""
    check_model(body.model, served)
    _check_vocabulary(body.tokens, served, "tokens")
    return DetokenizeResponse(prompt=served.tokenizer.decode(body.tokens, skip_special_tokens=False))


def check_model(model: str | None, served: ServedModel, param: str | None = "model") -> None:
    """404 (OpenAI's `model_not_found`) unless `model` is absent or names the served model."""
    if model is not None and model != served.name:
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves `{served.name}`.",
            param=param,
            code="model_not_found",
        )


def _check_common(body: SamplingFields, served: ServedModel) -> None:
    check_model(body.model, served)
    if body.stream_options is not None and not body.stream:
        raise APIError.bad_request(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
    if body.prompt_logprobs is not None and body.stream:
        raise APIError.bad_request(
            "prompt_logprobs is not available with stream (as in vLLM); a streamed completion "
            "with echo and logprobs has the prompt's in its first chunks",
            param="prompt_logprobs",
        )


def _most(*counts: int | None) -> int | None:
    """The largest of the counts given (None: none given)."""
    given = [count for count in counts if count is not None]
    return max(given) if given else None


def _job(
    kind: Literal["completion", "chat"],
    request_id: str,
    body: SamplingFields,
    served: ServedModel,
    prompts: list[list[int]],
    logprobs: int | None,
    structured: StructuredOutput | None,
    prompt_logprobs: int | None,
) -> Job:
    """`prompt_logprobs`: what the workers compute (the field's, or more for echo with logprobs)."""
    params = [
        _sampling_params(body, served, prompt_ids, logprobs, structured, prompt_logprobs)
        for prompt_ids in prompts
    ]
    num_choices = len(prompts) * body.n
    requests = []
    for p, (prompt_ids, prompt_params) in enumerate(zip(prompts, params)):
        for i in range(body.n):
            index = p * body.n + i
            choice_params = prompt_params
            if prompt_params.seed is not None and i:
                choice_params = prompt_params.model_copy(
                    update={"seed": (prompt_params.seed + i) % SEED_MODULUS}
                )
            requests.append(
                GenerateRequest(
                    request_id=request_id if num_choices == 1 else f"{request_id}-{index}",
                    prompt_token_ids=prompt_ids,
                    params=choice_params,
                )
            )
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return Job(
        kind=kind,
        request_id=request_id,
        created=int(time.time()),
        requests=requests,
        num_prompt_tokens=sum(len(p) for p in prompts),
        stream=body.stream,
        include_usage=include_usage,
        logprobs=logprobs,
        prompt_logprobs=body.prompt_logprobs,
    )


def _sampling_params(
    body: SamplingFields,
    served: ServedModel,
    prompt_ids: list[int],
    logprobs: int | None,
    structured: StructuredOutput | None,
    prompt_logprobs: int | None,
) -> SamplingParams:
    fields: dict[str, Any] = {
        name: getattr(body, name) for name in _SAMPLING_FIELDS if getattr(body, name) is not None
    }
    num_prompt_tokens = len(prompt_ids)
    if num_prompt_tokens >= served.max_model_len:  # no room for one output token, whatever max_tokens says
        raise APIError.bad_request(
            f"this model's maximum context length is {served.max_model_len} tokens, but the prompt "
            f"alone has {num_prompt_tokens}; shorten the prompt",
            param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    max_tokens = body.max_tokens
    fields["max_tokens"] = served.max_model_len - num_prompt_tokens if max_tokens is None else max_tokens
    fields["logprobs"] = logprobs
    fields["prompt_logprobs"] = prompt_logprobs
    fields["seed"] = body.seed
    fields["logit_bias"] = _logit_bias(body.logit_bias or {}, served)
    fields["structured"] = structured
    try:
        params = SamplingParams(**fields)
    except ValidationError as exc:
        raise APIError.from_validation(exc) from None
    total = num_prompt_tokens + params.max_tokens
    if total > served.max_model_len:
        raise APIError.bad_request(
            f"this model's maximum context length is {served.max_model_len} tokens, but the request "
            f"needs {total} ({num_prompt_tokens} in the prompt, {params.max_tokens} to generate); "
            "shorten the prompt or lower max_tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    bad_stop = [t for t in params.stop_token_ids if t >= served.vocab_size]
    if bad_stop:
        raise APIError.bad_request(
            f"stop_token_ids out of range [0, {served.vocab_size}): {bad_stop[:5]}", param="stop_token_ids"
        )
    return params


def structured_output(body: SamplingFields) -> StructuredOutput | None:
    """The grammar `response_format` or one of vLLM's `guided_*` fields asks for (at most one of
    them), checked by the grammar engine: 400 naming the field when it cannot be followed."""
    given = {
        name: value
        for name, value in (
            ("response_format", body.response_format if _constrains(body) else None),
            ("guided_json", body.guided_json),
            ("guided_regex", body.guided_regex),
            ("guided_choice", body.guided_choice),
        )
        if value is not None
    }
    if len(given) > 1:
        raise APIError.bad_request(
            f"give at most one of response_format, guided_json, guided_regex, guided_choice (got {', '.join(given)})",
            param=list(given)[1],
        )
    if not given:
        return None
    [(param, value)] = given.items()
    try:
        structured = _structured(param, body)
        structured.check()
    except StructuredOutputError as exc:
        raise APIError.bad_request(str(exc), param=param) from None
    return structured


def _constrains(body: SamplingFields) -> bool:
    return body.response_format is not None and body.response_format.type != "text"


def _structured(param: str, body: SamplingFields) -> StructuredOutput:
    if param == "guided_json":
        return StructuredOutput.json_schema(body.guided_json)
    if param == "guided_regex":
        return StructuredOutput(kind="regex", spec=body.guided_regex or "")
    if param == "guided_choice":
        return StructuredOutput.choice(body.guided_choice or [])
    response_format = body.response_format
    assert response_format is not None
    if response_format.json_schema is None:
        return StructuredOutput(kind="json_object")
    return StructuredOutput.json_schema(
        response_format.json_schema.json_schema, strict=bool(response_format.json_schema.strict)
    )


def _logit_bias(bias: dict[str, float], served: ServedModel) -> dict[int, float]:
    """OpenAI's string keys as token ids, each in the vocabulary."""
    token_ids = {}
    for key, value in bias.items():
        if not key.isdigit():
            raise APIError.bad_request(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        token_ids[int(key)] = value
    _check_vocabulary(list(token_ids), served, "logit_bias")
    return token_ids


def _split_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's prompt forms as a list of prompts: a string or one token-id list each."""
    if isinstance(prompt, str) or not prompt:
        return [prompt] if isinstance(prompt, str) else [[]]
    if isinstance(prompt[0], int):
        return [[int(t) for t in prompt]]
    return list(prompt)


def _completion_prompt_ids(prompt: str | list[int], served: ServedModel) -> list[int]:
    token_ids = served.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    if not token_ids:
        raise APIError.bad_request("the prompt is empty", param="prompt")
    _check_vocabulary(token_ids, served, "prompt")
    return token_ids


def _check_vocabulary(token_ids: list[int], served: ServedModel, param: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < served.vocab_size]
    if bad:
        raise APIError.bad_request(
            f"{param} token ids out of range [0, {served.vocab_size}): {bad[:5]}", param=param
        )


def render_chat(messages_in: list[ChatMessage], body: ChatTemplateFields, served: ServedModel) -> str:
    """The prompt text of `messages`, rendered by the model's chat template with `body`'s settings."""
    messages = [_template_message(message, i) for i, message in enumerate(messages_in)]
    try:
        return served.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tools=body.tools,
            documents=body.documents,
            template_kwargs=body.chat_template_kwargs,
        )
    except NoChatTemplateError as exc:
        raise APIError.bad_request(str(exc), param="messages", code="chat_template_missing") from None
    except ValueError as exc:  # conflicting flags, or the template's raise_exception
        raise APIError.bad_request(str(exc), param="messages") from None
    except TemplateError as exc:
        raise APIError(500, f"the model's chat template failed: {exc}") from None


def _template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    """A message as chat templates read it: text content joined, tool fields where given."""
    if isinstance(message.content, list):
        other = [part.type for part in message.content if part.type != "text"]
        if other:
            raise APIError.bad_request(
                f"only text content parts are supported (got {other[0]!r})", param=f"messages.{index}.content"
            )
        content: str | None = "".join(part.text or "" for part in message.content)
    else:
        content = message.content if message.content is not None or message.tool_calls else ""
    rendered: dict[str, Any] = {"role": message.role, "content": content}
    for name in ("name", "tool_calls", "tool_call_id"):
        if getattr(message, name) is not None:
            rendered[name] = getattr(message, name)
    return rendered
