"""The gateway's HTTP layer over a scripted in-process mesh: shapes, streaming, fan-out, usage,
mesh errors, cancellation on disconnect, auth, health and metrics."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient
from gateway_fake_backend import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    REPLY,
    SPEC_STATS,
    ClientFactory,
    InProcessBackend,
    error_script,
    events_script,
    hanging_script,
    sse_data,
)

from services.gateway.prepare import ServedModel
from shared.tokenizer import Tokenizer

Client = TestClient[Any, Any]


async def post(client: Client, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    response = await client.post(path, json=body)
    if body.get("stream") and response.status == 200:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        return response.status, sse_data(await response.text())
    return response.status, await response.json()


def reply_ids(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode(REPLY, add_special_tokens=False)


# ---- completions -----------------------------------------------------------------------------------------


async def test_completion_has_openai_shape_text_and_usage(
    served: ServedModel, client: Client, backend: InProcessBackend
) -> None:
    status, body = await post(
        client, "/v1/completions", {"model": MODEL_NAME, "prompt": "def add(", "max_tokens": 200}
    )
    assert status == 200
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-") and len(body["id"]) == len("cmpl-") + 32
    assert body["model"] == MODEL_NAME and isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice == {
        "index": 0,
        "text": REPLY,
        "logprobs": None,
        "finish_reason": "stop",
        "stop_reason": None,
        "prompt_logprobs": None,
    }
    [request] = backend.submitted
    assert request.request_id == body["id"]
    assert body["usage"]["prompt_tokens"] == len(request.prompt_token_ids)
    assert body["usage"]["completion_tokens"] == len(reply_ids(served.tokenizer))
    assert (
        body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    )
    assert body["usage"]["speculative"] == {
        "num_draft_tokens": 12,
        "num_accepted_tokens": 7,
        "num_verify_steps": 5,
        "mean_accepted_length": (7 + 5) / 5,
    }


async def test_sampling_fields_reach_the_mesh(
    client: Client, backend: InProcessBackend, served: ServedModel
) -> None:
    body = {
        "prompt": "x = ",
        "max_tokens": 5,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "seed": 11,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "repetition_penalty": 1.1,
        "stop": "\n",
        "stop_token_ids": [0],
        "ignore_eos": True,
        "min_tokens": 2,
        "speculative": {"method": "ngram", "num_speculative_tokens": 3},
        "user": "someone",
        "some_unknown_field": {"is": "ignored"},
    }
    status, _ = await post(client, "/v1/completions", body)
    assert status == 200
    [request] = backend.submitted
    params = request.params
    assert request.prompt_token_ids == served.tokenizer.encode("x = ")
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.7, 0.9, 20, 0.05)
    assert (params.seed, params.max_tokens, params.min_tokens, params.ignore_eos) == (11, 5, 2, True)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, 0.25, 1.1)
    assert params.stop == ["\n"] and params.stop_token_ids == [0]
    assert params.speculative is not None
    assert (params.speculative.method, params.speculative.num_speculative_tokens) == ("ngram", 3)


async def test_integers_sent_as_floats_without_a_fraction_are_integers(
    client: Client, backend: InProcessBackend
) -> None:
    """JSON Schema's `integer` (and so /openapi.json) admits 3.0: the gateway takes it as 3."""
    body = {
        "prompt": [[1.0, 2.0], [3, 4.0]],
        "n": 2.0,
        "max_tokens": 3.0,
        "top_k": 5.0,
        "seed": 7.0,
        "min_tokens": 1.0,
        "logprobs": 2.0,
        "stop_token_ids": [0.0],
        "speculative": {"num_speculative_tokens": 2.0},
    }
    status, _ = await post(client, "/v1/completions", body)
    assert status == 200
    assert [r.prompt_token_ids for r in backend.submitted] == [[1, 2], [1, 2], [3, 4], [3, 4]]
    params = backend.submitted[0].params
    assert (params.max_tokens, params.top_k, params.seed, params.min_tokens, params.logprobs) == (
        3,
        5,
        7,
        1,
        2,
    )
    assert params.stop_token_ids == [0] and all(type(t) is int for t in params.stop_token_ids)
    assert params.speculative is not None and params.speculative.num_speculative_tokens == 2


