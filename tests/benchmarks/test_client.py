"""The load generator: Poisson arrivals, the concurrency cap, and SSE parsing against a fake gateway."""

from __future__ import annotations

import asyncio
import functools
import json
import statistics
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from benchmarks.client import CompletionClient, Sampling, arrival_offsets, drive
from benchmarks.dataset import BenchRequest
from benchmarks.metrics import RequestRecord

REQUESTS = [BenchRequest(f"r{i}", "w", f"prompt {i}", 4) for i in range(12)]


def test_poisson_arrivals_have_the_requested_rate() -> None:
    offsets = arrival_offsets(4000, request_rate=8.0, seed=1)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(1 / 8.0, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 8.0, rel=0.08)  # exponential: stdev == mean
    assert arrival_offsets(4000, 8.0, seed=1) == offsets
    assert arrival_offsets(3, None) == [0.0, 0.0, 0.0]


async def test_drive_never_exceeds_the_concurrency() -> None:
    in_flight, peak = 0, 0

    async def send(request: BenchRequest) -> RequestRecord:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return RequestRecord(request.id, request.workload, arrived_at=0.0)

    records = await drive(REQUESTS, send, concurrency=3, request_rate=None)
    assert [r.request_id for r in records] == [r.id for r in REQUESTS]
    assert peak == 3


def chunk(text: str) -> dict:
    return {
        "id": "c",
        "object": "text_completion",
        "choices": [{"index": 0, "text": text, "finish_reason": None}],
    }


USAGE = {
    "prompt_tokens": 7,
    "completion_tokens": 5,
    "total_tokens": 12,
    "speculative": {
        "num_draft_tokens": 6,
        "num_accepted_tokens": 3,
        "num_verify_steps": 2,
        "mean_accepted_length": 2.5,
    },
}


@pytest.fixture
async def fake_gateway() -> AsyncIterator[tuple[str, list[dict]]]:
    """Streams three text chunks (one empty), a usage chunk and [DONE]; 400 for prompt 'bad'."""
    bodies: list[dict] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        if body["prompt"] == "bad":
            return web.json_response({"error": {"message": "nope"}}, status=400)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in (chunk("de"), chunk(""), chunk("f f(x):"), {"choices": [], "usage": USAGE}):
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            await asyncio.sleep(0.01)
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}", bodies
    await runner.cleanup()


async def test_client_stamps_chunks_and_reads_usage(fake_gateway: tuple[str, list[dict]]) -> None:
    url, bodies = fake_gateway
    async with aiohttp.ClientSession() as session:
        client = CompletionClient(session, url, Sampling(ignore_eos=True), speculative={"method": "ngram"})
        record = await client.send(BenchRequest("a", "w", "def", 5))
        failed = await client.send(BenchRequest("b", "w", "bad", 5))
    assert record.ok and len(record.token_times) == 2  # the empty chunk carries no token
    assert record.arrived_at < record.token_times[0] <= record.token_times[1] <= record.finished_at  # type: ignore[operator]
    assert (record.num_prompt_tokens, record.num_output_tokens) == (7, 5)
    assert (record.spec.num_draft_tokens, record.spec.num_accepted_tokens, record.spec.num_verify_steps) == (
        6,
        3,
        2,
    )
    assert bodies[0]["stream"] is True and bodies[0]["stream_options"] == {"include_usage": True}
    assert bodies[0]["speculative"] == {"method": "ngram"} and bodies[0]["ignore_eos"] is True
    assert not failed.ok and failed.error is not None and failed.error.startswith("HTTP 400")


START_DELAY_S = 3.0
"""Client processes start sending this long after they are spawned (they import torch on the way)."""


@pytest.mark.slow
async def test_client_processes_split_the_requests_and_the_concurrency(
    fake_gateway: tuple[str, list[dict]],
) -> None:
    from benchmarks import serving

    url, bodies = fake_gateway
    requests = [BenchRequest(f"r{i}", "w", f"prompt {i}", 4) for i in range(9)]
    spawned_at = time.perf_counter()
    started_at: list[float] = []
    records, cpu_s = await asyncio.to_thread(
        functools.partial(
            serving.run_clients,
            url,
            requests,
            Sampling(),
            4,
            None,
            0,
            num_processes=3,
            on_start=lambda: started_at.append(time.perf_counter()),
            start_delay_s=START_DELAY_S,
        )
    )
    assert [r.request_id for r in records] == [r.id for r in requests]
    assert all(r.ok and r.num_output_tokens == 5 for r in records)
    assert sorted(b["prompt"] for b in bodies) == sorted(r.prompt for r in requests)
    assert cpu_s > 0
    # the run's window opens as the requests start, not while the client processes start up
    [started] = started_at
    assert started - spawned_at >= START_DELAY_S
    assert started <= min(r.arrived_at for r in records) + 0.05
