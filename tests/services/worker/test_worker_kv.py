"""A decode worker's side of the KV hand-off, over a real TCP transport and a real Redis: a whole
transfer reaches the core as one import command (every layer, as sent) before its activation; a
transfer that fails or is cancelled part-way reaches the core not at all, and the worker keeps none
of its layers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from services.kv_transport import KVHeader, KVTransferError, TcpKVTransport
from services.kv_transport.base import LayerShape
from services.worker.core_messages import EngineInfo, EngineLoad
from services.worker.metrics import WorkerMetrics
from services.worker.worker import Running, Worker, WorkerOptions
from shared.bus import Bus
from shared.protocol import GenerateRequest
from shared.sampling_params import SamplingParams

SHAPE = (3, 4, 2, 8)  # [num_blocks, block_size, num_kv_heads, head_dim]
NUM_LAYERS = 4


class RecordingCore:
    """Stands in for the engine core: records the KV commands the worker sends it."""

    info = EngineInfo(max_model_len=512, total_kv_blocks=64, block_size=4)
    load = EngineLoad()

    def __init__(self) -> None:
        self.commands: list[tuple[Any, ...]] = []

    async def import_kv(
        self, request_id: str, layers: list[tuple[str, int, torch.Tensor, torch.Tensor]]
    ) -> None:
        self.commands.append(("import_kv", request_id, layers))

    async def activate(self, request_id: str, first_token_id: int) -> None:
        self.commands.append(("activate", request_id, first_token_id))

    async def abort(self, request_id: str, emit: bool = True) -> None:
        self.commands.append(("abort", request_id, emit))


@pytest.fixture
async def decode_worker(bus: Bus) -> Any:
    options = WorkerOptions(instance_id="d", role="decode", model_name="m", ttl_s=5.0)
    worker = Worker(RecordingCore(), bus, options, WorkerMetrics("d", "decode"))  # type: ignore[arg-type]
    worker.transport = TcpKVTransport()
    address = await worker.transport.start("127.0.0.1", 0, advertise_host="127.0.0.1")
    sender = TcpKVTransport()
    yield worker, address, sender
    await sender.close()
    await worker.transport.close()


def expect(worker: Worker, request_id: str) -> None:
    request = GenerateRequest(
        request_id=request_id, prompt_token_ids=[1] * 12, params=SamplingParams(), gateway_id="g"
    )
    worker.requests[request_id] = Running(request, 1)
    assert worker.transport is not None
    worker.transport.expect(
        request_id,
        on_layer=worker._on_kv_layer,
        on_done=worker._on_kv_done,
        on_error=lambda error: worker._on_kv_error(request_id, 1, error),
        timeout_s=30,
    )


def header(request_id: str) -> KVHeader:
    layers = [LayerShape(cache="target", index=i, shape=SHAPE) for i in range(NUM_LAYERS)]
    return KVHeader(request_id=request_id, num_tokens=12, block_size=4, dtype="float32", layer_shapes=layers)


def layers(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(SHAPE, generator=generator), torch.randn(SHAPE, generator=generator))
        for _ in range(NUM_LAYERS)
    ]


async def wait_for(condition: Any) -> None:
    async with asyncio.timeout(20):
        while not condition():
            await asyncio.sleep(0.01)


async def test_a_whole_transfer_reaches_the_core_as_one_command_then_its_activation(decode_worker) -> None:
    worker, address, sender = decode_worker
    expect(worker, "r")
    sent = layers(1)
    session = await sender.open(address, header("r"))
    for index in (2, 0, 3, 1):  # any order
        await session.send_layer("target", index, *sent[index])
    await session.close(extras={"first_token_id": 77})
    commands = worker.core.commands
    assert [command[0] for command in commands] == ["import_kv", "activate"]
    (_, request_id, received), activation = commands
    assert request_id == "r" and activation == ("activate", "r", 77)
    assert [(cache, index) for cache, index, _, _ in received] == [("target", i) for i in (2, 0, 3, 1)]
    for _, index, key, value in received:
        assert torch.equal(key, sent[index][0]) and torch.equal(value, sent[index][1])
    assert worker.received_kv == {}


async def test_a_transfer_aborted_part_way_reaches_the_core_not_at_all(decode_worker) -> None:
    worker, address, sender = decode_worker
    expect(worker, "r")
    session = await sender.open(address, header("r"))
    for index, (key, value) in enumerate(layers(2)[:2]):
        await session.send_layer("target", index, key, value)
    await wait_for(lambda: len(worker.received_kv.get("r", [])) == 2)
    await session.abort("prefill worker died")
    await wait_for(lambda: worker.core.commands)
    assert worker.core.commands == [("abort", "r", False)]
    assert worker.received_kv == {} and "r" not in worker.requests


async def test_a_transfer_cancelled_part_way_leaves_nothing_behind(decode_worker) -> None:
    worker, address, sender = decode_worker
    expect(worker, "r")
    session = await sender.open(address, header("r"))
    for index, (key, value) in enumerate(layers(3)[:3]):
        await session.send_layer("target", index, key, value)
    await wait_for(lambda: len(worker.received_kv.get("r", [])) == 3)
    await worker._cancel("r", None)
    with pytest.raises(KVTransferError):
        await session.send_layer("target", 3, *layers(3)[3])
        await session.close(extras={"first_token_id": 1})
    assert worker.core.commands == [("abort", "r", True)]
    assert worker.received_kv == {}
