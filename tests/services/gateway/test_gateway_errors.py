"""Every bad input gets its HTTP status and OpenAI's error body, naming the field where there is one."""

from __future__ import annotations

import io
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from gateway_fake_backend import MAX_MODEL_LEN, ClientFactory, InProcessBackend

Client = TestClient[Any, Any]
API_KEY = "sk-test"

LONG_PROMPT = [65] * MAX_MODEL_LEN
"""A prompt that fills the whole context."""

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
USER_X = [{"role": "user", "content": "x"}]
CTX = f"this model's maximum context length is {MAX_MODEL_LEN} tokens"

# fmt: off
CASES: list[tuple[str, str, str, Any, int, str | None, str]] = [
    # (case, method, path, body (a dict, or raw bytes), status, param, words in the message)
    ("invalid JSON", "POST", CMPL, b'{"prompt": "x",', 400, None, "the body is not valid JSON"),
    ("body not an object", "POST", CMPL, b"[1, 2]", 400, None, "the body must be a JSON object"),
    ("empty body", "POST", CMPL, b"", 400, None, "the body is not valid JSON"),
    ("missing prompt", "POST", CMPL, {"max_tokens": 3}, 400, "prompt", "prompt: Field required"),
    ("prompt of wrong type", "POST", CMPL, {"prompt": 5}, 400, "prompt", "prompt: must be a string"),
    ("mixed prompt list", "POST", CMPL, {"prompt": ["a", 1]}, 400, "prompt", "prompt: must be a string"),
    ("empty prompt", "POST", CMPL, {"prompt": ""}, 400, "prompt", "the prompt is empty"),
    ("empty prompt in a batch", "POST", CMPL, {"prompt": ["a", ""]}, 400, "prompt", "prompt: the prompt is empty"),
    ("token id with a fraction", "POST", CMPL, {"prompt": [1, 2.5]}, 400, "prompt", "prompt: must be a string"),
    ("n a string", "POST", CMPL, {"prompt": "x", "n": "2"}, 400, "n", "n: Input should be a valid integer"),
    ("token id out of vocab", "POST", CMPL, {"prompt": [1, 99999]}, 400, "prompt", "out of range"),
    ("temperature -1", "POST", CMPL, {"prompt": "x", "temperature": -1}, 400, "temperature",
     "temperature: Input should be greater than or equal to 0"),
    ("temperature a string", "POST", CMPL, {"prompt": "x", "temperature": "0.5"}, 400, "temperature",
     "temperature: Input should be a valid number"),
    ("top_p 0", "POST", CMPL, {"prompt": "x", "top_p": 0}, 400, "top_p", "top_p: Input should be greater than 0"),
    ("max_tokens 0", "POST", CMPL, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens",
     "max_tokens: Input should be greater than or equal to 1"),
    ("max_tokens float", "POST", CMPL, {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens", "valid integer"),
    ("min_tokens > max_tokens", "POST", CMPL, {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400, None,
     "min_tokens (3) must not exceed max_tokens (2)"),
    ("prompt + max_tokens too long", "POST", CMPL, {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens",
     f"{CTX}, but the request needs {MAX_MODEL_LEN + 1} (1 in the prompt, {MAX_MODEL_LEN} to generate)"),
    ("prompt alone too long", "POST", CMPL, {"prompt": LONG_PROMPT}, 400, "prompt",
     f"{CTX}, but the prompt alone has {MAX_MODEL_LEN}"),
    ("wrong model", "POST", CMPL, {"model": "gpt-4", "prompt": "x"}, 404, "model", "The model `gpt-4` does not exist"),
    ("stop not str or list", "POST", CMPL, {"prompt": "x", "stop": 5}, 400, "stop",
     "stop: must be a string or a list of strings"),
    ("stop list of numbers", "POST", CMPL, {"prompt": "x", "stop": [1]}, 400, "stop", "stop: must be a string"),
    ("empty stop string", "POST", CMPL, {"prompt": "x", "stop": [""]}, 400, "stop", "must not be empty"),
    ("stop token id out of vocab", "POST", CMPL, {"prompt": "x", "stop_token_ids": [10**6]}, 400, "stop_token_ids",
     "out of range"),
    ("logprobs > 20", "POST", CMPL, {"prompt": "x", "logprobs": 21}, 400, "logprobs",
     "logprobs: Input should be less than or equal to 20"),
    ("top_logprobs > 20", "POST", CHAT, {"messages": USER_X, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs", "top_logprobs: Input should be less than or equal to 20"),
    ("top_logprobs without logprobs", "POST", CHAT, {"messages": USER_X, "top_logprobs": 2}, 400, "top_logprobs",
     "needs logprobs"),
    ("n 0", "POST", CMPL, {"prompt": "x", "n": 0}, 400, "n", "n: Input should be greater than or equal to 1"),
    ("n 129", "POST", CMPL, {"prompt": "x", "n": 129}, 400, "n", "n: Input should be less than or equal to 128"),
    ("seed negative", "POST", CMPL, {"prompt": "x", "seed": -1}, 400, "seed", "seed: Input should be greater"),
    ("bad speculative method", "POST", CMPL, {"prompt": "x", "speculative": {"method": "magic"}}, 400,
     "speculative.method", "speculative.method: Input should be 'naive', 'ngram'"),
    ("bad speculative k", "POST", CMPL, {"prompt": "x", "speculative": {"num_speculative_tokens": 99}}, 400,
     "speculative.num_speculative_tokens", "less than or equal to 15"),
    ("speculative k a string", "POST", CMPL, {"prompt": "x", "speculative": {"num_speculative_tokens": "3"}}, 400,
     "speculative.num_speculative_tokens", "Input should be a valid integer"),
    ("speculative enabled a string", "POST", CMPL, {"prompt": "x", "speculative": {"enabled": "false"}}, 400,
     "speculative.enabled", "Input should be a valid boolean"),
    ("unknown speculative field", "POST", CMPL, {"prompt": "x", "speculative": {"k": 3}}, 400, "speculative.k",
     "Extra inputs are not permitted"),
    ("speculative not an object", "POST", CMPL, {"prompt": "x", "speculative": True}, 400, "speculative",
     "speculative: Input should be an object"),
    ("prompt_logprobs negative", "POST", CMPL, {"prompt": "x", "prompt_logprobs": -1}, 400, "prompt_logprobs",
     "prompt_logprobs: Input should be greater than or equal to 0"),
    ("prompt_logprobs > 20", "POST", CHAT, {"messages": USER_X, "prompt_logprobs": 21}, 400, "prompt_logprobs",
     "prompt_logprobs: Input should be less than or equal to 20"),
    ("prompt_logprobs a string", "POST", CMPL, {"prompt": "x", "prompt_logprobs": "2"}, 400, "prompt_logprobs",
     "Input should be a valid integer"),
    ("prompt_logprobs with stream", "POST", CMPL, {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400,
     "prompt_logprobs", "prompt_logprobs is not available with stream"),
    ("echo with logprobs > 20", "POST", CMPL, {"prompt": "x", "echo": True, "logprobs": 21}, 400, "logprobs",
     "logprobs: Input should be less than or equal to 20"),
    ("best_of", "POST", CMPL, {"prompt": "x", "best_of": 3}, 400, "best_of", "best_of is not supported"),
    ("logit_bias key not a token id", "POST", CMPL, {"prompt": "x", "logit_bias": {"a": 1.0}}, 400, "logit_bias",
     "logit_bias keys must be token ids, got 'a'"),
    ("logit_bias past the vocabulary", "POST", CMPL, {"prompt": "x", "logit_bias": {"384": 1.0}}, 400,
     "logit_bias", "logit_bias token ids out of range [0, 384): [384]"),
    ("logit_bias over 100", "POST", CHAT, {"messages": USER_X, "logit_bias": {"5": 101}}, 400, "logit_bias.5",
     "less than or equal to 100"),
    ("stream_options without stream", "POST", CMPL, {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options", "only allowed when stream is true"),
    ("missing messages", "POST", CHAT, {"model": "tiny-llama"}, 400, "messages", "messages: Field required"),
    ("empty messages", "POST", CHAT, {"messages": []}, 400, "messages", "at least 1 item"),
    ("bad role", "POST", CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role",
     "messages.0.role: Input should be"),
    ("image content", "POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages.0.content", "only text content"),
    ("tool without a function", "POST", CHAT, {"messages": USER_X, "tools": [{"type": "function"}]}, 400,
     "tools.0", "each tool must be"),
    ("both generation prompt and continue", "POST", CHAT, {"messages": USER_X, "continue_final_message": True}, 400,
     "messages", "add_generation_prompt and continue_final_message cannot both be true"),
    ("response_format of an unknown type", "POST", CHAT, {"messages": USER_X, "response_format": {"type": "xml"}},
     400, "response_format.type", "'text', 'json_object' or 'json_schema'"),
    ("chat prompt too long", "POST", CHAT, {"messages": [{"role": "user", "content": "def add(a, b): " * 200}]}, 400,
     "messages", f"{CTX}, but the prompt alone has"),
    ("prompt alone too long, max_tokens given", "POST", CMPL, {"prompt": LONG_PROMPT, "max_tokens": 1}, 400,
     "prompt", f"{CTX}, but the prompt alone has {MAX_MODEL_LEN}"),
    ("n times prompts > 128", "POST", CMPL, {"prompt": ["a", "b", "c"], "n": 50}, 400, "n",
     "n (50) times the number of prompts (3) is more than the 128 choices"),
    ("17 stop strings", "POST", CMPL, {"prompt": "x", "stop": ["a"] * 17}, 400, "stop",
     "stop: at most 16 stop strings are allowed, got 17"),
    ("stop string of 257", "POST", CMPL, {"prompt": "x", "stop": "a" * 257}, 400, "stop",
     "stop: a stop string may have at most 256 characters, got one of 257"),
    ("65 stop token ids", "POST", CMPL, {"prompt": "x", "stop_token_ids": [5] * 65}, 400, "stop_token_ids",
     "stop_token_ids: List should have at most 64 items"),
    ("body over the limit", "POST", CMPL, b" " * (16 * MAX_MODEL_LEN + 2**20 + 1), 413, None,
     f"larger than this gateway's body limit of {16 * MAX_MODEL_LEN + 2**20} bytes"),
    ("unknown route", "GET", "/v1/nothing", None, 404, None, "no such route: GET /v1/nothing"),
    ("unknown model id", "GET", "/v1/models/gpt-4", None, 404, None, "The model `gpt-4` does not exist"),
    ("tokenize neither prompt nor messages", "POST", "/tokenize", {"model": "tiny-llama"}, 400, None,
     "give either prompt or messages"),
    ("tokenize both prompt and messages", "POST", "/tokenize", {"prompt": "x", "messages": USER_X}, 400, None,
     "give either prompt or messages"),
    ("tokenize for another model", "POST", "/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "model",
     "The model `gpt-4` does not exist"),
    ("detokenize past the vocabulary", "POST", "/detokenize", {"tokens": [1, 384]}, 400, "tokens",
     "tokens token ids out of range [0, 384): [384]"),
    ("detokenize negative id", "POST", "/detokenize", {"tokens": [-1]}, 400, "tokens.0",
     "greater than or equal to 0"),
    ("wrong method", "GET", CMPL, None, 405, None, "GET is not allowed on /v1/completions (allowed: POST)"),
    ("wrong method on models", "POST", "/v1/models", {}, 405, None, "POST is not allowed on /v1/models"),
]
# fmt: on


@pytest.fixture
async def keyed_client(make_client: ClientFactory) -> Client:
    return await make_client(api_keys=frozenset({API_KEY}))


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "param", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
async def test_bad_request_gets_status_and_openai_error_body(
    keyed_client: Client,
    backend: InProcessBackend,
    method: str,
    path: str,
    body: Any,
    status: int,
    param: str | None,
    words: str,
) -> None:
    kwargs: dict[str, Any] = {"headers": {"Authorization": f"Bearer {API_KEY}"}}
    if isinstance(body, bytes):
        kwargs["data"] = io.BytesIO(body)  # aiohttp warns of large raw bytes
        kwargs["headers"]["Content-Type"] = "application/json"
    elif body is not None:
        kwargs["json"] = body
    response = await keyed_client.request(method, path, **kwargs)
    assert response.status == status
    assert response.headers["Content-Type"].startswith("application/json")
    error = (await response.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"]
    assert error["param"] == param
    assert "Traceback" not in error["message"]
    assert backend.submitted == []
    if status == 405:
        assert response.headers["Allow"]


async def test_bad_api_key_is_401(keyed_client: Client) -> None:
    response = await keyed_client.post(
        "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer x"}
    )
    assert response.status == 401
    error = (await response.json())["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")


async def test_wrong_model_is_model_not_found(keyed_client: Client) -> None:
    response = await keyed_client.post(
        "/v1/chat/completions",
        json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert response.status == 404
    assert (await response.json())["error"]["code"] == "model_not_found"
