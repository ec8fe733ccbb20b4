"""/openapi.json: it describes every route the gateway serves, and what the gateway answers (bodies,
streamed chunks, errors) is valid against it; requests it calls invalid get a 400."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema_rs
import pytest
from aiohttp.test_utils import TestClient
from gateway_fake_backend import MODEL_NAME, ClientFactory, InProcessBackend, error_script

Client = TestClient[Any, Any]
API_KEY = "sk-test"
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
USER_X = [{"role": "user", "content": "x"}]
SSE = "text/event-stream"

# fmt: off
ANSWERS: list[tuple[str, str, str, dict[str, Any] | None]] = [
    # (case, method, path, JSON body)
    ("completion", "POST", CMPL, {"prompt": "def add(", "max_tokens": 20, "logprobs": 2}),
    ("completion batch, n 2", "POST", CMPL, {"prompt": ["a", "b"], "n": 2, "max_tokens": 5}),
    ("completion stream with usage", "POST", CMPL,
     {"prompt": "x", "stream": True, "logprobs": 1, "stream_options": {"include_usage": True}}),
    ("chat", "POST", CHAT, {"messages": USER_X, "logprobs": True, "top_logprobs": 2}),
    ("chat stream with usage", "POST", CHAT,
     {"messages": USER_X, "stream": True, "n": 2, "logprobs": True, "stream_options": {"include_usage": True}}),
    ("invalid request", "POST", CMPL, {"prompt": "x", "temperature": -1}),
    ("unknown model", "POST", CHAT, {"model": "gpt-4", "messages": USER_X}),
    ("models", "GET", "/v1/models", None),
    ("one model", "GET", f"/v1/models/{MODEL_NAME}", None),
    ("unknown model id", "GET", "/v1/models/gpt-4", None),
    ("tokenize prompt", "POST", "/tokenize", {"prompt": "def add(", "return_token_strs": True}),
    ("tokenize messages", "POST", "/tokenize", {"messages": USER_X, "add_generation_prompt": False}),
    ("tokenize neither", "POST", "/tokenize", {}),
    ("detokenize", "POST", "/detokenize", {"tokens": [5, 6, 7]}),
    ("echo", "POST", CMPL, {"prompt": "x", "echo": True, "stream": True, "logit_bias": {"5": -100}}),
    ("echo with logprobs", "POST", CMPL, {"prompt": "def add(", "echo": True, "logprobs": 2, "prompt_logprobs": 1}),
    ("echo with logprobs, streamed", "POST", CMPL, {"prompt": "def add(", "echo": True, "logprobs": 2, "stream": True}),
    ("chat prompt_logprobs", "POST", CHAT, {"messages": USER_X, "prompt_logprobs": 2}),
    ("health", "GET", "/health", None),
    ("metrics", "GET", "/metrics", None),
]
INVALID: list[tuple[str, str, dict[str, Any]]] = [
    # (case, path, a body the document's request schema rejects)
    ("n over 128", CMPL, {"prompt": "x", "n": 129}),
    ("17 stop strings", CMPL, {"prompt": "x", "stop": ["a"] * 17}),
    ("empty stop string", CMPL, {"prompt": "x", "stop": ""}),
    ("negative prompt token id", CMPL, {"prompt": [1, -2]}),
    ("empty prompt list", CMPL, {"prompt": []}),
    ("empty prompt", CMPL, {"prompt": ""}),
    ("empty prompt in a batch", CMPL, {"prompt": ["a", ""]}),
    ("max_tokens with a fraction", CMPL, {"prompt": "x", "max_tokens": 2.5}),
    ("temperature a string", CMPL, {"prompt": "x", "temperature": "0.5"}),
    ("speculative k a string", CMPL, {"prompt": "x", "speculative": {"num_speculative_tokens": "3"}}),
    ("speculative enabled a string", CHAT, {"messages": USER_X, "speculative": {"enabled": "false"}}),
    ("include_usage a string", CHAT, {"messages": USER_X, "stream": True, "stream_options": {"include_usage": "1"}}),
    ("no messages", CHAT, {"messages": []}),
    ("unknown role", CHAT, {"messages": [{"role": "robot", "content": "x"}]}),
    ("logit_bias over 100", CHAT, {"messages": USER_X, "logit_bias": {"5": 100.5}}),
    ("detokenize a negative id", "/detokenize", {"tokens": [-1]}),
    ("tokenize empty messages", "/tokenize", {"messages": []}),
]
# fmt: on


@pytest.fixture
async def keyed_client(make_client: ClientFactory) -> Client:
    return await make_client(api_keys=frozenset({API_KEY}))


async def document_of(client: Client) -> dict[str, Any]:
    response = await client.get("/openapi.json")
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("application/json")
    document: dict[str, Any] = await response.json()
    return document


def validator(document: dict[str, Any], schema: dict[str, Any]) -> Any:
    """Validates against `schema`, its `$ref`s resolved in the document's components."""
    return jsonschema_rs.Draft202012Validator({**schema, "components": document["components"]})