async def test_default_max_tokens_is_the_rest_of_the_context(
    client: Client, backend: InProcessBackend
) -> None:
    status, _ = await post(
        client, "/v1/completions", {"prompt": [1, 2, 3, 4], "speculative": {"enabled": False}}
    )
    assert status == 200
    [request] = backend.submitted
    assert request.prompt_token_ids == [1, 2, 3, 4]
    assert request.params.max_tokens == MAX_MODEL_LEN - 4
    assert request.params.speculative is not None and not request.params.speculative.enabled


async def test_streamed_completion_concatenates_to_the_whole_text(client: Client) -> None:
    body = {"prompt": "def add(", "max_tokens": 200}
    _, whole = await post(client, "/v1/completions", body)
    status, chunks = await post(client, "/v1/completions", {**body, "stream": True})
    assert status == 200
    assert chunks[-1] == "[DONE]"
    chunks = chunks[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert all("usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"] == REPLY
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    assert all("\ufffd" not in c["choices"][0]["text"] for c in chunks)


async def test_stream_include_usage_ends_with_a_usage_chunk(client: Client) -> None:
    body = {"prompt": "def", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    status, chunks = await post(client, "/v1/completions", body)
    assert status == 200
    *token_chunks, usage_chunk, done = chunks
    assert done == "[DONE]"
    assert all(c["usage"] is None for c in token_chunks)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 4
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_text_deltas_pass_through_unsplit(client: Client, backend: InProcessBackend) -> None:
    """Workers send deltas cut at character boundaries (an empty one while a character is half
    done); the gateway passes them on as they are, never re-splitting a multi-byte character."""
    deltas = ["Hi ", "", "✓", "你好", "", "🙂 ok", "é"]
    backend.script = events_script(deltas)
    status, chunks = await post(client, "/v1/completions", {"prompt": "x", "stream": True, "max_tokens": 20})
    assert status == 200
    texts = [c["choices"][0]["text"] for c in chunks[:-1]]
    assert texts == [d for d in deltas if d]
    _, whole = await post(client, "/v1/completions", {"prompt": "x", "max_tokens": 20})
    assert whole["choices"][0]["text"] == "".join(deltas)


async def test_n_fans_out_with_consecutive_seeds_and_indexed_choices(
    client: Client, backend: InProcessBackend
) -> None:
    status, body = await post(
        client, "/v1/completions", {"prompt": "def", "max_tokens": 6, "n": 2, "seed": 7}
    )
    assert status == 200
    ids = [r.request_id for r in backend.submitted]
    assert sorted(ids) == [f"{body['id']}-0", f"{body['id']}-1"]
    assert {r.request_id: r.params.seed for r in backend.submitted} == {
        f"{body['id']}-0": 7,
        f"{body['id']}-1": 8,
    }
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 12
    assert body["usage"]["prompt_tokens"] == len(backend.submitted[0].prompt_token_ids)
    assert body["usage"]["speculative"]["num_draft_tokens"] == 2 * SPEC_STATS["num_draft_tokens"]


async def test_n_streams_each_choice_in_order(client: Client) -> None:
    status, chunks = await post(
        client, "/v1/completions", {"prompt": "def", "n": 3, "stream": True, "max_tokens": 200}
    )
    assert status == 200
    for index in range(3):
        text = "".join(c["choices"][0]["text"] for c in chunks[:-1] if c["choices"][0]["index"] == index)
        assert text == REPLY


async def test_batch_of_prompts_is_indexed_prompt_major(
    served: ServedModel, client: Client, backend: InProcessBackend
) -> None:
    status, body = await post(client, "/v1/completions", {"prompt": ["a", "bc"], "n": 2, "max_tokens": 3})
    assert status == 200
    assert len(body["choices"]) == 4
    by_id = {r.request_id: r.prompt_token_ids for r in backend.submitted}
    tokenizer = served.tokenizer
    assert by_id[f"{body['id']}-1"] == tokenizer.encode("a")
    assert by_id[f"{body['id']}-2"] == tokenizer.encode("bc")
    assert body["usage"]["prompt_tokens"] == len(tokenizer.encode("a")) + len(tokenizer.encode("bc"))


async def test_completion_logprobs(served: ServedModel, client: Client, backend: InProcessBackend) -> None:
    status, body = await post(client, "/v1/completions", {"prompt": "def", "max_tokens": 5, "logprobs": 2})
    assert status == 200
    logprobs = body["choices"][0]["logprobs"]
    tokenizer = served.tokenizer
    ids = reply_ids(tokenizer)[:5]
    assert logprobs["tokens"] == [tokenizer.token_to_text(t) for t in ids]
    assert len(logprobs["token_logprobs"]) == 5 and all(lp < 0 for lp in logprobs["token_logprobs"])
    assert all(len(top) == 2 for top in logprobs["top_logprobs"])
    offsets = [0]
    for token in logprobs["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs["text_offset"] == offsets
    assert backend.submitted[0].params.logprobs == 2
    _, chunks = await post(
        client, "/v1/completions", {"prompt": "def", "max_tokens": 5, "logprobs": 2, "stream": True}
    )
    streamed = [c["choices"][0]["logprobs"] for c in chunks[:-1]]
    assert sum((lp["text_offset"] for lp in streamed), []) == offsets


# ---- chat -------------------------------------------------------------------------------------------------


CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]}


async def test_chat_renders_the_template_and_answers_in_shape(
    served: ServedModel, client: Client, backend: InProcessBackend
) -> None:
    status, body = await post(client, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 200})
    assert status == 200
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": REPLY, "refusal": None, "tool_calls": []}
    assert choice["finish_reason"] == "stop"
    tokenizer = served.tokenizer
    rendered = "<|system|>Be brief.<|endoftext|><|user|>hi<|endoftext|><|assistant|>"
    assert backend.submitted[0].prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert backend.submitted[0].params.max_tokens == 200


