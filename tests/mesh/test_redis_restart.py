"""Redis SIGKILLed mid-stream and restarted on its port (from its append-only file): every stream
through the gateway either completes with the offline engine's greedy text or ends with an
explicit error. None ends normally with text missing or changed, and none hangs."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from services.engine.llm import LLM
from shared.sampling_params import SamplingParams
from tests.mesh.harness import LocalMesh, Outcome, stream_completion

WORKER_FLAGS = ("--device", "cpu", "--max-model-len", "512", "--no-suffix-cache")
PROMPTS = [f"def function_{i}(x, y):" for i in range(8)]
MAX_TOKENS = 96
STREAM_TIMEOUT_S = 45.0
"""Longer than any recovery should take: a stream still open then has hung."""


@pytest.fixture(scope="module")
def expected(mesh_model: str) -> dict[str, str]:
    llm = LLM(mesh_model, device="cpu", max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return {prompt: output.text for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, params))}


async def run_streams(mesh: LocalMesh, port: int, down_s: float) -> tuple[list[Outcome], int]:
    """The 8 streams, with Redis killed once each has some text; returns their outcomes and how
    many were still open when Redis died."""
    outcomes = [Outcome() for _ in PROMPTS]
    timeout = aiohttp.ClientTimeout(total=STREAM_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        url = f"http://127.0.0.1:{port}"
        tasks = [
            asyncio.create_task(stream_completion(session, url, p, MAX_TOKENS, o))
            for p, o in zip(PROMPTS, outcomes)
        ]
        deadline = time.monotonic() + STREAM_TIMEOUT_S
        while not all(o.text or o.error for o in outcomes) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        num_open = sum(not t.done() for t in tasks)
        await asyncio.to_thread(mesh.restart_redis, down_s)
        await asyncio.gather(*tasks)  # a hang raises aiohttp's timeout here
    return outcomes, num_open


@pytest.mark.parametrize("down_s", [1.0, 10.0])
def test_a_redis_restart_never_ends_a_stream_normally_with_text_missing(
    tmp_path_factory: pytest.TempPathFactory, mesh_model: str, expected: dict[str, str], down_s: float
) -> None:
    mesh = LocalMesh(tmp_path_factory.mktemp("redis-restart"))
    mesh.start_redis(appendonly=True)
    try:
        mesh.start_role("scheduler", "scheduler")
        mesh.start_role("w1", "mixed", "--model", mesh_model, "--instance-id", "w1", *WORKER_FLAGS)
        port = mesh.start_gateway(mesh_model, "--request-timeout-s", "30")
        started = time.monotonic()
        outcomes, num_open = asyncio.run(run_streams(mesh, port, down_s))
        took_s = time.monotonic() - started
    finally:
        mesh.stop()
    assert num_open > 0, "every stream ended before Redis died: the test tested nothing"
    for prompt, outcome in zip(PROMPTS, outcomes):
        assert outcome.done != (outcome.error is not None), f"{prompt!r}: {outcome}"
        if outcome.done:
            assert outcome.text == expected[prompt], f"{prompt!r} ended normally with other text"
    print(
        f"down {down_s} s: {sum(o.done for o in outcomes)} whole, errors {[o.error for o in outcomes if o.error]}, {took_s:.1f} s"
    )


async def streams_through_worker_and_redis_loss(mesh: LocalMesh, port: int, model: str) -> list[Outcome]:
    """The first streams, with their only worker SIGKILLed, then Redis restarted while the
    scheduler waits for a worker to re-dispatch to, then a new worker started."""
    prompts = PROMPTS[:4]
    outcomes = [Outcome() for _ in prompts]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        url = f"http://127.0.0.1:{port}"
        tasks = [
            asyncio.create_task(stream_completion(session, url, p, MAX_TOKENS, o))
            for p, o in zip(prompts, outcomes)
        ]
        deadline = time.monotonic() + STREAM_TIMEOUT_S
        while not all(o.text or o.error for o in outcomes) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        mesh.kill("w1")
        scheduler = mesh.processes["scheduler"]
        while "re-dispatching" not in scheduler.tail(100_000):
            assert time.monotonic() < deadline, scheduler.tail()
            await asyncio.sleep(0.1)
        await asyncio.to_thread(mesh.restart_redis, 2.0)
        flags = ("--model", model, "--instance-id", "w2", *WORKER_FLAGS)
        await asyncio.to_thread(mesh.start_role, "w2", "mixed", *flags)
        await asyncio.gather(*tasks)
    return outcomes


def test_requests_of_a_dead_worker_survive_a_redis_restart_while_they_wait_for_another(
    tmp_path_factory: pytest.TempPathFactory, mesh_model: str, expected: dict[str, str]
) -> None:
    """Nothing is pending on the bus for a dead instance's requests: the scheduler itself must
    wait out the outage, or they hang until the gateway's timeout."""
    mesh = LocalMesh(tmp_path_factory.mktemp("redispatch-outage"))
    mesh.start_redis(appendonly=True)
    try:
        mesh.start_role("scheduler", "scheduler", "--dispatch-timeout-s", "120")
        mesh.start_role("w1", "mixed", "--model", mesh_model, "--instance-id", "w1", *WORKER_FLAGS)
        port = mesh.start_gateway(mesh_model, "--request-timeout-s", "60")
        outcomes = asyncio.run(streams_through_worker_and_redis_loss(mesh, port, mesh_model))
    finally:
        mesh.stop()
    for prompt, outcome in zip(PROMPTS, outcomes):
        assert outcome.done and outcome.error is None, f"{prompt!r}: {outcome}"
        assert outcome.text == expected[prompt], f"{prompt!r} ended with other text"
