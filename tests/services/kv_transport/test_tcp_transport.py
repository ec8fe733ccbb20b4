"""The TCP KV transport over loopback: bit-exact round trips, overlap, integrity, refusal, timeouts,
concurrency and throughput."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import torch

from services.kv_transport import (
    DTYPES,
    CacheLayout,
    KVCallbackError,
    KVConnectionError,
    KVExpectation,
    KVHeader,
    KVIntegrityError,
    KVSendSession,
    KVTransferCancelled,
    KVTransferError,
    KVTransferRefused,
    KVTransferTimeout,
    LayerShape,
    ReceivedLayer,
    ReceivedTransfer,
    TcpKVTransport,
    TensorSpec,
)
from services.kv_transport.connection import split_address
from services.kv_transport.wire import (
    MAGIC,
    PART,
    POSITION,
    PREAMBLE,
    PREFIX,
    WIRE_VERSION,
    FrameKind,
    FrameReader,
    encode_frame,
    encode_header,
    error_from_payload,
    pack,
    tensor_bytes,
)

logger = logging.getLogger(__name__)

LayerKey = tuple[str, int]


# ---- helpers ----------------------------------------------------------------------------------------


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def make_header(
    request_id: str = "req-1",
    dtype: str = "float32",
    num_target_layers: int = 3,
    target_shape: tuple[int, int, int, int] = (3, 4, 2, 8),
    with_draft_and_mtp: bool = True,
    tensors: list[TensorSpec] | None = None,
) -> KVHeader:
    layers = [LayerShape(cache="target", index=i, shape=target_shape) for i in range(num_target_layers)]
    if with_draft_and_mtp:
        block_size = target_shape[1]
        layers += [LayerShape(cache="draft", index=i, shape=(3, block_size, 1, 16)) for i in range(2)]
        layers.append(LayerShape(cache="mtp", index=0, shape=(2, block_size, 4, 4)))
    if tensors is None:
        tensors = [
            TensorSpec(name="mtp_hidden", shape=(48,), dtype=dtype),
            TensorSpec(name="token_ids", shape=(10,), dtype="int64"),
        ]
    return KVHeader(
        request_id=request_id,
        num_tokens=target_shape[0] * target_shape[1] - 2,
        block_size=target_shape[1],
        dtype=dtype,
        layer_shapes=layers,
        extras={"first_token_id": 7, "prompt_len": 10},
        tensors=tensors,
    )


def random_payload(
    header: KVHeader, seed: int = 0
) -> tuple[dict[LayerKey, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    dtype = DTYPES[header.dtype]
    layers = {
        (layer.cache, layer.index): (
            torch.randn(layer.shape, generator=generator).mul(3).to(dtype),
            torch.randn(layer.shape, generator=generator).mul(3).to(dtype),
        )
        for layer in header.layer_shapes
    }
    tensors = {
        spec.name: torch.randint(-1000, 1000, spec.shape, generator=generator).to(DTYPES[spec.dtype])
        if spec.dtype.startswith("int")
        else torch.randn(spec.shape, generator=generator).to(DTYPES[spec.dtype])
        for spec in header.tensors
    }
    return layers, tensors


@dataclass
class Receiving:
    """Records what a receiver's callbacks saw."""

    layers: list[ReceivedLayer] = field(default_factory=list)
    done: ReceivedTransfer | None = None
    errors: list[KVTransferError] = field(default_factory=list)
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    def on_layer(self, layer: ReceivedLayer) -> None:
        self.layers.append(layer)

    def on_done(self, transfer: ReceivedTransfer) -> None:
        self.done = transfer
        self.finished.set()

    def on_error(self, error: KVTransferError) -> None:
        self.errors.append(error)
        self.finished.set()

    def expect(
        self,
        transport: TcpKVTransport,
        request_id: str,
        timeout_s: float = 10.0,
        expectation: KVExpectation | None = None,
    ) -> Receiving:
        transport.expect(request_id, self.on_layer, self.on_done, self.on_error, timeout_s, expectation)
        return self

    async def wait(self, timeout_s: float = 5.0) -> None:
        await asyncio.wait_for(self.finished.wait(), timeout_s)


