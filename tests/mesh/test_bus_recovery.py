"""The mesh heals: a worker killed mid-stream, a malformed message, a full queue."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.engine.llm import LLM
from shared.bus import Bus, connect
from shared.protocol import PAYLOAD_FIELD, GenerateRequest, OutputBatch, Submit, TokenEvent
from shared.sampling_params import SamplingParams
from tests.mesh.harness import LocalMesh

WORKER_FLAGS = ("--device", "cpu", "--max-model-len", "512", "--no-suffix-cache")
GATEWAY = "test-gateway"
"""The gateway id the tests submit as: outputs arrive on its output stream."""


def request(request_id: str, prompt: list[int], params: SamplingParams) -> Submit:
    return Submit(
        request=GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt, params=params, gateway_id=GATEWAY
        )
    )


async def follow(
    bus: Bus, request_id: str, timeout_s: float = 120.0, on_tokens=None
) -> tuple[list[int], TokenEvent]:  # type: ignore[no-untyped-def]
    """Reads the test gateway's output stream until the request ends; returns all its tokens and
    its last event."""
    tokens: list[int] = []
    last_id, deadline = "0-0", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        deliveries, last_id = await bus.read_stream(bus.keys.outputs(GATEWAY), last_id, block_ms=200)
        for delivery in deliveries:
            assert isinstance(delivery.message, OutputBatch)
            for event in delivery.message.events():
                if event.request_id != request_id:
                    continue
                tokens += event.token_ids
                if on_tokens is not None:
                    await on_tokens(tokens)
                if event.finished:
                    return tokens, event
    raise TimeoutError(f"{request_id} did not finish; got {len(tokens)} tokens")


async def bus_of(mesh: LocalMesh) -> Bus:
    settings = mesh.settings()
    return Bus(await connect(settings), settings.keys)


def test_killed_worker_request_resumes_on_another_with_the_same_output(mesh_factory, mesh_model) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    prompt = list(range(10, 40))
    expected = (
        LLM(mesh_model, device="cpu", max_model_len=512)
        .generate(prompt_token_ids=[prompt], sampling_params=params)[0]
        .token_ids
    )
    mesh: LocalMesh = mesh_factory("recovery")
    mesh.start_role("scheduler", "scheduler")
    mesh.start_role("w1", "mixed", "--model", mesh_model, "--instance-id", "w1", *WORKER_FLAGS)
    mesh.start_role("w2", "mixed", "--model", mesh_model, "--instance-id", "w2", *WORKER_FLAGS)

    async def scenario() -> tuple[list[int], TokenEvent, str]:
        bus = await bus_of(mesh)
        await asyncio.sleep(1.0)  # both heartbeats registered
        await bus.publish(bus.keys.requests, request("long", prompt, params))
        victim: list[str] = []

        async def kill_after_some_tokens(tokens: list[int]) -> None:
            if not victim and len(tokens) >= 20:
                raw = await bus.client.hget(bus.keys.request_state("long"), "instances")
                victim.append(raw.decode())
                mesh.kill(victim[0])

        tokens, last = await follow(bus, "long", on_tokens=kill_after_some_tokens)
        await bus.client.aclose()
        return tokens, last, victim[0]

    tokens, last, victim = asyncio.run(scenario())
    assert last.error is None and last.finish_reason == "length"
    assert tokens == expected
    survivor = "w2" if victim == "w1" else "w1"
    assert mesh.processes[survivor].alive()


def test_malformed_message_is_dead_lettered_and_service_goes_on(mesh_factory, mesh_model) -> None:
    mesh: LocalMesh = mesh_factory("deadletter")
    mesh.start_role("scheduler", "scheduler")
    mesh.start_role("w1", "mixed", "--model", mesh_model, *WORKER_FLAGS)

    async def scenario() -> tuple[list, list[int]]:
        bus = await bus_of(mesh)
        await bus.client.xadd(bus.keys.requests, {PAYLOAD_FIELD: b"\x93not-a-map"})
        await bus.client.xadd(bus.keys.requests, {b"other": b"field"})
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        await bus.publish(bus.keys.requests, request("ok", [5, 6, 7], params))
        tokens, _ = await follow(bus, "ok")
        dead = await bus.client.xrange(bus.keys.dead_letters)
        await bus.client.aclose()
        return dead, tokens

    dead, tokens = asyncio.run(scenario())
    assert len(tokens) == 5
    reasons = [fields[b"reason"].decode() for _, fields in dead]
    assert (
        len(reasons) == 2
        and any("msgpack" in r or "map" in r for r in reasons)
        and any("field" in r for r in reasons)
    )
    assert all(process.alive() for process in mesh.processes.values())


def test_full_queue_answers_429(mesh_factory, mesh_model) -> None:
    mesh: LocalMesh = mesh_factory("backpressure")
    mesh.start_role("scheduler", "scheduler", "--max-queue-len", "2")
    mesh.start_role("w1", "mixed", "--model", mesh_model, *WORKER_FLAGS)

    async def scenario() -> list[TokenEvent]:
        bus = await bus_of(mesh)
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        for i in range(6):
            await bus.publish(bus.keys.requests, request(f"r{i}", [5, 6, 7 + i], params))
        results = [await follow(bus, f"r{i}") for i in range(6)]
        await bus.client.aclose()
        return [last for _, last in results]

    finals = asyncio.run(scenario())
    rejected = [e for e in finals if e.error is not None]
    assert rejected and all(e.error.code == 429 for e in rejected)
    assert sum(e.finish_reason == "length" for e in finals) >= 2


@pytest.mark.parametrize("role_flags", [()], ids=["default"])
def test_cancel_frees_the_blocks(mesh_factory, mesh_model, role_flags) -> None:
    """A cancelled request stops at once: its blocks are freed, and nothing more of it reaches its
    gateway's stream (the scheduler ends it, which fences off the worker's last rows)."""
    from shared.protocol import Cancel
    from tests.mesh.harness import metric_value

    mesh: LocalMesh = mesh_factory("cancel")
    mesh.start_role("scheduler", "scheduler")
    mesh.start_role("w1", "mixed", "--model", mesh_model, "--num-kv-blocks", "64", *WORKER_FLAGS, *role_flags)

    async def scenario() -> tuple[float, float, dict]:
        bus = await bus_of(mesh)
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        await bus.publish(bus.keys.requests, request("c", list(range(5, 100)), params))
        deadline = time.monotonic() + 120
        while len((await bus.delivered_tokens("c"))[0]) < 10:
            assert time.monotonic() < deadline, "the request never got going"
            await asyncio.sleep(0.05)
        during = metric_value(mesh.metrics("w1"), "specmesh_worker_kv_free_blocks")
        await bus.publish(bus.keys.requests, Cancel(request_id="c"))
        deadline = time.monotonic() + 30
        while (after := metric_value(mesh.metrics("w1"), "specmesh_worker_kv_free_blocks")) < 64:
            assert time.monotonic() < deadline, f"{after} of 64 blocks free 30 s after the cancel"
            await asyncio.sleep(0.1)
        state = await bus.client.hgetall(bus.keys.request_state("c"))
        await bus.client.aclose()
        return during, after, state

    during, after, state = asyncio.run(scenario())
    assert during < 64 and after == 64
    assert state == {b"ended": b"1"}
