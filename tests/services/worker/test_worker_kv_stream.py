"""A prefill worker's side of the streamed KV hand-off, over a real TCP transport and a real Redis:
the transfer opens as the core announces the request's prefill and each layer goes out as the core
streams it, before the request's export (which adds the drafting model's layers and the first
token); a decode side that dies, cancels or times out mid-stream fails the request and releases it
(stopped in the core where its prefill still runs); a request that ends before its hand-off ends its
transfer without a word to the scheduler."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
import torch

from services.engine.kv_export import KVExport, KVLayers, KVStreamStart
from services.kv_transport import KVTransferError, ReceivedLayer, ReceivedTransfer, TcpKVTransport
from services.worker.core_messages import EngineInfo, EngineLoad, RowEnd
from services.worker.metrics import WorkerMetrics
from services.worker.worker import Running, Worker, WorkerOptions
from shared.bus import Bus
from shared.protocol import PAYLOAD_FIELD, GenerateRequest, decode
from shared.sampling_params import SamplingParams
from tests.services.worker.test_worker_emit import one_token_step

SHAPE = (3, 4, 2, 8)  # [num_blocks, block_size, num_kv_heads, head_dim]
NUM_LAYERS = 4
FIRST_TOKEN_ID = 7


class PrefillCore:
    """Stands in for a prefill engine core: records the aborts the worker sends it."""

    info = EngineInfo(max_model_len=512, total_kv_blocks=64, block_size=4)
    load = EngineLoad()

    def __init__(self) -> None:
        self.aborted: list[tuple[str, bool]] = []

    async def abort(self, request_id: str, emit: bool = True) -> None:
        self.aborted.append((request_id, emit))


class Receiver:
    """A decode side: a TCP transport expecting one transfer, recording what it gets."""

    def __init__(self) -> None:
        self.transport = TcpKVTransport()
        self.layers: list[ReceivedLayer] = []
        self.done: list[ReceivedTransfer] = []
        self.errors: list[KVTransferError] = []

    async def start(self, request_id: str, timeout_s: float = 30.0) -> str:
        address = await self.transport.start("127.0.0.1", 0, advertise_host="127.0.0.1")
        self.transport.expect(
            request_id, self.layers.append, self.done.append, self.errors.append, timeout_s=timeout_s
        )
        return address


@pytest.fixture
async def prefill(bus: Bus) -> Any:
    options = WorkerOptions(instance_id="p", role="prefill", model_name="m", ttl_s=5.0)
    core = PrefillCore()
    worker = Worker(core, bus, options, WorkerMetrics("p", "prefill"))  # type: ignore[arg-type]
    worker.transport = TcpKVTransport()
    receiver = Receiver()
    yield worker, core, receiver
    await worker.transport.close()
    await receiver.transport.close()


def place(worker: Worker, address: str, request_id: str = "r") -> None:
    """The request placed here for prefill, its decode instance at `address` (as `_dispatch` does)."""
    request = GenerateRequest(
        request_id=request_id, prompt_token_ids=[1] * 12, params=SamplingParams(), gateway_id="g"
    )
    worker.requests[request_id] = Running(request, 1)
    worker.handoff_targets[request_id] = address


def start(request_id: str = "r") -> KVStreamStart:
    shapes = [("target", i, SHAPE) for i in range(NUM_LAYERS)] + [("mtp", 0, SHAPE)]
    return KVStreamStart(request_id, 12, torch.float32, shapes)


def layer(index: int, request_id: str = "r") -> KVLayers:
    generator = torch.Generator().manual_seed(index)
    key, value = torch.randn(SHAPE, generator=generator), torch.randn(SHAPE, generator=generator)
    return KVLayers(index, [request_id], [0], [key], [value])


def export(request_id: str = "r") -> KVExport:
    mtp = ("mtp", 0, torch.ones(SHAPE), torch.zeros(SHAPE))
    return KVExport(request_id, 12, FIRST_TOKEN_ID, [mtp], {}, streamed=True)


def hand_off(worker: Worker, request_id: str = "r") -> None:
    """The core's step batch that hands the request off: its first token, its export."""
    batch = one_token_step([request_id], 0, ends=[RowEnd(row=0, handoff=True)])
    worker._retire(dataclasses.replace(batch, handoffs=[export(request_id)]))


async def wait_for(condition: Any) -> None:
    async with asyncio.timeout(20):
        while not condition():
            await asyncio.sleep(0.01)


async def outcomes(bus: Bus) -> list[str]:
    return [decode(f[PAYLOAD_FIELD]).outcome for _, f in await bus.client.xrange(bus.keys.scheduler_replies)]


async def settled(worker: Worker) -> None:
    await wait_for(lambda: not worker.pending)