async def send_all(
    sender: TcpKVTransport,
    address: str,
    header: KVHeader,
    layers: dict[LayerKey, tuple[torch.Tensor, torch.Tensor]],
    tensors: dict[str, torch.Tensor],
) -> None:
    session = await sender.open(address, header)
    for (cache, index), (key, value) in layers.items():
        await session.send_layer(cache, index, key, value)
    for name, tensor in tensors.items():
        await session.send_tensor(name, tensor)
    await session.close(extras={"num_cached_tokens": 4})


async def send_rest(
    session: KVSendSession,
    layers: dict[LayerKey, tuple[torch.Tensor, torch.Tensor]],
    tensors: dict[str, torch.Tensor],
    after: LayerKey,
) -> None:
    """Send the layers after `after`, the tensors, and close; a receiver's error surfaces by `close()`."""
    keys = list(layers)
    for cache, index in keys[keys.index(after) + 1 :]:
        await session.send_layer(cache, index, *layers[(cache, index)])
    for name, tensor in tensors.items():
        await session.send_tensor(name, tensor)
    await session.close()


def assert_received_exactly(
    receiving: Receiving,
    header: KVHeader,
    layers: dict[LayerKey, tuple[torch.Tensor, torch.Tensor]],
    tensors: dict[str, torch.Tensor],
) -> None:
    assert receiving.errors == []
    assert [(layer.cache, layer.index) for layer in receiving.layers] == list(layers)
    for layer in receiving.layers:
        key, value = layers[(layer.cache, layer.index)]
        assert layer.request_id == header.request_id
        assert layer.key.dtype == key.dtype and layer.key.shape == key.shape
        assert torch.equal(bits(layer.key), bits(key)) and torch.equal(bits(layer.value), bits(value))
    assert receiving.done is not None
    assert receiving.done.header == header
    assert receiving.done.extras == {"first_token_id": 7, "prompt_len": 10, "num_cached_tokens": 4}
    assert receiving.done.tensors.keys() == tensors.keys()
    for name, tensor in tensors.items():
        received = receiving.done.tensors[name]
        assert received.dtype == tensor.dtype and torch.equal(bits(received), bits(tensor))


@pytest.fixture
async def receiver() -> AsyncIterator[TcpKVTransport]:
    transport = TcpKVTransport()
    await transport.start("127.0.0.1", 0)
    yield transport
    await transport.close()


@pytest.fixture
async def sender() -> AsyncIterator[TcpKVTransport]:
    transport = TcpKVTransport(connect_timeout_s=2.0, ack_timeout_s=5.0)
    yield transport
    await transport.close()


def address_of(transport: TcpKVTransport) -> str:
    assert transport.address is not None
    return transport.address


@contextlib.asynccontextmanager
async def raw_connection(address: str) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection(*split_address(address))
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def read_answer(reader: asyncio.StreamReader) -> tuple[FrameKind, bytes]:
    return await asyncio.wait_for(FrameReader(reader).next_control(), 5.0)


# ---- round trips ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
async def test_round_trip_is_bit_exact(receiver: TcpKVTransport, sender: TcpKVTransport, dtype: str) -> None:
    header = make_header(dtype=dtype)
    layers, tensors = random_payload(header)
    expectation = KVExpectation(
        block_size=4,
        dtype=dtype,
        max_num_blocks=3,
        caches={"target": CacheLayout(3, 2, 8), "draft": CacheLayout(2, 1, 16), "mtp": CacheLayout(1, 4, 4)},
    )
    receiving = Receiving().expect(receiver, "req-1", expectation=expectation)

    await send_all(sender, address_of(receiver), header, layers, tensors)
    await receiving.wait()

    assert_received_exactly(receiving, header, layers, tensors)
    assert receiving.done is not None and receiving.done.stats.num_layers == 6
    wire_bytes = receiving.done.stats.num_bytes
    assert wire_bytes > header.num_bytes
    assert receiver.stats.bytes_received == wire_bytes and receiver.stats.transfers_received == 1
    assert sender.stats.bytes_sent == wire_bytes and sender.stats.transfers_sent == 1
    assert receiver.num_expected == 0


