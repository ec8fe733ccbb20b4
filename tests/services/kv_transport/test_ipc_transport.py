"""The ipc KV transport over loopback: the KV goes by handle to shared memory (only the handle on the
wire) and arrives bit-exact; a receiver on another host, or one that cannot open the handle, gets
the bytes over TCP instead; a bad handle is refused with a clear error; a handle the receiver never
answered is flagged so the sender keeps its buffer; a shared buffer's file is gone once it is
released, past its deadline, or its producer closed."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from services.kv_transport import (
    KVHeader,
    KVTransferError,
    KVTransferRefused,
    KVTransferTimeout,
    LayerShape,
    TensorSpec,
)
from services.kv_transport.ipc import IpcKVTransport, KVSharedUnusable
from services.kv_transport.ipc_buffer import SHM_DIR, CudaRegion, SharedBuffers, SharedKV, open_shared
from services.kv_transport.wire import FrameKind, pack

NUM_LAYERS = 3
LAYER = (2, 4, 2, 8)  # [num_blocks, block_size, num_kv_heads, head_dim]
MTP_LAYER = (2, 4, 1, 8)


def stacked_caches(buffers: SharedBuffers, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A target cache of NUM_LAYERS layers and an MTP cache of one, in one shared buffer."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {"target": (NUM_LAYERS, 2, *LAYER), "mtp": (1, 2, *MTP_LAYER)}
    sizes = [torch.Size(shape).numel() * 4 for shape in shapes.values()]
    buffer = buffers.allocate(sum(sizes))
    caches = {
        name: part.view(torch.float32).view(shape).copy_(torch.randn(shape, generator=generator))
        for (name, shape), part in zip(shapes.items(), buffer.split(sizes))
    }
    return buffer, caches


def header_of(request_id: str, shared: SharedKV, **extras: Any) -> KVHeader:
    return KVHeader(
        request_id=request_id,
        num_tokens=8,
        block_size=4,
        dtype=shared.dtype,
        layer_shapes=shared.layer_shapes(),
        tensors=shared.tensor_specs(),
        extras=extras,
    )


class Decode:
    """The receiving side: what a decode worker does with shared KV (open, copy, forget the handle),
    or with layers sent as bytes."""

    def __init__(self) -> None:
        self.copied: dict[str, dict[str, torch.Tensor]] = {}
        self.layers: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.unusable: str | None = None

    async def import_shared(self, request_id: str, shared: SharedKV) -> dict[str, torch.Tensor]:
        if self.unusable is not None:
            raise KVSharedUnusable(self.unusable)
        caches, tensors = open_shared(shared)
        self.copied[request_id] = {name: cache.clone() for name, cache in caches.items()}
        return {name: tensor.clone() for name, tensor in tensors.items()}

    def expect(self, transport: IpcKVTransport, request_id: str, timeout_s: float = 30.0) -> None:
        transport.expect(
            request_id,
            on_layer=lambda layer: self.layers.__setitem__(
                (layer.cache, layer.index), (layer.key, layer.value)
            ),
            on_done=self.done.set_result,
            on_error=self.done.set_result,
            timeout_s=timeout_s,
        )


@pytest.fixture
async def pair() -> AsyncIterator[tuple[IpcKVTransport, IpcKVTransport, Decode, str]]:
    decode = Decode()
    receiver = IpcKVTransport(import_shared=decode.import_shared)
    address = await receiver.start("127.0.0.1", 0, advertise_host="127.0.0.1")
    sender = IpcKVTransport()
    yield sender, receiver, decode, address
    await sender.close()
    await receiver.close()


async def test_kv_moves_by_handle_and_arrives_bit_exact(pair) -> None:
    sender, receiver, decode, address = pair
    buffers = SharedBuffers(torch.device("cpu"))
    buffer, caches = stacked_caches(buffers, seed=1)
    hidden = torch.randn(16)
    shared = buffers.share("r", buffer, caches, {"mtp_hidden": hidden})
    decode.expect(receiver, "r")
    session = await sender.open(address, header_of("r", shared))
    assert await session.send_shared(shared) is None
    assert not session.shared_unanswered  # taken: the sender may free the buffer
    stats = await session.close(extras={"first_token_id": 7})
    done = await decode.done
    assert not isinstance(done, KVTransferError), done
    assert all(torch.equal(decode.copied["r"][name], caches[name]) for name in caches)
    assert torch.equal(done.tensors["mtp_hidden"], hidden) and done.extras["first_token_id"] == 7
    assert decode.layers == {}  # nothing came as bytes
    kv_bytes = sum(view.numel() * 4 for view in caches.values())
    assert stats.num_bytes < kv_bytes / 4  # the handle, not the KV, went over the socket
    assert sender.stats.transfers_sent == 1 and receiver.stats.transfers_received == 1
    buffers.close()


@pytest.mark.parametrize("why", ["another host", "cannot open"])
async def test_kv_goes_as_bytes_where_the_handle_cannot_be_used(pair, why: str) -> None:
    sender, receiver, decode, address = pair
    if why == "another host":
        receiver.host = "elsewhere/0000"
    else:
        decode.unusable = "no such GPU here"
    buffers = SharedBuffers(torch.device("cpu"))
    buffer, caches = stacked_caches(buffers, seed=2)
    shared = buffers.share("r", buffer, caches, {})
    decode.expect(receiver, "r")
    session = await sender.open(address, header_of("r", shared))
    refusal = await session.send_shared(shared)
    assert refusal is not None and (
        "another host" in refusal if why == "another host" else "no such GPU" in refusal
    )
    assert not session.shared_unanswered  # never sent, or refused: the sender may free the buffer
    for name, stacked in caches.items():
        for index, kv in enumerate(stacked):
            await session.send_layer(name, index, kv[0], kv[1])
    await session.close()
    done = await decode.done
    assert not isinstance(done, KVTransferError), done
    assert decode.copied == {}
    for name, stacked in caches.items():
        for index, kv in enumerate(stacked):
            assert torch.equal(decode.layers[(name, index)][0], kv[0])
            assert torch.equal(decode.layers[(name, index)][1], kv[1])
    buffers.close()


async def test_a_tcp_receiver_gets_bytes(pair) -> None:
    sender, _, _, _ = pair
    decode = Decode()
    receiver = IpcKVTransport()  # takes no shared KV: its ACCEPT names no host
    address = await receiver.start("127.0.0.1", 0, advertise_host="127.0.0.1")
    buffers = SharedBuffers(torch.device("cpu"))
    buffer, caches = stacked_caches(buffers, seed=3)
    shared = buffers.share("r", buffer, caches, {})
    decode.expect(receiver, "r")
    session = await sender.open(address, header_of("r", shared))
    assert "tcp" in (await session.send_shared(shared) or "")
    await session.abort("test over")
    await receiver.close()
    buffers.close()


def bad_handles(shared: SharedKV) -> dict[str, tuple[Any, str]]:
    """Handles a receiver must refuse, with what its error says."""
    good = shared.model_dump(mode="python")
    region = good["caches"][0]["region"]
    fewer = {**region, "num_bytes": region["num_bytes"] // NUM_LAYERS * (NUM_LAYERS - 1)}
    return {
        "not our file": (
            {**good, "caches": [{**good["caches"][0], "region": {**region, "name": "../etc/passwd"}}]},
            "not a shared KV file name",
        ),
        "size lies": (
            {**good, "caches": [{**good["caches"][0], "region": {**region, "num_bytes": 8}}]},
            "in a region of 8",
        ),
        "other layers": (
            {
                **good,
                "caches": [{**good["caches"][0], "shape": (NUM_LAYERS - 1, 2, *LAYER), "region": fewer}],
            },
            "does not match the header",
        ),
        "not a map": ([1, 2, 3], "control frame holds list"),
        "unknown field": ({**good, "path": "/dev/mem"}, "invalid shared-KV handle"),
    }


@pytest.mark.parametrize("case", ["not our file", "size lies", "other layers", "not a map", "unknown field"])
async def test_a_bad_handle_is_refused_with_a_clear_error(pair, case: str) -> None:
    sender, receiver, decode, address = pair
    buffers = SharedBuffers(torch.device("cpu"))
    buffer, caches = stacked_caches(buffers, seed=4)
    shared = buffers.share("r", buffer, {"target": caches["target"]}, {})
    payload, message = bad_handles(shared)[case]
    decode.expect(receiver, "r")
    session = await sender.open(address, header_of("r", shared))
    await session._send(FrameKind.SHARED, [pack(payload)])  # noqa: SLF001 - what a broken sender does
    await asyncio.wait_for(session._watcher, 10)  # noqa: SLF001 - the receiver's answer
    refusal = session._error  # noqa: SLF001
    assert isinstance(refusal, KVTransferRefused if case != "not a map" else KVTransferError)
    assert message in str(refusal)
    await session.abort()
    error = await decode.done
    assert isinstance(error, KVTransferError) and message in str(error)
    assert decode.copied == {}
    buffers.close()


def test_a_handle_must_describe_its_header() -> None:
    buffers = SharedBuffers(torch.device("cpu"))
    buffer, caches = stacked_caches(buffers, seed=5)
    shared = buffers.share("r", buffer, caches, {})
    header = header_of("r", shared)
    assert shared.problems(header) == []
    fewer = header.model_copy(update={"layer_shapes": header.layer_shapes[1:]})
    assert "target[0]" in shared.problems(fewer)[0]
    extra = header.model_copy(update={"tensors": [TensorSpec(name="h", shape=(4,), dtype="float32")]})
    assert "tensors" in shared.problems(extra)[0]
    other = header.model_copy(
        update={
            "layer_shapes": [
                LayerShape(cache=layer.cache, index=layer.index, shape=(2, 4, 2, 4))
                for layer in header.layer_shapes
            ]
        }
    )
    assert shared.problems(other)
    buffers.close()


async def test_a_handle_the_receiver_never_answers_is_flagged_unanswered() -> None:
    """The receiver may still be reading the buffer: the sender must keep it."""
    decode = Decode()
    importing = asyncio.Event()

    async def never_done(request_id: str, shared: SharedKV) -> dict[str, torch.Tensor]:
        open_shared(shared)
        importing.set()
        await asyncio.Event().wait()
        return {}

    receiver = IpcKVTransport(import_shared=never_done)
    address = await receiver.start("127.0.0.1", 0, advertise_host="127.0.0.1")
    sender = IpcKVTransport(ack_timeout_s=0.5)
    buffers = SharedBuffers(torch.device("cpu"))
    buffer, caches = stacked_caches(buffers, seed=6)
    shared = buffers.share("r", buffer, caches, {})
    decode.expect(receiver, "r")
    session = await sender.open(address, header_of("r", shared))
    with pytest.raises(KVTransferTimeout):
        await session.send_shared(shared)
    assert importing.is_set() and session.shared_unanswered
    await session.abort()
    await sender.close()
    await receiver.close()
    buffers.close()


def shm_files(shared: SharedKV) -> set[str]:
    regions = [segment.region for segment in (*shared.caches, *shared.tensors)]
    return {os.path.join(SHM_DIR, region.name) for region in regions}  # type: ignore[union-attr]


@pytest.mark.parametrize("outcome", ["released", "deadline", "superseded", "closed"])
def test_a_shared_buffers_files_are_gone_in_every_outcome(outcome: str) -> None:
    buffers = SharedBuffers(torch.device("cpu"), timeout_s=60.0)
    buffer, caches = stacked_caches(buffers, seed=7)
    files = shm_files(buffers.share("r", buffer, caches, {"hidden": torch.ones(3)}))
    assert len(files) == 2 and all(os.path.exists(path) for path in files)
    assert buffers.expire() == []  # not before its deadline
    if outcome == "released":
        assert buffers.release("r") and not buffers.release("r")
    elif outcome == "deadline":
        assert buffers.expire(time.monotonic() + 60.0) == ["r"]
    elif outcome == "superseded":  # the request was placed again and shared anew
        buffer, caches = stacked_caches(buffers, seed=8)
        files_again = shm_files(buffers.share("r", buffer, caches, {}))
        assert buffers.num_held == 1 and all(os.path.exists(path) for path in files_again)
        buffers.release("r")
    else:
        buffers.close()
    assert not any(os.path.exists(path) for path in files) and buffers.num_held == 0


def cuda_region(**fields: Any) -> dict[str, Any]:
    region = dict(
        device_uuid="GPU-0",
        handle=b"h" * 64,
        storage_size_bytes=64,
        storage_offset_bytes=0,
        event_handle=b"e" * 64,
        event_sync_required=True,
        offset=0,
        num_bytes=64,
    )
    return {**region, **fields}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"event_handle": None}, "64-byte event handle"),
        ({"event_handle": b"short"}, "64-byte event handle"),
        ({"ref_counter_handle": b"/torch_1_2", "ref_counter_offset": 0}, "Extra inputs"),
        ({"num_bytes": 128}, "exceeds the 64-byte allocation"),
    ],
    ids=["no event", "short event", "torch's reference counter", "past the allocation"],
)
def test_a_cuda_region_is_validated(fields: dict[str, Any], message: str) -> None:
    """A handle names no reference counter: the producer alone decides when the memory goes."""
    CudaRegion.model_validate(cuda_region())
    CudaRegion.model_validate(cuda_region(event_handle=None, event_sync_required=False))
    with pytest.raises(ValueError, match=message):
        CudaRegion.model_validate(cuda_region(**fields))
