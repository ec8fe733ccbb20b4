"""From a validated OpenAI request to the mesh's `GenerateRequest`s: one per choice.

Here the prompt is rendered (chat template) and tokenized, checked against the context length and
the vocabulary, and the sampling fields become a `SamplingParams` (which checks their ranges).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from jinja2 import TemplateError
from pydantic import ValidationError

from services.gateway.errors import APIError
from services.gateway.openai_api import MAX_N, ChatCompletionRequest, CompletionRequest, SamplingFields
from shared.errors import ModelConfigError
from shared.protocol import GenerateRequest
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer

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

    @classmethod
    def load(
        cls, model_dir: str | Path, name: str | None = None, max_model_len: int | None = None
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


def completion_job(body: CompletionRequest, served: ServedModel) -> Job:
    _check_common(body, served)
    if body.echo:
        raise APIError.bad_request("echo is not supported", param="echo")
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
    return _job("completion", f"cmpl-{uuid.uuid4().hex}", body, served, prompts, body.logprobs)


def chat_job(body: ChatCompletionRequest, served: ServedModel) -> Job:
    _check_common(body, served)
    if body.tools:
        raise APIError.bad_request("tools are not supported", param="tools")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise APIError.bad_request("only response_format type 'text' is supported", param="response_format")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError.bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    if body.max_completion_tokens is not None:
        body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
    prompt_ids = served.tokenizer.encode(_render_chat(body, served), add_special_tokens=False)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _job("chat", f"chatcmpl-{uuid.uuid4().hex}", body, served, [prompt_ids], logprobs)


def _check_common(body: SamplingFields, served: ServedModel) -> None:
    if body.model is not None and body.model != served.name:
        raise APIError(
            404,
            f"The model `{body.model}` does not exist; this server serves `{served.name}`.",
            param="model",
            code="model_not_found",
        )
    if body.stream_options is not None and not body.stream:
        raise APIError.bad_request(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
    if body.logit_bias:
        raise APIError.bad_request("logit_bias is not supported", param="logit_bias")


def _job(
    kind: Literal["completion", "chat"],
    request_id: str,
    body: SamplingFields,
    served: ServedModel,
    prompts: list[list[int]],
    logprobs: int | None,
) -> Job:
    params = [_sampling_params(body, served, prompt_ids, logprobs) for prompt_ids in prompts]
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
    )


def _sampling_params(
    body: SamplingFields, served: ServedModel, prompt_ids: list[int], logprobs: int | None
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
    fields["seed"] = body.seed
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
    bad = [t for t in token_ids if not 0 <= t < served.vocab_size]
    if bad:
        raise APIError.bad_request(
            f"prompt token ids out of range [0, {served.vocab_size}): {bad[:5]}", param="prompt"
        )
    return token_ids


def _render_chat(body: ChatCompletionRequest, served: ServedModel) -> str:
    messages: list[dict[str, Any]] = []
    for i, message in enumerate(body.messages):
        if isinstance(message.content, list):
            other = [part.type for part in message.content if part.type != "text"]
            if other:
                raise APIError.bad_request(
                    f"only text content parts are supported (got {other[0]!r})", param=f"messages.{i}.content"
                )
            content = "".join(part.text or "" for part in message.content)
        else:
            content = message.content or ""
        rendered: dict[str, Any] = {"role": message.role, "content": content}
        if message.name is not None:
            rendered["name"] = message.name
        messages.append(rendered)
    try:
        return served.tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt
        )
    except ValueError as exc:  # no template, or the template's raise_exception
        raise APIError.bad_request(str(exc), param="messages") from None
    except TemplateError as exc:
        raise APIError(500, f"the model's chat template failed: {exc}") from None