async def test_layers_in_any_order_arrive_in_sent_order(
    receiver: TcpKVTransport, sender: TcpKVTransport
) -> None:
    header = make_header()
    layers, tensors = random_payload(header)
    shuffled = dict(reversed(list(layers.items())))
    receiving = Receiving().expect(receiver, "req-1")
    await send_all(sender, address_of(receiver), header, shuffled, tensors)
    await receiving.wait()
    assert_received_exactly(receiving, header, shuffled, tensors)


async def test_on_layer_for_layer_0_runs_before_the_last_layer_is_sent(
    receiver: TcpKVTransport, sender: TcpKVTransport
) -> None:
    header = make_header(num_target_layers=4, with_draft_and_mtp=False, tensors=[])
    layers, _ = random_payload(header)
    events: list[str] = []
    layer_0_stored = asyncio.Event()

    async def store_layer(layer: ReceivedLayer) -> None:
        await asyncio.sleep(0)  # an async callback, as a device copy awaiting its stream would be
        events.append(f"stored {layer.index}")
        if layer.index == 0:
            layer_0_stored.set()

    receiving = Receiving()
    receiver.expect("req-1", store_layer, receiving.on_done, receiving.on_error)
    session = await sender.open(address_of(receiver), header)
    for index in range(4):
        await session.send_layer("target", index, *layers[("target", index)])
        events.append(f"sent {index}")
        if index == 0:  # the next layer is "computed" only once the receiver stored this one
            await asyncio.wait_for(layer_0_stored.wait(), 5.0)
    await session.close()
    await receiving.wait()

    assert receiving.errors == [] and receiving.done is not None
    assert events.index("stored 0") < events.index("sent 1") < events.index("sent 3")
    assert [e for e in events if e.startswith("stored")] == [f"stored {i}" for i in range(4)]


async def test_a_layer_sent_in_parts_arrives_whole_once_its_last_part_came(
    receiver: TcpKVTransport, sender: TcpKVTransport
) -> None:
    """A chunked prefill's layers: each chunk's blocks as its step ends, the parts in any order,
    another layer whole in between; each is delivered once complete, bit for bit."""
    header = make_header(num_target_layers=2, target_shape=(5, 4, 2, 8), with_draft_and_mtp=False, tensors=[])
    layers, _ = random_payload(header)
    receiving = Receiving().expect(receiver, "req-1")
    session = await sender.open(address_of(receiver), header)
    key, value = layers[("target", 0)]
    await session.send_layer_part("target", 0, 2, key[2:4], value[2:4])
    await session.send_layer("target", 1, *layers[("target", 1)])
    await session.send_layer_part("target", 0, 0, key[:2], value[:2])
    await asyncio.sleep(0.05)
    assert [layer.index for layer in receiving.layers] == [1]  # layer 0 waits for its last block
    await session.send_layer_part("target", 0, 4, key[4:], value[4:])
    await session.close(extras={"num_cached_tokens": 4})
    await receiving.wait()
    assert_received_exactly(receiving, header, {k: layers[k] for k in [("target", 1), ("target", 0)]}, {})


