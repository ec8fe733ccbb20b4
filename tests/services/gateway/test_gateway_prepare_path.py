"""Where the gateway prepares a request: small bodies on the event loop, large ones and ones that
build a grammar on the prepare pool; both give the mesh the same requests and clients the same errors."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from gateway_fake_backend import MODEL_NAME, ClientFactory, InProcessBackend

from services.gateway.prepare import ServedModel

Client = TestClient[Any, Any]
INLINE_BYTES = 200
"""The small threshold of one test, so that a body above it still fits the tiny model's context."""
USER = [{"role": "user", "content": "Rename x to count."}]
BODIES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "def f(x):", "max_tokens": 3}),
    ("/v1/completions", {"prompt": ["a b", "c"], "n": 2, "seed": 7, "max_tokens": 2, "echo": True}),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 2.0}, "stop": ["\n"], "temperature": 0.5}),
    ("/v1/completions", {"prompt": "x", "guided_regex": "[ab]+", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 4, "top_p": 0.9}),
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 2, "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_object"}, "max_tokens": 2}),
    # bad input: each must get the same error on either path
    ("/v1/completions", {"prompt": "x", "temperature": -1}),
    ("/v1/completions", {"prompt": "", "max_tokens": 2}),
    ("/v1/completions", {"prompt": [10**9], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "x", "model": "other"}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}),
    ("/v1/completions", {"prompt": "x", "guided_regex": "(", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": "not a list"}),
]


async def _outcomes(client: Client, backend: InProcessBackend) -> list[tuple[int, Any, list[dict[str, Any]]]]:
    """Each body's status, response body (ids and timestamps left out) and the requests the mesh got."""
    outcomes = []
    for path, body in BODIES:
        backend.submitted.clear()
        response = await client.post(path, json=body)
        payload = await response.json()
        for key in ("id", "created"):
            payload.pop(key, None)
        submitted = [
            request.model_dump(exclude={"request_id", "arrival_time"}) for request in backend.submitted
        ]
        outcomes.append((response.status, payload, submitted))
    return outcomes


async def test_inline_and_pooled_prepare_give_the_same_requests_and_errors(
    make_client: ClientFactory, backend: InProcessBackend
) -> None:
    inline = await _outcomes(await make_client(inline_prepare_bytes=1 << 20), backend)
    pooled = await _outcomes(await make_client(inline_prepare_bytes=0), backend)
    assert inline == pooled
    statuses = [status for status, _, _ in inline]
    assert statuses.count(200) == 7 and all(400 <= status < 500 for status in statuses[7:]), statuses


@pytest.mark.parametrize(
    ("body", "pooled"),
    [
        ({"prompt": "def f(x):"}, False),
        ({"prompt": "def f(x): return x\n" * (INLINE_BYTES // 10)}, True),
        ({"prompt": "def f(x):", "guided_regex": "[ab]+"}, True),
    ],
    ids=["small", "large", "grammar"],
)
async def test_only_small_bodies_without_a_grammar_are_prepared_on_the_event_loop(
    make_client: ClientFactory,
    served: ServedModel,
    monkeypatch: pytest.MonkeyPatch,
    body: dict[str, Any],
    pooled: bool,
) -> None:
    encode = served.tokenizer.encode
    threads: list[str] = []

    def recording_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        threads.append(threading.current_thread().name)
        return encode(text, add_special_tokens)

    monkeypatch.setattr(served.tokenizer, "encode", recording_encode)
    client = await make_client(inline_prepare_bytes=INLINE_BYTES)
    response = await client.post("/v1/completions", json={"max_tokens": 2, **body})
    assert response.status == 200, await response.text()
    assert len(threads) == 1
    assert threads[0].startswith("prepare") == pooled, threads