async def test_chat_content_parts_are_joined(
    served: ServedModel, client: Client, backend: InProcessBackend
) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    status, _ = await post(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert status == 200
    tokenizer = served.tokenizer
    expected = tokenizer.encode("<|user|>hi<|endoftext|><|assistant|>", add_special_tokens=False)
    assert backend.submitted[0].prompt_token_ids == expected


async def test_chat_stream_opens_with_the_role_and_ends_with_usage(client: Client) -> None:
    body = {**CHAT, "stream": True, "max_tokens": 200, "stream_options": {"include_usage": True}}
    status, chunks = await post(client, "/v1/chat/completions", body)
    assert status == 200
    *content_chunks, usage_chunk, done = chunks
    assert done == "[DONE]"
    assert all(c["object"] == "chat.completion.chunk" for c in content_chunks + [usage_chunk])
    first = content_chunks[0]["choices"][0]
    assert first["delta"] == {"role": "assistant", "content": ""} and first["finish_reason"] is None
    assert all("role" not in c["choices"][0]["delta"] for c in content_chunks[1:])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in content_chunks) == REPLY
    assert content_chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["speculative"]["num_accepted_tokens"] == 7


async def test_chat_logprobs_have_tokens_bytes_and_alternatives(
    served: ServedModel, client: Client, backend: InProcessBackend
) -> None:
    body = {**CHAT, "max_tokens": 16, "logprobs": True, "top_logprobs": 3}
    status, response = await post(client, "/v1/chat/completions", body)
    assert status == 200
    content = response["choices"][0]["logprobs"]["content"]
    assert len(content) == 16
    assert all(len(entry["top_logprobs"]) == 3 for entry in content)
    # Byte-level BPE: the tokens' true bytes reassemble the text, split characters included.
    text = bytes(b for entry in content for b in entry["bytes"]).decode()
    assert text == served.tokenizer.decode(reply_ids(served.tokenizer)[:16])
    assert backend.submitted[0].params.logprobs == 3