async def test_parts_that_overlap_or_leave_a_gap_fail_the_transfer(
    receiver: TcpKVTransport, sender: TcpKVTransport
) -> None:
    shape = (4, 4, 2, 8)
    header = make_header(num_target_layers=1, target_shape=shape, with_draft_and_mtp=False, tensors=[])
    layers, _ = random_payload(header)
    key, value = layers[("target", 0)]
    Receiving().expect(receiver, "req-0")
    session = await sender.open(address_of(receiver), header.model_copy(update={"request_id": "req-0"}))
    await session.send_layer_part("target", 0, 0, key[:3], value[:3])
    with pytest.raises(ValueError, match="not sent: target\\[0\\]"):
        await session.close()  # block 3 never went
    with pytest.raises(ValueError, match="out of its 4"):
        await session.send_layer_part("target", 0, 3, key[:2], value[:2])
    await session.abort()
    receiving = Receiving().expect(receiver, "req-1")
    async with raw_connection(address_of(receiver)) as (reader, writer):
        writer.write(encode_frame(FrameKind.HEADER, encode_header(header)))
        assert (await read_answer(reader))[0] == FrameKind.ACCEPT
        for first_block in (0, 1):  # blocks 0-1, then 1-2: block 1 twice
            part = (PART.pack(0, first_block, 2), tensor_bytes(key[:2]), tensor_bytes(value[:2]))
            writer.write(encode_frame(FrameKind.LAYER_PART, *part))
        kind, payload = await read_answer(reader)
    await receiving.wait()
    assert kind == FrameKind.ERROR and "overlaps" in str(error_from_payload(payload))
    assert len(receiving.errors) == 1 and isinstance(receiving.errors[0], KVIntegrityError)


async def test_connection_is_reused_for_the_next_transfer(
    receiver: TcpKVTransport, sender: TcpKVTransport
) -> None:
    for request_id in ("req-1", "req-2", "req-3"):
        header = make_header(request_id=request_id)
        layers, tensors = random_payload(header, seed=len(request_id))
        receiving = Receiving().expect(receiver, request_id)
        await send_all(sender, address_of(receiver), header, layers, tensors)
        await receiving.wait()
        assert receiving.done is not None
    assert receiver.num_inbound_connections == 1  # one connection carried all three
    assert sender.stats.transfers_sent == 3


async def test_eight_concurrent_transfers_arrive_intact(receiver: TcpKVTransport) -> None:
    senders = [TcpKVTransport() for _ in range(8)]
    headers = [make_header(request_id=f"req-{i}", dtype=("float32", "bfloat16")[i % 2]) for i in range(8)]
    payloads = [random_payload(header, seed=i) for i, header in enumerate(headers)]
    receivings = [Receiving().expect(receiver, header.request_id) for header in headers]
    try:
        await asyncio.gather(
            *(
                send_all(sender, address_of(receiver), header, *payload)
                for sender, header, payload in zip(senders, headers, payloads)
            )
        )
        await asyncio.gather(*(receiving.wait() for receiving in receivings))
    finally:
        await asyncio.gather(*(sender.close() for sender in senders))
    for receiving, header, payload in zip(receivings, headers, payloads):
        assert_received_exactly(receiving, header, *payload)
    assert receiver.stats.transfers_received == 8


async def test_large_transfer_reports_throughput(receiver: TcpKVTransport, sender: TcpKVTransport) -> None:
    # 16 layers of K and V, 2 MiB each: 64 MiB of KV.
    header = make_header(
        dtype="float16",
        num_target_layers=16,
        target_shape=(64, 16, 8, 128),
        with_draft_and_mtp=False,
        tensors=[],
    )
    assert header.num_bytes == 64 << 20
    layers, _ = random_payload(header)
    stored_bits: dict[int, bool] = {}

    def check_layer(layer: ReceivedLayer) -> None:
        key, value = layers[(layer.cache, layer.index)]
        stored_bits[layer.index] = torch.equal(bits(layer.key), bits(key)) and torch.equal(
            bits(layer.value), bits(value)
        )

    receiving = Receiving()
    receiver.expect("req-1", check_layer, receiving.on_done, receiving.on_error)
    started = time.perf_counter()
    session = await sender.open(address_of(receiver), header)
    for (cache, index), (key, value) in layers.items():
        await session.send_layer(cache, index, key, value)
    stats = await session.close()
    seconds = time.perf_counter() - started
    await receiving.wait()

    assert receiving.errors == [] and stored_bits == dict.fromkeys(range(16), True)
    gib_s = header.num_bytes / seconds / 2**30
    message = (
        f"KV loopback throughput: {header.num_bytes >> 20} MiB in {seconds * 1000:.0f} ms = {gib_s:.2f} GiB/s "
        f"({stats.bytes_per_s / 2**30:.2f} GiB/s by the session's stats, CRC-32 on both sides)"
    )
    logger.info(message)
    print(message)
    assert stats.num_bytes >= header.num_bytes and stats.seconds > 0