async def test_layers_go_out_as_streamed_before_the_export_which_ends_the_transfer(prefill, bus) -> None:
    worker, core, receiver = prefill
    place(worker, await receiver.start("r"))
    worker._on_kv_stream(start())
    for index in range(NUM_LAYERS):
        worker._on_kv_stream(layer(index))
    await wait_for(lambda: len(receiver.layers) == NUM_LAYERS)  # with no export yet
    assert receiver.done == [] and "r" in worker.requests
    hand_off(worker)
    await wait_for(lambda: receiver.done)
    assert [(got.cache, got.index) for got in receiver.layers] == [
        *(("target", i) for i in range(NUM_LAYERS)),
        ("mtp", 0),
    ]
    assert all(torch.equal(got.key, layer(i).keys[0]) for i, got in enumerate(receiver.layers[:NUM_LAYERS]))
    assert receiver.done[0].extras["first_token_id"] == FIRST_TOKEN_ID
    await settled(worker)
    assert await outcomes(bus) == ["handed_off"]
    assert worker.requests == {} and worker.streams == {} and worker.handoff_targets == {}
    assert core.aborted == []


async def test_a_decode_side_that_dies_mid_stream_fails_the_request_and_stops_its_prefill(
    prefill, bus
) -> None:
    worker, core, receiver = prefill
    place(worker, await receiver.start("r"))
    worker._on_kv_stream(start())
    worker._on_kv_stream(layer(0))
    await wait_for(lambda: len(receiver.layers) == 1)
    await receiver.transport.close()  # the decode worker is gone
    for index in range(1, NUM_LAYERS):
        worker._on_kv_stream(layer(index))
    await wait_for(lambda: core.aborted)
    await settled(worker)
    assert core.aborted == [("r", False)]
    assert await outcomes(bus) == ["failed"]
    assert worker.requests == {} and worker.streams == {} and worker.handoff_targets == {}
    hand_off(worker)  # its step batch, already on its way: nothing more happens
    await settled(worker)
    assert await outcomes(bus) == ["failed"]


async def test_a_transfer_the_decode_side_cancels_mid_stream_fails_the_request(prefill, bus) -> None:
    worker, core, receiver = prefill
    place(worker, await receiver.start("r"))
    worker._on_kv_stream(start())
    worker._on_kv_stream(layer(0))
    await wait_for(lambda: len(receiver.layers) == 1)
    receiver.transport.cancel("r")
    for index in range(1, NUM_LAYERS):
        worker._on_kv_stream(layer(index))
    hand_off(worker)  # the sender hears of the cancel at the latest as it closes
    await settled(worker)
    assert await outcomes(bus) == ["failed"] and worker.streams == {} and worker.requests == {}
    assert receiver.done == []


async def test_a_transfer_that_times_out_before_the_export_fails_the_hand_off(prefill, bus) -> None:
    worker, core, receiver = prefill
    place(worker, await receiver.start("r", timeout_s=0.3))
    worker._on_kv_stream(start())
    worker._on_kv_stream(layer(0))
    await wait_for(lambda: receiver.errors)
    for index in range(1, NUM_LAYERS):
        worker._on_kv_stream(layer(index))
    hand_off(worker)
    await settled(worker)
    assert await outcomes(bus) == ["failed"]
    assert receiver.done == [] and worker.streams == {} and worker.requests == {}


async def test_a_request_that_ends_before_its_hand_off_ends_its_transfer_silently(prefill, bus) -> None:
    worker, core, receiver = prefill
    place(worker, await receiver.start("r"))
    worker._on_kv_stream(start())
    worker._on_kv_stream(layer(0))
    await wait_for(lambda: len(receiver.layers) == 1)
    batch = one_token_step(["r"], 0, ends=[RowEnd(row=0, finish_reason="stop")])
    worker._retire(batch)  # its first token was its last (an EOS, max_tokens 1)
    await wait_for(lambda: receiver.errors)
    await settled(worker)
    assert await outcomes(bus) == [] and core.aborted == []
    assert worker.streams == {} and worker.requests == {}


async def test_a_dropped_request_ends_its_transfer(prefill, bus) -> None:
    worker, core, receiver = prefill
    place(worker, await receiver.start("r"))
    worker._on_kv_stream(start())
    await wait_for(lambda: receiver.transport.num_inbound_connections)
    await worker._drop(["r"])  # placed elsewhere meanwhile
    await wait_for(lambda: receiver.errors)
    await settled(worker)
    assert await outcomes(bus) == [] and worker.streams == {}


async def test_a_chunked_prompt_s_parts_go_out_at_their_steps_and_arrive_as_whole_layers(
    prefill, bus
) -> None:
    worker, core, receiver = prefill
    place(worker, await receiver.start("r"))
    worker._on_kv_stream(start())
    for index in range(NUM_LAYERS):  # the first chunk's step: blocks 0 and 1 of 3
        whole = layer(index)
        worker._on_kv_stream(KVLayers(index, ["r"], [0], [whole.keys[0][:2]], [whole.values[0][:2]]))
    await asyncio.sleep(0.2)
    assert receiver.layers == [] and receiver.errors == []  # on the wire, none whole yet
    for index in range(NUM_LAYERS):  # the last chunk's: block 2
        whole = layer(index)
        worker._on_kv_stream(KVLayers(index, ["r"], [2], [whole.keys[0][2:]], [whole.values[0][2:]]))
    await wait_for(lambda: len(receiver.layers) == NUM_LAYERS)
    hand_off(worker)
    await wait_for(lambda: receiver.done)
    for index, got in enumerate(receiver.layers[:NUM_LAYERS]):
        assert torch.equal(got.key, layer(index).keys[0]) and torch.equal(got.value, layer(index).values[0])
    await settled(worker)
    assert await outcomes(bus) == ["handed_off"]