async def test_document_describes_every_route(client: Client) -> None:
    document = await document_of(client)
    assert document["openapi"] == "3.1.0"
    assert MODEL_NAME in document["info"]["description"]
    routed = {
        (route.method.lower(), route.resource.canonical)
        for route in client.app.router.routes()
        if route.resource is not None
    }
    described = {(method, path) for path, methods in document["paths"].items() for method in methods}
    assert described == routed
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= {
        path for _, path in routed
    }


async def test_api_keys_make_v1_operations_bearer_secured(client: Client, keyed_client: Client) -> None:
    for document, keyed in ((await document_of(client), False), (await document_of(keyed_client), True)):
        for path, methods in document["paths"].items():
            for described in methods.values():
                secured = keyed and path.startswith("/v1/")
                assert ("security" in described) == secured, path
                assert ("401" in described["responses"]) == secured, path


@pytest.mark.parametrize(("method", "path", "body"), [a[1:] for a in ANSWERS], ids=[a[0] for a in ANSWERS])
async def test_answers_are_valid_against_the_document(
    keyed_client: Client, method: str, path: str, body: dict[str, Any] | None
) -> None:
    document = await document_of(keyed_client)
    response = await keyed_client.request(
        method, path, json=body, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    check_answer(document, method, path, response.status, response.content_type, await response.text())


async def test_mesh_failures_are_valid_against_the_document(
    client: Client, backend: InProcessBackend
) -> None:
    """A 429 before the stream starts, with its Retry-After; an error event after it started."""
    document = await document_of(client)
    backend.script = error_script(429)
    response = await client.post(CHAT, json={"messages": USER_X, "stream": True})
    assert response.status == 429 and int(response.headers["Retry-After"]) >= 0
    check_answer(document, "POST", CHAT, 429, response.content_type, await response.text())
    backend.script = error_script(500, "the worker died", after=2)
    response = await client.post(CMPL, json={"prompt": "x", "stream": True})
    text = await response.text()
    assert response.status == 200 and "the worker died" in text
    check_answer(document, "POST", CMPL, 200, response.content_type, text)


async def test_no_live_worker_is_valid_against_the_document(
    client: Client, backend: InProcessBackend
) -> None:
    document = await document_of(client)
    backend.healthy = (False, "no live worker")
    for method, path, body in (("GET", "/health", None), ("POST", CMPL, {"prompt": "x"})):
        response = await client.request(method, path, json=body)
        assert response.status == 503
        check_answer(document, method, path, 503, response.content_type, await response.text())


@pytest.mark.parametrize(("path", "body"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
async def test_requests_the_document_rejects_get_400(
    client: Client, backend: InProcessBackend, path: str, body: dict[str, Any]
) -> None:
    document = await document_of(client)
    request_schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert not validator(document, request_schema).is_valid(body)
    response = await client.post(path, json=body)
    assert response.status == 400, await response.text()
    assert backend.submitted == []


def check_answer(
    document: dict[str, Any], method: str, path: str, status: int, content_type: str, text: str
) -> None:
    """The status is documented for the operation, with this media type, and the body (each `data:`
    payload of a stream) is valid against its schema."""
    responses = document["paths"][documented_path(document, path)][method.lower()]["responses"]
    assert str(status) in responses, f"{status} is not documented for {method} {path}: {text[:300]}"
    content = responses[str(status)]["content"]
    assert content_type in content, f"{content_type} is not documented for {status} of {method} {path}"
    schema = content[content_type]["schema"]
    if content_type == "application/json":
        validator(document, schema).validate(json.loads(text))
    elif content_type == SSE:
        check_stream(document, schema, text)
    else:
        validator(document, schema).validate(text)


def documented_path(document: dict[str, Any], path: str) -> str:
    """The document's path that `path` is an instance of (`/v1/models/x` of `/v1/models/{model}`)."""
    for template in document["paths"]:
        pattern = re.sub(r"\\\{[^/]+\\\}", "[^/]+", re.escape(template))
        if re.fullmatch(pattern, path):
            return str(template)
    raise AssertionError(f"{path} is not in the document")


def check_stream(document: dict[str, Any], event_schema: dict[str, Any], text: str) -> None:
    """Each event is valid against the event schema and its JSON against its `contentSchema`."""
    (json_data,) = (s for s in event_schema["properties"]["data"]["anyOf"] if "contentSchema" in s)
    events = text.split("\n\n")
    assert events.pop() == "" and events
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, event
        data = event.removeprefix("data: ")
        validator(document, event_schema).validate({"data": data})
        if data != "[DONE]":
            validator(document, json_data["contentSchema"]).validate(json.loads(data))