# ---- failures ---------------------------------------------------------------------------------------


async def test_unexpected_request_is_refused(receiver: TcpKVTransport, sender: TcpKVTransport) -> None:
    with pytest.raises(KVTransferRefused, match="no KV transfer expected for request 'nobody'") as refused:
        await sender.open(address_of(receiver), make_header(request_id="nobody"))
    assert refused.value.request_id == "nobody"
    assert sender.stats.send_failures == 1


async def test_header_that_does_not_fit_fails_both_sides(
    receiver: TcpKVTransport, sender: TcpKVTransport
) -> None:
    receiving = Receiving().expect(
        receiver,
        "req-1",
        expectation=KVExpectation(dtype="bfloat16", caches={"target": CacheLayout(3, 2, 8)}),
    )
    with pytest.raises(KVTransferRefused, match="dtype float32 != expected bfloat16"):
        await sender.open(address_of(receiver), make_header(dtype="float32"))
    await receiving.wait()
    assert len(receiving.errors) == 1 and isinstance(receiving.errors[0], KVTransferRefused)
    assert "unexpected cache 'draft'" in str(receiving.errors[0])
    assert receiver.num_expected == 0


async def test_header_with_unknown_dtype_is_refused(receiver: TcpKVTransport) -> None:
    receiving = Receiving().expect(receiver, "req-1")
    fields = make_header().model_dump()
    fields["dtype"] = "float24"
    async with raw_connection(address_of(receiver)) as (reader, writer):
        writer.write(encode_frame(FrameKind.HEADER, PREAMBLE.pack(MAGIC, WIRE_VERSION), pack(fields)))
        kind, payload = await read_answer(reader)
    assert kind == FrameKind.ERROR
    error = error_from_payload(payload)
    assert isinstance(error, KVTransferRefused) and "unknown dtype 'float24'" in str(error)
    await receiving.wait()
    assert "unknown dtype" in str(receiving.errors[0])


async def test_a_stream_that_is_not_ours_is_refused(receiver: TcpKVTransport) -> None:
    async with raw_connection(address_of(receiver)) as (reader, writer):
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        with pytest.raises(KVConnectionError):  # garbage kind: dropped without an answer
            await read_answer(reader)
    async with raw_connection(address_of(receiver)) as (reader, writer):
        writer.write(encode_frame(FrameKind.HEADER, b"HTTP/1.1 200 OK"))
        kind, payload = await read_answer(reader)
    assert kind == FrameKind.ERROR and "not a specmesh KV stream" in str(error_from_payload(payload))


