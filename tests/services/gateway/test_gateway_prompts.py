"""What the gateway makes of prompts: chat-template fields, echo, logit_bias, /tokenize,
/detokenize and GET /v1/models/{id}."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from gateway_fake_backend import MAX_MODEL_LEN, MODEL_NAME, REPLY, InProcessBackend, reply_script, sse_data

from services.gateway.app import create_app
from services.gateway.prepare import ServedModel

Client = TestClient[Any, Any]
TEMPLATE = (
    "{% if tools %}TOOLS:{{ tools | tojson }}|{% endif %}"
    "{% for d in documents or [] %}[{{ d['text'] }}]{% endfor %}"
    "{% if system_hint %}({{ system_hint }}){% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m['tool_call_id'] %}#{{ m['tool_call_id'] }}{% endif %}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
USER = [{"role": "user", "content": "hi"}]


async def rendered(
    client: Client, backend: InProcessBackend, served: ServedModel, body: dict[str, Any]
) -> str:
    """The prompt text the chat request became (and /tokenize says the same)."""
    response = await client.post("/v1/chat/completions", json={"max_tokens": 2, **body})
    assert response.status == 200, await response.text()
    prompt_ids = backend.submitted[-1].prompt_token_ids
    tokenized = await client.post("/tokenize", json=body)
    assert (await tokenized.json())["tokens"] == prompt_ids
    return served.tokenizer.decode(prompt_ids, skip_special_tokens=False)


def served_with(
    make_checkpoint: Callable[..., Path], tmp_path: Path, config: dict[str, Any], **files: str
) -> ServedModel:
    """The test checkpoint (no weights needed) with its tokenizer_config.json and extra files replaced."""
    path = tmp_path / "model"
    shutil.copytree(make_checkpoint("llama"), path)
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", **config}))
    for name, text in files.items():
        (path / name).write_text(text)
    return ServedModel.load(path, name=MODEL_NAME)


ServeFactory = Callable[[ServedModel], Awaitable[tuple[Client, InProcessBackend]]]


@pytest.fixture
async def serve_model() -> AsyncIterator[ServeFactory]:
    """A gateway over the scripted mesh for a model of the test's own."""
    clients: list[Client] = []

    async def serve(served: ServedModel) -> tuple[Client, InProcessBackend]:
        backend = InProcessBackend(reply_script(served.tokenizer))
        client: Client = TestClient(TestServer(create_app(served, backend)))
        await client.start_server()
        clients.append(client)
        return client, backend

    yield serve
    for client in clients:
        await client.close()


async def test_chat_template_jinja_with_tools_documents_and_kwargs(
    make_checkpoint: Callable[..., Path], tmp_path: Path, serve_model: ServeFactory
) -> None:
    served = served_with(make_checkpoint, tmp_path, {}, **{"chat_template.jinja": TEMPLATE})
    client, backend = await serve_model(served)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    body = {
        "messages": messages,
        "tools": tools,
        "tool_choice": "none",
        "documents": [{"text": "doc"}],
        "chat_template_kwargs": {"system_hint": "brief"},
    }
    text = await rendered(client, backend, served, body)
    assert text == (
        'TOOLS:[{"type": "function", "function": {"name": "f", "parameters": {}}}]|[doc](brief)'
        "<|user|>hi<|endoftext|><|assistant|>None<|endoftext|><|tool|>42#c1<|endoftext|><|assistant|>"
    )


async def test_continue_final_message_prefills_the_answer(
    client: Client, backend: InProcessBackend, served: ServedModel
) -> None:
    messages = [*USER, {"role": "assistant", "content": "def add("}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    assert await rendered(client, backend, served, body) == "<|user|>hi<|endoftext|><|assistant|>def add("
    assert await rendered(client, backend, served, {"messages": USER, "add_generation_prompt": False}) == (
        "<|user|>hi<|endoftext|>"
    )


async def test_a_model_without_a_chat_template_gets_a_clear_400(
    make_checkpoint: Callable[..., Path], tmp_path: Path, serve_model: ServeFactory
) -> None:
    served = served_with(make_checkpoint, tmp_path, {})
    client, backend = await serve_model(served)
    for path in ("/v1/chat/completions", "/tokenize"):
        response = await client.post(path, json={"messages": USER})
        assert response.status == 400
        error = (await response.json())["error"]
        assert "no chat template" in error["message"] and error["code"] == "chat_template_missing"
    assert backend.submitted == []
    response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert response.status == 200


async def test_tokenize_and_detokenize_round_trip(client: Client, served: ServedModel) -> None:
    response = await client.post("/tokenize", json={"prompt": "def add(a, b):", "return_token_strs": True})
    assert response.status == 200
    body = await response.json()
    ids = served.tokenizer.encode("def add(a, b):")
    assert body == {
        "count": len(ids),
        "max_model_len": MAX_MODEL_LEN,
        "tokens": ids,
        "token_strs": [served.tokenizer.backend.id_to_token(t) for t in ids],
    }
    response = await client.post("/detokenize", json={"model": MODEL_NAME, "tokens": ids})
    assert response.status == 200
    assert await response.json() == {"prompt": "def add(a, b):"}
    eos = served.tokenizer.encode("<|endoftext|>", add_special_tokens=False)
    response = await client.post("/detokenize", json={"tokens": eos})
    assert (await response.json())["prompt"] == "<|endoftext|>"  # special tokens kept, as vLLM


async def test_retrieve_model(client: Client) -> None:
    response = await client.get(f"/v1/models/{MODEL_NAME}")
    assert response.status == 200
    card = await response.json()
    assert card["id"] == MODEL_NAME and card["object"] == "model" and card["max_model_len"] == MAX_MODEL_LEN
    listed = await (await client.get("/v1/models")).json()
    assert listed["data"] == [card]


async def test_echo_prepends_each_prompt(client: Client, served: ServedModel) -> None:
    body = {"prompt": ["def add(", "class A:"], "n": 2, "max_tokens": 200, "echo": True}
    response = await client.post("/v1/completions", json=body)
    assert response.status == 200
    texts = [c["text"] for c in (await response.json())["choices"]]
    assert texts == ["def add(" + REPLY] * 2 + ["class A:" + REPLY] * 2
    prompt_ids = served.tokenizer.encode("print(i)")
    response = await client.post("/v1/completions", json={**body, "prompt": prompt_ids, "n": 1})
    [choice] = (await response.json())["choices"]
    assert choice["text"] == "print(i)" + REPLY
    response = await client.post(
        "/v1/completions", json={**body, "prompt": "def add(", "n": 1, "stream": True}
    )
    chunks = sse_data(await response.text())
    assert chunks[0]["choices"][0]["text"] == "def add("
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "def add(" + REPLY


async def test_logit_bias_reaches_the_mesh_as_token_ids(client: Client, backend: InProcessBackend) -> None:
    response = await client.post(
        "/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "logit_bias": {"7": -100, "12": 2.5}}
    )
    assert response.status == 200
    assert backend.submitted[0].params.logit_bias == {7: -100.0, 12: 2.5}
