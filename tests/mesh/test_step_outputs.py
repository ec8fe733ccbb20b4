"""A real mixed worker: a step's outputs for 64 requests reach their gateway as one bus message,
and the worker's engine runs in a process of its own that exits with it."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

from shared.bus import Bus
from shared.protocol import OutputBatch
from shared.sampling_params import SamplingParams
from tests.mesh.harness import LocalMesh, child_pid, pid_alive
from tests.mesh.test_bus_recovery import GATEWAY, WORKER_FLAGS, bus_of, request

NUM_REQUESTS = 64
MAX_TOKENS = 24  # long enough that requests admitted over a few steps all run together


async def read_batches(bus: Bus, num_ended: int, timeout_s: float = 120.0) -> list[OutputBatch]:
    """The test gateway's stream until `num_ended` requests ended."""
    batches: list[OutputBatch] = []
    last_id, deadline, ended = "0-0", time.monotonic() + timeout_s, 0
    while ended < num_ended:
        assert time.monotonic() < deadline, f"{ended} of {num_ended} requests ended"
        deliveries, last_id = await bus.read_stream(bus.keys.outputs(GATEWAY), last_id, block_ms=200)
        for delivery in deliveries:
            assert isinstance(delivery.message, OutputBatch)
            batches.append(delivery.message)
            ended += len(delivery.message.ends)
    return batches


def test_a_step_of_64_requests_reaches_the_gateway_in_one_message(mesh_factory: Any, mesh_model: str) -> None:
    mesh: LocalMesh = mesh_factory("step-outputs")
    mesh.start_role("scheduler", "scheduler")
    mesh.start_role("w1", "mixed", "--model", mesh_model, "--instance-id", "w1", *WORKER_FLAGS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def scenario() -> list[OutputBatch]:
        bus = await bus_of(mesh)
        await asyncio.sleep(1.0)  # the worker's heartbeat registered
        ids = [f"r{i}" for i in range(NUM_REQUESTS)]
        for i, request_id in enumerate(ids):
            await bus.publish(bus.keys.requests, request(request_id, [5, 6, 7 + i], params))
        batches = await read_batches(bus, NUM_REQUESTS)
        await bus.client.aclose()
        return batches

    batches = asyncio.run(scenario())
    tokens: dict[str, list[int]] = {}
    for batch in batches:
        for event in batch.events():
            tokens.setdefault(event.request_id, []).extend(event.token_ids)
    assert len(tokens) == NUM_REQUESTS and all(len(t) == MAX_TOKENS for t in tokens.values())
    full = [b for b in batches if len(set(b.request_ids)) == NUM_REQUESTS]
    assert full, f"rows per message: {[len(b.request_ids) for b in batches]}"
    assert len(batches) <= 2 * MAX_TOKENS  # about one message a step, not one a request


def test_sigterm_drains_and_the_engine_core_exits_with_its_worker(mesh_factory: Any, mesh_model: str) -> None:
    from tests.mesh.test_bus_recovery import follow

    mesh: LocalMesh = mesh_factory("drain")
    mesh.start_role("scheduler", "scheduler")
    worker = mesh.start_role("w1", "mixed", "--model", mesh_model, "--instance-id", "w1", *WORKER_FLAGS)
    core_pid = child_pid(worker.popen.pid, "engine-core")
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)

    async def scenario() -> tuple[list[int], Any]:
        bus = await bus_of(mesh)
        await asyncio.sleep(1.0)
        await bus.publish(bus.keys.requests, request("draining", [5, 6, 7], params))

        async def stop_after_first(tokens: list[int]) -> None:
            if worker.alive() and len(tokens) == 1:
                worker.popen.send_signal(signal.SIGTERM)

        result = await follow(bus, "draining", on_tokens=stop_after_first)
        await bus.client.aclose()
        return result

    tokens, last = asyncio.run(scenario())
    assert len(tokens) == 60 and last.finish_reason == "length"  # finished during the drain
    assert worker.popen.wait(timeout=60) == 0
    assert not pid_alive(core_pid)