@pytest.mark.parametrize(
    ("damage", "message"),
    [("flip", "checksum mismatch"), ("truncate", "truncated"), ("wrong_size", "expected 1536 for K and V")],
)
async def test_damaged_layer_frame_is_rejected(receiver: TcpKVTransport, damage: str, message: str) -> None:
    header = make_header(with_draft_and_mtp=False, tensors=[])
    layers, _ = random_payload(header)
    key, value = layers[("target", 0)]
    frame = bytearray(encode_frame(FrameKind.LAYER, POSITION.pack(0), tensor_bytes(key), tensor_bytes(value)))
    if damage == "flip":
        frame[PREFIX.size + POSITION.size + 100] ^= 0x10
    elif damage == "truncate":
        frame = frame[: len(frame) // 2]
    else:
        frame = bytearray(encode_frame(FrameKind.LAYER, POSITION.pack(0), tensor_bytes(key)))
    receiving = Receiving().expect(receiver, "req-1")

    async with raw_connection(address_of(receiver)) as (reader, writer):
        writer.write(encode_frame(FrameKind.HEADER, encode_header(header)))
        assert (await read_answer(reader))[0] == FrameKind.ACCEPT
        writer.write(frame)
        if damage == "truncate":
            writer.write_eof()
        kind, payload = await read_answer(reader)

    assert kind == FrameKind.ERROR
    error = error_from_payload(payload)
    assert isinstance(error, KVIntegrityError) and message in str(error) and error.request_id == "req-1"
    await receiving.wait()
    assert receiving.layers == [] and receiving.done is None
    assert isinstance(receiving.errors[0], KVIntegrityError) and message in str(receiving.errors[0])
    assert receiver.stats.receive_failures == 1


class CorruptingProxy:
    """Forwards sender -> receiver bytes, flipping one byte at `flip_at` (counted from the first)."""

    def __init__(self, target: str, flip_at: int):
        self.target = split_address(target)
        self.flip_at = flip_at
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.server.wait_closed()

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        try:
            await asyncio.gather(
                self._pump(client_reader, upstream_writer, self.flip_at),
                self._pump(upstream_reader, client_writer, None),
            )
        finally:
            client_writer.transport.abort()
            upstream_writer.transport.abort()

    @staticmethod
    async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter, flip_at: int | None) -> None:
        offset = 0
        with contextlib.suppress(ConnectionError):
            while data := await source.read(1 << 16):
                if flip_at is not None and offset <= flip_at < offset + len(data):
                    damaged = bytearray(data)
                    damaged[flip_at - offset] ^= 0x01
                    data = bytes(damaged)
                offset += len(data)
                sink.write(data)
                await sink.drain()
        sink.transport.abort()


async def test_corruption_on_the_wire_is_reported_to_both_sides(
    receiver: TcpKVTransport, sender: TcpKVTransport
) -> None:
    header = make_header()
    layers, tensors = random_payload(header)
    header_frame_bytes = len(encode_frame(FrameKind.HEADER, encode_header(header)))
    proxy = CorruptingProxy(
        address_of(receiver), flip_at=header_frame_bytes + PREFIX.size + POSITION.size + 37
    )
    receiving = Receiving().expect(receiver, "req-1")
    try:
        with pytest.raises(KVIntegrityError, match="receiver: frame checksum mismatch") as failed:
            await send_all(sender, await proxy.start(), header, layers, tensors)
        await receiving.wait()
    finally:
        await proxy.close()
    assert failed.value.request_id == "req-1"
    assert receiving.layers == [] and receiving.done is None
    assert isinstance(receiving.errors[0], KVIntegrityError)
    assert sender.stats.send_failures == 1 and receiver.stats.receive_failures == 1


async def test_receiver_times_out_a_stalled_sender(receiver: TcpKVTransport, sender: TcpKVTransport) -> None:
    header = make_header()
    layers, tensors = random_payload(header)
    receiving = Receiving().expect(receiver, "req-1", timeout_s=0.3)
    session = await sender.open(address_of(receiver), header)
    await session.send_layer("target", 0, *layers[("target", 0)])
    await receiving.wait()  # the sender stalls here
    assert isinstance(receiving.errors[0], KVTransferTimeout) and receiving.done is None
    assert [layer.index for layer in receiving.layers] == [0]
    with pytest.raises(KVTransferTimeout, match="receiver: transfer of 'req-1' incomplete at its deadline"):
        await send_rest(session, layers, tensors, after=("target", 0))


