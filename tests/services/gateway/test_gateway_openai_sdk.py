"""The official `openai` SDK talks to the gateway: it parses every body and chunk we send."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from gateway_fake_backend import MODEL_NAME, REPLY, ClientFactory, InProcessBackend, error_script

from services.gateway.prepare import ServedModel

openai = pytest.importorskip("openai")

API_KEY = "sk-gateway-test"
MESSAGES: list[Any] = [{"role": "user", "content": "Say hello"}]


@pytest.fixture
async def sdk(make_client: ClientFactory) -> AsyncIterator[Any]:
    client = await make_client(api_keys=frozenset({API_KEY}))
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=API_KEY, max_retries=0, timeout=10)
    yield sdk
    await sdk.close()


async def test_completion(sdk: Any) -> None:
    completion = await sdk.completions.create(model=MODEL_NAME, prompt="def add(", max_tokens=100, logprobs=2)
    [choice] = completion.choices
    assert choice.text == REPLY and choice.finish_reason == "stop"
    assert (
        len(choice.logprobs.tokens)
        == len(choice.logprobs.token_logprobs)
        == completion.usage.completion_tokens
    )
    # Legacy format: alternatives keyed by token text (two ids of the same text share one key).
    assert all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert (
        completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
    )
    assert completion.usage.model_extra["speculative"]["num_accepted_tokens"] == 7


async def test_completion_stream(sdk: Any) -> None:
    stream = await sdk.completions.create(
        model=MODEL_NAME,
        prompt="def add(",
        max_tokens=100,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
        else:
            usage = chunk.usage
    assert text == REPLY
    assert usage is not None and usage.completion_tokens > 0


async def test_chat_with_n_and_logprobs(sdk: Any) -> None:
    chat = await sdk.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=100, n=2, seed=3, logprobs=True, top_logprobs=2
    )
    assert [c.index for c in chat.choices] == [0, 1]
    for choice in chat.choices:
        assert choice.message.role == "assistant" and choice.message.content == REPLY
        assert choice.logprobs is not None and choice.logprobs.content
        assert all(len(entry.top_logprobs) == 2 and entry.bytes for entry in choice.logprobs.content)


async def test_chat_stream(sdk: Any) -> None:
    stream = await sdk.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=100, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == REPLY
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_models(sdk: Any) -> None:
    models = await sdk.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


async def test_errors_raise_the_sdks_exceptions(sdk: Any, backend: InProcessBackend) -> None:
    with pytest.raises(openai.NotFoundError):
        await sdk.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError) as bad:
        await sdk.completions.create(model=MODEL_NAME, prompt="x", temperature=-1)
    assert bad.value.param == "temperature"
    wrong_key = openai.AsyncOpenAI(base_url=str(sdk.base_url), api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await wrong_key.models.list()
    await wrong_key.close()
    backend.script = error_script(429)
    with pytest.raises(openai.RateLimitError):
        await sdk.chat.completions.create(model=MODEL_NAME, messages=MESSAGES)


async def test_error_mid_stream_raises_in_the_sdk(sdk: Any, backend: InProcessBackend) -> None:
    backend.script = error_script(500, "worker died", after=1)
    stream = await sdk.completions.create(model=MODEL_NAME, prompt="x", max_tokens=5, stream=True)
    with pytest.raises(openai.APIError, match="worker died"):
        async for _ in stream:
            pass


async def test_models_retrieve(sdk: Any) -> None:
    model = await sdk.models.retrieve(MODEL_NAME)
    assert model.id == MODEL_NAME and model.object == "model"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        await sdk.models.retrieve("gpt-4")


async def test_completion_echo_and_logit_bias(sdk: Any, backend: InProcessBackend) -> None:
    completion = await sdk.completions.create(
        model=MODEL_NAME, prompt="def add(", max_tokens=100, echo=True, logit_bias={"5": -100, "9": 3}
    )
    assert completion.choices[0].text == "def add(" + REPLY
    assert backend.submitted[0].params.logit_bias == {5: -100.0, 9: 3.0}


async def test_chat_template_fields_as_extra_body(
    sdk: Any, backend: InProcessBackend, served: ServedModel
) -> None:
    """vLLM's chat-template fields through the SDK's `extra_body`, as vLLM's docs send them."""
    messages: list[Any] = [*MESSAGES, {"role": "assistant", "content": "Hello"}]
    chat = await sdk.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=100,
        extra_body={
            "add_generation_prompt": False,
            "continue_final_message": True,
            "chat_template_kwargs": {},
        },
    )
    assert chat.choices[0].message.content == REPLY
    [request] = backend.submitted
    prompt = served.tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False)
    assert prompt == "<|user|>Say hello<|endoftext|><|assistant|>Hello"