# ---- errors from the mesh --------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_mesh_busy_is_http_429_with_retry_after(
    client: Client, backend: InProcessBackend, stream: bool
) -> None:
    backend.script = error_script(429, "queue is full (256 waiting)")
    response = await client.post("/v1/completions", json={"prompt": "x", "stream": stream})
    assert response.status == 429
    assert response.headers["Retry-After"] == "1"
    body = await response.json()
    assert body["error"]["message"] == "queue is full (256 waiting)"
    assert body["error"]["code"] == "rate_limit_exceeded"
    metrics = await (await client.get("/metrics")).text()
    assert "specmesh_gateway_rate_limited_total 1.0" in metrics


@pytest.mark.parametrize(("code", "status"), [(503, 503), (504, 504), (400, 400), (1, 500)])
async def test_mesh_error_codes_become_http_statuses(
    client: Client, backend: InProcessBackend, code: int, status: int
) -> None:
    backend.script = error_script(code, "nope")
    response = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3})
    assert response.status == status
    assert set((await response.json())["error"]) == {"message", "type", "param", "code"}


async def test_mesh_error_mid_stream_is_an_error_event(client: Client, backend: InProcessBackend) -> None:
    backend.script = error_script(500, "worker died", after=2)
    status, chunks = await post(client, "/v1/completions", {"prompt": "x", "stream": True, "max_tokens": 9})
    assert status == 200
    assert [c["choices"][0]["text"] for c in chunks[:2]] == ["A", "A"]
    assert chunks[2]["error"]["message"] == "worker died"
    assert len(chunks) == 3  # no [DONE] after a failure
    metrics = await (await client.get("/metrics")).text()
    assert 'specmesh_gateway_requests_total{endpoint="/v1/completions",status="500"} 1.0' in metrics


async def test_one_failed_choice_fails_the_request_and_cancels_the_others(
    client: Client, backend: InProcessBackend
) -> None:
    hang = hanging_script(1)
    fail = error_script(429)

    def script(request: Any) -> Any:
        return fail(request) if request.request_id.endswith("-1") else hang(request)

    backend.script = script
    response = await client.post("/v1/completions", json={"prompt": "x", "n": 2})
    assert response.status == 429
    await backend.wait_cancelled()
    assert [rid for rid, _ in backend.cancelled] == [backend.submitted[0].request_id]


async def test_no_live_worker_is_503_before_submitting(
    make_client: ClientFactory, backend: InProcessBackend
) -> None:
    backend.healthy = (False, "no worker has registered")
    client = await make_client()
    response = await client.post("/v1/completions", json={"prompt": "x"})
    assert response.status == 503
    assert "no worker has registered" in (await response.json())["error"]["message"]
    assert backend.submitted == []
    health = await client.get("/health")
    assert health.status == 503 and (await health.json())["reason"] == "no worker has registered"


async def test_internal_error_is_500_without_a_traceback(client: Client, backend: InProcessBackend) -> None:
    async def broken_health() -> tuple[bool, str]:
        raise RuntimeError("secret internals")

    backend.health = broken_health
    response = await client.post("/v1/completions", json={"prompt": "x"})
    assert response.status == 500
    text = await response.text()
    assert "secret internals" not in text and "Traceback" not in text
    assert (await response.json())["error"]["type"] == "server_error"


# ---- disconnects -----------------------------------------------------------------------------------------


