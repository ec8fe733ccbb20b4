"""No one request holds the gateway's event loop: an oversized body is refused before it is read
(413), a long prompt is tokenized off the loop, a body that does not arrive gets 408, an idle
connection is closed, and one API key's requests in flight are bounded (429)."""

from __future__ import annotations

import asyncio
import gc
import io
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from gateway_fake_backend import MAX_MODEL_LEN, ClientFactory, InProcessBackend, reply_script

from services.gateway.app import GatewaySettings, create_app
from services.gateway.limits import LINGERING_TIME_S, default_max_body_bytes
from services.gateway.prepare import ServedModel

Client = TestClient[Any, Any]

FIFTY_MB = 50 * 2**20
SMALL = {"prompt": "def add(", "max_tokens": 3}
LATENCY_BOUND_S = 0.1
"""What a small request may take while a 50 MB body is refused (measured: 2-4 ms; the whole 54 s
before the body was bounded): generous, for two loaded cores running client and server."""
TOKENIZING_LATENCY_BOUND_S = 0.25
"""... while a 1 MB prompt is tokenized on the prepare pool (measured: 12-15 ms)."""


async def small_request_latencies(client: Client, stop: asyncio.Event) -> list[float]:
    """Latencies of small completions sent one after another until `stop`."""
    latencies = []
    while not stop.is_set():
        started = time.perf_counter()
        response = await client.post("/v1/completions", json=SMALL)
        assert response.status == 200, await response.text()
        await response.read()
        latencies.append(time.perf_counter() - started)
    return latencies


async def while_probed(client: Client, big: Any) -> tuple[Any, list[float]]:
    """Runs `big` while small requests go; returns its result and their latencies. The objects this
    test process holds (torch and transformers, from the checkpoint fixture; the gateway never imports
    them) are frozen first: a full collection over them takes about 200 ms here."""
    gc.freeze()
    stop = asyncio.Event()
    probe = asyncio.create_task(small_request_latencies(client, stop))
    await asyncio.sleep(0.05)
    try:
        result = await big
    finally:
        stop.set()
        gc.unfreeze()
    return result, await probe


async def post_status(client: Client, data: Any) -> tuple[int, dict[str, Any], float]:
    started = time.perf_counter()
    response = await client.post("/v1/completions", data=data, headers={"Content-Type": "application/json"})
    return response.status, await response.json(), time.perf_counter() - started


async def test_fifty_mb_body_is_413_fast_and_small_requests_stay_fast(client: Client) -> None:
    body = io.BytesIO(b'{"prompt": "' + b"x" * FIFTY_MB + b'"}')
    (status, answer, elapsed_s), latencies = await while_probed(client, post_status(client, body))
    assert status == 413
    assert answer["error"]["code"] == "request_too_large"
    assert f"body limit of {default_max_body_bytes(MAX_MODEL_LEN)} bytes" in answer["error"]["message"]
    assert elapsed_s < 5.0  # the client still sends its 50 MB, which the server drops unread
    assert latencies and max(latencies) < LATENCY_BOUND_S, latencies


async def test_chunked_fifty_mb_body_is_413_once_the_limit_is_read(client: Client) -> None:
    chunk = b"x" * 2**16

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(FIFTY_MB // len(chunk)):
            yield chunk
            await asyncio.sleep(
                0
            )  # the client shares the server's loop: a write that never waits never yields

    (status, answer, _), latencies = await while_probed(client, post_status(client, chunks()))
    assert status == 413 and "more than" in answer["error"]["message"]
    assert latencies and max(latencies) < LATENCY_BOUND_S, latencies


async def test_long_prompt_is_tokenized_off_the_event_loop(client: Client) -> None:
    """A prompt that just fits the body limit (~1 M tokens of the byte-level tokenizer) gets its 400
    for the context; meanwhile small requests go on."""
    prompt = "def add(a, b):\n    return a + b\n" * (default_max_body_bytes(MAX_MODEL_LEN) // 40)
    body = json.dumps({"prompt": prompt}).encode()
    assert len(body) < default_max_body_bytes(MAX_MODEL_LEN)
    (status, answer, _), latencies = await while_probed(client, post_status(client, io.BytesIO(body)))
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
    assert latencies and max(latencies) < TOKENIZING_LATENCY_BOUND_S, latencies


async def test_half_sent_body_gets_408_and_its_connection_closed(make_client: ClientFactory) -> None:
    client = await make_client(body_timeout_s=0.5)
    assert client.port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    started = time.perf_counter()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"prompt": "'
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
    assert head.startswith(b"HTTP/1.1 408 "), head
    assert 0.5 <= time.perf_counter() - started < 3.0
    assert b"Connection: close" in head
    rest = await asyncio.wait_for(reader.read(), LINGERING_TIME_S + 5.0)  # then end of file
    error = json.loads(rest)["error"]
    assert error["code"] == "request_timeout" and "body timeout of 0.5 s (12 bytes came)" in error["message"]
    assert reader.at_eof()
    writer.close()


async def test_idle_connection_is_closed(served: ServedModel, backend: InProcessBackend) -> None:
    server = TestServer(create_app(served, backend))
    await server.start_server(keepalive_timeout=0.5)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers that never finish
        assert await asyncio.wait_for(reader.read(), 5.0) == b""
        writer.close()
    finally:
        await server.close()


async def test_concurrent_requests_per_key_are_bounded(
    make_client: ClientFactory, served: ServedModel, backend: InProcessBackend
) -> None:
    backend.script = reply_script(served.tokenizer, delay_s=0.05)  # each request takes about a second
    client = await make_client(api_keys=frozenset({"k1", "k2"}), max_concurrent_per_key=1)

    async def complete(key: str) -> tuple[int, Any, str | None]:
        body = {"prompt": "def add(", "max_tokens": 64}
        response = await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        return response.status, await response.json(), response.headers.get("Retry-After")

    first = asyncio.create_task(complete("k1"))
    while not backend.submitted:
        await asyncio.sleep(0.01)
    status, answer, retry_after = await complete("k1")
    assert (status, retry_after) == (429, "1")
    assert answer["error"]["code"] == "rate_limit_exceeded"
    assert "1 requests in flight, the limit per key (1)" in answer["error"]["message"]
    assert (await complete("k2"))[0] == 200  # another key has its own
    assert (await first)[0] == 200
    assert (await complete("k1"))[0] == 200  # its slot came back


def test_settings_default_body_limit_follows_the_context(
    served: ServedModel, backend: InProcessBackend
) -> None:
    assert create_app(served, backend)._client_max_size == 16 * MAX_MODEL_LEN + 2**20
    assert create_app(served, backend, GatewaySettings(max_body_bytes=1000))._client_max_size == 1000
