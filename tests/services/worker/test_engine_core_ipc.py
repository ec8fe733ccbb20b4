"""Shared KV between two engine-core processes: a prefill core gathers a request's KV into a shared
buffer and hands out only its handle; a decode core opens it, copies it into its reserved blocks and
continues the offline run's tokens exactly. The buffer lives until released, or until its deadline
when nobody releases it; a host copy is there for a decode side that could not open it; a file left
by a killed core is removed by the next one."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from services.engine.kv_export import KVExport
from services.engine.llm import LLM
from services.kv_transport.ipc_buffer import SHM_DIR, SHM_PREFIX, SharedBuffers, open_shared, remove_orphans
from services.worker.core_client import EngineCoreClient
from services.worker.core_messages import CoreOptions
from shared.config import EngineConfig
from shared.protocol import GenerateRequest
from shared.sampling_params import SamplingParams
from tests.services.worker.test_engine_core import run_to_end

PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14], [7] * 20]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def request(request_id: str, prompt: list[int]) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, prompt_token_ids=prompt, params=GREEDY, gateway_id="g")


@pytest.fixture(scope="module")
def model(make_checkpoint: Any) -> str:
    return str(make_checkpoint("llama"))


async def start_prefill(model: str, share_timeout_s: float = 120.0) -> EngineCoreClient:
    return await EngineCoreClient.start(
        CoreOptions(EngineConfig(model=model, device="cpu"), share_kv=True, share_timeout_s=share_timeout_s)
    )


@pytest.fixture
async def prefill(model: str) -> AsyncIterator[EngineCoreClient]:
    client = await start_prefill(model)
    yield client
    await client.shutdown()


async def exports(core: EngineCoreClient, count: int) -> list[KVExport]:
    found: list[KVExport] = []
    while len(found) < count:
        for batch in await asyncio.wait_for(core.next_batches(), 60):
            found += batch.handoffs
    return found


def shm_path(export: KVExport) -> str:
    assert export.shared is not None
    return os.path.join(SHM_DIR, export.shared.caches[0].region.name)  # type: ignore[union-attr]


async def test_kv_shared_between_two_cores_continues_the_same_tokens(
    prefill: EngineCoreClient, model: str
) -> None:
    expected = LLM(model, device="cpu").generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    decode = await EngineCoreClient.start(CoreOptions(EngineConfig(model=model, device="cpu", block_size=4)))
    try:
        for i, prompt in enumerate(PROMPTS):
            assert (await (await decode.reserve(request(f"r{i}", prompt), epoch=1))).error is None
            await prefill.add_request(request(f"r{i}", prompt), epoch=1, handoff=True)
        paths = []
        for export in await exports(prefill, len(PROMPTS)):
            assert export.shared is not None and export.layers == []  # only the handle crossed
            paths.append(shm_path(export))
            assert os.path.exists(shm_path(export))
            reply = await (await decode.import_shared(export.request_id, export.shared))
            assert reply.error is None, reply.error
            await decode.activate(export.request_id, export.first_token_id)
            await prefill.release_kv(export.request_id)
        tokens, ends, _ = await run_to_end(decode, len(PROMPTS))
    finally:
        await decode.shutdown()
    for i, want in enumerate(expected):
        assert want.token_ids[:1] + tokens[f"r{i}"] == want.token_ids
    assert {e.finish_reason for e in ends.values()} == {"length"}
    deadline = time.monotonic() + 10
    while any(os.path.exists(path) for path in paths) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not any(os.path.exists(path) for path in paths)  # released


async def test_a_released_buffer_leaves_dev_shm_and_a_held_one_has_a_host_copy(
    prefill: EngineCoreClient,
) -> None:
    await prefill.add_request(request("r", PROMPTS[1]), epoch=1, handoff=True)
    (export,) = await exports(prefill, 1)
    assert export.shared is not None
    caches, _ = open_shared(export.shared)
    copy = (await (await prefill.fetch_kv("r"))).export
    assert copy is not None
    for cache, index, key, value in copy.layers:
        assert torch.equal(key, caches[cache][index, 0]) and torch.equal(value, caches[cache][index, 1])
    await prefill.release_kv("r")
    reply = await (await prefill.fetch_kv("r"))  # answered after the release: in order
    assert reply.export is None and reply.error is not None and "no shared KV" in reply.error.message
    assert not os.path.exists(shm_path(export))
    late = await (await prefill.import_shared("r", export.shared))  # a decode core opening it now
    assert late.error is not None and "does not exist" in late.error.message


async def test_a_buffer_nobody_releases_is_freed_at_its_deadline(model: str) -> None:
    prefill = await start_prefill(model, share_timeout_s=1.0)
    try:
        await prefill.add_request(request("r", PROMPTS[0]), epoch=1, handoff=True)
        (export,) = await exports(prefill, 1)
        assert os.path.exists(shm_path(export))
        deadline = time.monotonic() + 20
        while os.path.exists(shm_path(export)) and time.monotonic() < deadline:  # the core is idle meanwhile
            await asyncio.sleep(0.1)
        assert not os.path.exists(shm_path(export))
        reply = await (await prefill.fetch_kv("r"))
        assert reply.error is not None and "expired" in reply.error.message
    finally:
        await prefill.shutdown()


def test_files_of_a_dead_core_are_removed_and_a_live_ones_kept() -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    orphan = os.path.join(SHM_DIR, f"{SHM_PREFIX}{dead_pid}-{'0' * 16}")
    with open(orphan, "wb") as file:
        file.write(b"kv")
    buffers = SharedBuffers(torch.device("cpu"))
    ours = buffers.allocate(16)
    try:
        assert not os.path.exists(orphan)
        assert buffers.share("r", ours, {}, {}) is not None
        assert remove_orphans() == []
        assert len([n for n in os.listdir(SHM_DIR) if n.startswith(f"{SHM_PREFIX}{os.getpid()}-")]) == 1
    finally:
        buffers.close()