async def test_completion_echo_with_logprobs(
    sdk: Any, backend: InProcessBackend, served: ServedModel
) -> None:
    """OpenAI's legacy echo: the prompt's tokens, offsets and logprobs (the first one null), then
    the completion's, in one `logprobs` as in one text."""
    completion = await sdk.completions.create(
        model=MODEL_NAME, prompt="def add(", max_tokens=100, echo=True, logprobs=2
    )
    [choice] = completion.choices
    [request] = backend.submitted
    prompt_ids = request.prompt_token_ids
    assert request.params.prompt_logprobs == 2  # the workers score the prompt for echo's logprobs
    assert choice.text == "def add(" + REPLY
    lp = choice.logprobs
    num_prompt = len(prompt_ids)
    assert len(lp.tokens) == num_prompt + completion.usage.completion_tokens
    assert lp.tokens[:num_prompt] == [served.tokenizer.token_to_text(t) for t in prompt_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) for v in lp.token_logprobs[1:])
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.text_offset[num_prompt] == len("def add(")  # the completion's offsets start after the prompt
    assert choice.model_extra["prompt_logprobs"] is None  # vLLM's field only when asked for


async def test_completion_echo_with_logprobs_streamed(sdk: Any, backend: InProcessBackend) -> None:
    """The prompt's part comes in the first chunk; the completion's follow with offsets after it."""
    stream = await sdk.completions.create(
        model=MODEL_NAME, prompt="def add(", max_tokens=100, echo=True, logprobs=1, stream=True
    )
    chunks = [chunk async for chunk in stream]
    num_prompt = len(backend.submitted[0].prompt_token_ids)
    first = chunks[0].choices[0]
    assert first.text == "def add(" and len(first.logprobs.tokens) == num_prompt
    assert first.logprobs.token_logprobs[0] is None
    text = "".join(c.choices[0].text for c in chunks)
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert text == "def add(" + REPLY
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


async def test_prompt_logprobs_as_vllm_returns_them(sdk: Any, backend: InProcessBackend) -> None:
    """vLLM's extension field: per prompt position {token id: {logprob, rank, decoded_token}}, the
    prompt token first; in each completion choice, at the top of a chat completion."""
    completion = await sdk.completions.create(
        model=MODEL_NAME, prompt="def add(", max_tokens=5, extra_body={"prompt_logprobs": 1}
    )
    prompt_ids = backend.submitted[0].prompt_token_ids
    entries = completion.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for token_id, entry in zip(prompt_ids[1:], entries[1:]):
        assert next(iter(entry)) == str(token_id)
        assert set(entry[str(token_id)]) == {"logprob", "rank", "decoded_token"}
        assert 1 <= len(entry) <= 2
    chat = await sdk.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=5, n=2, extra_body={"prompt_logprobs": 0}
    )
    chat_ids = backend.submitted[-1].prompt_token_ids
    entries = chat.model_extra["prompt_logprobs"]
    assert len(entries) == len(chat_ids) and entries[0] is None
    assert [list(e) for e in entries[1:]] == [[str(t)] for t in chat_ids[1:]]