async def test_client_disconnect_mid_stream_cancels_the_request(
    client: Client, backend: InProcessBackend
) -> None:
    backend.script = hanging_script(2)
    async with aiohttp.ClientSession() as session:
        response = await session.post(
            client.make_url("/v1/completions"), json={"prompt": "x", "stream": True}
        )
        assert response.status == 200
        assert (await response.content.readuntil(b"\n\n")).startswith(b"data: ")
        response.close()  # drop the connection mid-stream
    await backend.wait_cancelled()
    assert backend.cancelled == [(backend.submitted[0].request_id, "client disconnected")]


async def test_client_disconnect_while_waiting_cancels_the_request(
    client: Client, backend: InProcessBackend
) -> None:
    backend.script = hanging_script(0)
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(
            session.post(client.make_url("/v1/completions"), json={"prompt": "x", "n": 2})
        )
        while len(backend.submitted) < 2:
            await asyncio.sleep(0.01)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
    await backend.wait_cancelled()
    while len(backend.cancelled) < 2:
        await asyncio.sleep(0.01)
    assert sorted(rid for rid, _ in backend.cancelled) == sorted(r.request_id for r in backend.submitted)


# ---- models, health, metrics, auth -----------------------------------------------------------------------


async def test_models_lists_the_served_model(client: Client) -> None:
    response = await client.get("/v1/models")
    assert response.status == 200
    body = await response.json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert (card["id"], card["object"], card["max_model_len"]) == (MODEL_NAME, "model", MAX_MODEL_LEN)


async def test_health_and_metrics(client: Client) -> None:
    health = await client.get("/health")
    assert health.status == 200 and (await health.json())["status"] == "ok"
    await post(client, "/v1/completions", {"prompt": "def", "max_tokens": 4})
    await post(client, "/v1/chat/completions", {**CHAT, "max_tokens": 3, "stream": True})
    await client.get("/nope")
    metrics = await (await client.get("/metrics")).text()
    for line in (
        'specmesh_gateway_requests_total{endpoint="/v1/completions",status="200"} 1.0',
        'specmesh_gateway_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0',
        'specmesh_gateway_requests_total{endpoint="unmatched",status="404"} 1.0',
        "specmesh_gateway_completion_tokens_total 7.0",
        "specmesh_gateway_spec_draft_tokens_total 24.0",
        "specmesh_gateway_spec_accepted_tokens_total 14.0",
        "specmesh_gateway_time_to_first_token_seconds_count 2.0",
        "specmesh_gateway_e2e_request_latency_seconds_count 2.0",
        "specmesh_gateway_time_per_output_token_seconds_count 2.0",
        "specmesh_gateway_requests_in_flight 0.0",
    ):
        assert line in metrics, line


async def test_one_structured_log_line_per_request(client: Client, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="services.gateway.requests"):
        _, body = await post(client, "/v1/completions", {"prompt": "def", "max_tokens": 4})
        await client.get("/health")
    [record] = [r for r in caplog.records if r.name == "services.gateway.requests"]
    fields = record.__dict__
    assert (fields["request_id"], fields["endpoint"], fields["status"]) == (
        body["id"],
        "/v1/completions",
        200,
    )
    assert (fields["prompt_tokens"], fields["completion_tokens"]) == (body["usage"]["prompt_tokens"], 4)
    assert 0 < fields["ttft_ms"] <= fields["e2e_ms"]


async def test_api_keys_guard_v1_only(make_client: ClientFactory) -> None:
    client = await make_client(api_keys=frozenset({"k1", "k2"}))
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k1"}):
        response = await client.get("/v1/models", headers=headers)
        assert response.status == 401
        assert (await response.json())["error"]["code"] == "invalid_api_key"
    for key in ("k1", "k2"):
        assert (await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})).status == 200
    assert (await client.get("/health")).status == 200
    assert (await client.get("/metrics")).status == 200


async def test_backend_started_and_closed_with_the_app(
    make_client: ClientFactory, backend: InProcessBackend
) -> None:
    client = await make_client()
    assert backend.started and not backend.closed
    await client.close()
    assert backend.closed