async def test_receiver_times_out_a_sender_that_never_comes(receiver: TcpKVTransport) -> None:
    receiving = Receiving().expect(receiver, "req-1", timeout_s=0.1)
    await receiving.wait()
    assert isinstance(receiving.errors[0], KVTransferTimeout) and "arrived in time" in str(
        receiving.errors[0]
    )
    assert receiver.num_expected == 0


async def test_unreachable_receiver(sender: TcpKVTransport) -> None:
    probe = TcpKVTransport()
    address = await probe.start("127.0.0.1", 0)
    await probe.close()  # nothing listens there any more
    with pytest.raises(KVConnectionError, match=f"cannot reach the KV receiver at {address}"):
        await sender.open(address, make_header())


async def test_receiver_cancel_stops_the_sender(receiver: TcpKVTransport, sender: TcpKVTransport) -> None:
    header = make_header()
    layers, tensors = random_payload(header)
    receiving = Receiving().expect(receiver, "req-1")
    session = await sender.open(address_of(receiver), header)
    await session.send_layer("target", 0, *layers[("target", 0)])
    assert receiver.cancel("req-1") and not receiver.cancel("req-1")
    with pytest.raises(KVTransferCancelled, match="cancelled by the receiver"):
        await send_rest(session, layers, tensors, after=("target", 0))
    assert receiving.errors == [] and receiving.done is None  # cancel() runs no callback


async def test_sender_abort_reaches_the_receiver(receiver: TcpKVTransport, sender: TcpKVTransport) -> None:
    header = make_header()
    layers, _ = random_payload(header)
    receiving = Receiving().expect(receiver, "req-1")
    async with await sender.open(address_of(receiver), header) as session:
        await session.send_layer("target", 0, *layers[("target", 0)])
        await session.abort("prefill failed")
    await receiving.wait()
    assert isinstance(receiving.errors[0], KVTransferCancelled)
    assert "sender aborted: prefill failed" in str(receiving.errors[0])


async def test_failing_on_layer_fails_the_transfer(receiver: TcpKVTransport, sender: TcpKVTransport) -> None:
    header = make_header()
    layers, tensors = random_payload(header)
    receiving = Receiving()

    def out_of_blocks(layer: ReceivedLayer) -> None:
        raise RuntimeError("no free KV blocks")

    receiver.expect("req-1", out_of_blocks, receiving.on_done, receiving.on_error)
    with pytest.raises(KVCallbackError, match="no free KV blocks"):
        await send_all(sender, address_of(receiver), header, layers, tensors)
    await receiving.wait()
    assert isinstance(receiving.errors[0], KVCallbackError) and receiving.done is None


async def test_sender_checks_what_it_sends(receiver: TcpKVTransport, sender: TcpKVTransport) -> None:
    header = make_header(dtype="bfloat16")
    layers, _ = random_payload(header)
    Receiving().expect(receiver, "req-1")
    session = await sender.open(address_of(receiver), header)
    key, value = layers[("target", 0)]
    with pytest.raises(ValueError, match=r"layer target\[9\] is not in the header"):
        await session.send_layer("target", 9, key, value)
    with pytest.raises(ValueError, match="the header says"):
        await session.send_layer("target", 0, key.float(), value.float())
    await session.send_layer("target", 0, key, value)
    with pytest.raises(ValueError, match="already sent"):
        await session.send_layer("target", 0, key, value)
    with pytest.raises(ValueError, match=r"not sent: target\[1\]"):
        await session.close()
    await session.abort()


async def test_closing_the_receiver_fails_pending_transfers(sender: TcpKVTransport) -> None:
    receiver = TcpKVTransport()
    await receiver.start("127.0.0.1", 0)
    waiting = Receiving().expect(receiver, "req-1")
    receiving = Receiving().expect(receiver, "req-2")
    header = make_header(request_id="req-2")
    session = await sender.open(address_of(receiver), header)
    await receiver.close()
    for pending in (waiting, receiving):
        assert isinstance(pending.errors[0], KVTransferCancelled)
    with pytest.raises(KVTransferError):
        layers, _ = random_payload(header)
        for (cache, index), (key, value) in layers.items():
            await session.send_layer(cache, index, key, value)
        await session.close()


