"""One suffix cache for the fleet: a request on worker B drafts from what worker A generated, with one
suffix-cache replica or two (each holds the whole index, so drafts and acceptance are the same)."""

from __future__ import annotations

import asyncio
import json
import signal

import pytest

from shared.sampling_params import SamplingParams
from tests.mesh.harness import LocalMesh, metric_value
from tests.mesh.test_bus_recovery import bus_of, follow, request

SUFFIX = json.dumps({"method": "suffix", "num_speculative_tokens": 8, "adaptive": False})
FLAGS = (
    "--device",
    "cpu",
    "--max-model-len",
    "1024",
    "--speculative-config",
    SUFFIX,
    "--suffix-cache-deadline-ms",
    "200",
)


@pytest.mark.parametrize("num_replicas", [1, 2])
def test_worker_b_drafts_from_worker_a_output(mesh_factory, mesh_model, num_replicas: int) -> None:
    mesh: LocalMesh = mesh_factory("suffix")
    mesh.start_role("scheduler", "scheduler")
    replicas = [f"suffix-cache-{i}" for i in range(num_replicas)]
    for name in replicas:
        mesh.start_role(name, "suffix-cache")
    mesh.start_role("a", "mixed", "--model", mesh_model, "--instance-id", "a", *FLAGS)
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    prompt = "def parse_config(path):\n    "

    async def scenario() -> tuple[list[int], list[int], dict, str]:
        bus = await bus_of(mesh)
        try:
            return await run(bus)
        finally:
            await bus.client.aclose()

    async def run(bus) -> tuple[list[int], list[int], dict, str]:  # type: ignore[no-untyped-def]
        from shared.tokenizer import Tokenizer

        ids = Tokenizer(mesh_model).encode(prompt)
        await bus.publish(bus.keys.requests, request("on-a", ids, params))
        first, _ = await follow(bus, "on-a")
        mesh.kill("a", signal.SIGTERM)  # worker A leaves; B is the only place the next request can go
        mesh.start_role("b", "mixed", "--model", mesh_model, "--instance-id", "b", *FLAGS)
        await asyncio.sleep(1.5)
        await bus.publish(bus.keys.requests, request("on-b", ids, params))
        second, last = await follow(bus, "on-b")
        where = (await bus.client.hget(bus.keys.request_state("on-b"), "instances") or b"").decode()
        return first, second, last.spec_stats, where

    first, second, stats, where = asyncio.run(scenario())
    assert second == first
    assert where in ("", "b")
    assert stats["num_draft_tokens"] > 40
    assert stats["num_accepted_tokens"] > 0.9 * stats["num_draft_tokens"]
    assert stats["mean_accepted_length"] > 4
    for name in replicas:  # each replica holds A's output, whichever answered B's look-ups
        assert metric_value(mesh.metrics(name), "specmesh_suffix_cache_sequences") >= 1, name