async def test_closing_right_after_on_done_still_acknowledges(sender: TcpKVTransport) -> None:
    receiver = TcpKVTransport()
    await receiver.start("127.0.0.1", 0)
    header = make_header()
    layers, tensors = random_payload(header)
    receiving = Receiving()
    closed: list[asyncio.Task[None]] = []

    def done_then_shut_down(transfer: ReceivedTransfer) -> None:
        receiving.on_done(transfer)
        closed.append(asyncio.ensure_future(receiver.close()))  # e.g. SIGTERM right after the last request

    receiver.expect("req-1", receiving.on_layer, done_then_shut_down, receiving.on_error)
    await send_all(sender, address_of(receiver), header, layers, tensors)
    await asyncio.gather(*closed)
    assert receiving.done is not None and receiving.errors == []  # on_done, and never on_error after it
    with pytest.raises(RuntimeError, match="closed"):
        receiver.expect("req-2", receiving.on_layer, receiving.on_done, receiving.on_error)
    with pytest.raises(RuntimeError, match="closed"):
        await receiver.open(address_of(receiver), make_header(request_id="req-2"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
async def test_receives_into_pinned_memory(sender: TcpKVTransport) -> None:
    receiver = TcpKVTransport(pin_memory=True)
    await receiver.start("127.0.0.1", 0)
    header = make_header(dtype="bfloat16")
    layers, tensors = random_payload(header)
    receiving = Receiving().expect(receiver, "req-1")
    try:
        await send_all(sender, address_of(receiver), header, layers, tensors)
        await receiving.wait()
    finally:
        await receiver.close()
    assert_received_exactly(receiving, header, layers, tensors)
    assert all(layer.key.is_pinned() and layer.value.is_pinned() for layer in receiving.layers)
    on_gpu = receiving.layers[0].key.to("cuda", non_blocking=True)
    assert torch.equal(on_gpu.cpu(), layers[("target", 0)][0])


async def reuse_staging_tensors_after_each_send() -> list[bool]:
    """Send 4 layers through one staging pair refilled right after each send returns, to a receiver
    slow enough that the sender's socket buffers fill; the receiver must see every layer's own data."""
    receiver, sender = TcpKVTransport(), TcpKVTransport()
    address = await receiver.start("127.0.0.1", 0)
    header = make_header(
        num_target_layers=4, target_shape=(32, 16, 8, 128), with_draft_and_mtp=False, tensors=[]
    )  # 2 MiB for each of K and V
    layers, _ = random_payload(header)
    intact: list[bool] = []

    async def slow_store(layer: ReceivedLayer) -> None:
        await asyncio.sleep(0.02)
        key, value = layers[(layer.cache, layer.index)]
        intact.append(torch.equal(layer.key, key) and torch.equal(layer.value, value))

    receiving = Receiving()
    receiver.expect("req-1", slow_store, receiving.on_done, receiving.on_error)
    staging_key, staging_value = (
        torch.empty_like(layers[("target", 0)][0]),
        torch.empty_like(layers[("target", 0)][1]),
    )
    try:
        session = await sender.open(address, header)
        for index in range(4):
            staging_key.copy_(layers[("target", index)][0])
            staging_value.copy_(layers[("target", index)][1])
            await session.send_layer("target", index, staging_key, staging_value)
            staging_key.fill_(0.0)  # the next layer's "gather" overwrites the staging buffers
            staging_value.fill_(0.0)
        await session.close()
        await receiving.wait()
    finally:
        await sender.close()
        await receiver.close()
    return intact


async def test_sent_tensors_may_be_reused_once_send_layer_returns() -> None:
    assert await reuse_staging_tensors_after_each_send() == [True] * 4


def test_sent_tensors_may_be_reused_under_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop")
    assert uvloop.run(reuse_staging_tensors_after_each_send()) == [True] * 4
