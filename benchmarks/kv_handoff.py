"""Throughput and per-layer latency of the split mesh's KV hand-off on the CPU, hop by hop and whole.

Hops, each through the code and the kind of process boundary the mesh uses:
- wire: a sender process (the prefill worker's side) -> `TcpKVTransport` receiver in this process,
  authenticated with a shared secret, every frame checked by its crc32;
- channel: this process's `AsyncChannel` (the decode worker's bus process) -> a consumer process
  reading a `BlockingChannel` (the engine core's side), one import command per layer or request;
- import: `LLMEngine.import_layers` (a request's layers at once) into a real engine's CPU KV cache,
  in this process;
- end-to-end: sender process -> receiver -> channel -> a consumer process that imports into a real
  engine, as the decode worker forwards it (`Worker._on_kv_layer`, `_on_kv_done`).

`--hops prefill` times a whole hand-off as the split mesh does it, once with the KV exported whole
after the prefill step and once streamed layer by layer while the prefill runs
(services/engine/kv_stream.py): a real prefill engine (on `--device`, a target of Llama-3.2-1B's
width with `--num-layers` layers and the KV shape given) runs each prompt alone (`--num-tokens`, in
chunks of the engine's default step budget, 2048 tokens: a 4k prompt takes two steps, whose first
chunk's KV streams during the second), its KV goes over `TcpKVTransport` to a receiver in this
process; *time to last byte* runs from the first step's call to the receiver's acknowledgement of
the whole transfer (its first token id included).
The engine steps on a thread of its own, as an engine core runs beside its worker's loop. A warm-up
request precedes each mode.

`--transport ipc` runs the wire and end-to-end hops through the ipc transport instead: the sender puts
each request's KV in a shared buffer (`SharedBuffers`, on `--device`) and sends its handle; the
receiver (wire) or the consumer process (end-to-end, as `ImportShared` reaches the decode engine core)
opens it and copies it; the sender frees the buffer once acknowledged. `--transport tcp ipc` runs both
in one call. On `--device cuda` the sender's KV is on the GPU (tcp copies it to the host first, as a
prefill engine core does) and the consumer's engine too.

A layer's latency is from the start of its request's send (the monotonic clock is shared by the
processes of one host; the time rides in the first layer's first bytes) to its arrival at the end of
the hop.

    python -m benchmarks.kv_handoff --num-requests 16
    python -m benchmarks.kv_handoff --hops wire end-to-end --transport tcp ipc
    python -m benchmarks.kv_handoff --hops prefill --num-tokens 2000 --num-requests 8 --device cuda
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.random_model import write_random_checkpoint
from services.engine.engine import LLMEngine
from services.engine.kv_export import KVExport, KVLayers, KVStreamMessage, KVStreamStart
from services.kv_transport import KVHeader, TcpKVTransport
from services.kv_transport.base import DTYPES, LayerShape, ReceivedLayer, ReceivedTransfer
from services.kv_transport.ipc import IpcKVTransport
from services.kv_transport.ipc_buffer import SharedBuffers, SharedKV, open_shared
from services.worker.channel import AsyncChannel, BlockingChannel
from services.worker.core_messages import ImportKV, ImportShared, Reply, Shutdown
from services.worker.worker import kv_header, send_target_part, stream_header
from shared.config import EngineConfig
from shared.sampling_params import SamplingParams

SECRET = b"kv-handoff-benchmark-secret"
STAMP_BYTES = 8


@dataclass(frozen=True)
class KVShape:
    """One request's KV: `num_layers` target layers of [num_blocks, block_size, num_kv_heads, head_dim]."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_tokens: int
    block_size: int

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        return (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def layer_bytes(self) -> int:
        """K and V of one layer."""
        return (
            2
            * self.num_blocks
            * self.block_size
            * self.num_kv_heads
            * self.head_dim
            * DTYPES[self.dtype].itemsize
        )

    def header(self, request_id: str) -> KVHeader:
        layers = [LayerShape(cache="target", index=i, shape=self.layer_shape) for i in range(self.num_layers)]
        return KVHeader(
            request_id=request_id,
            num_tokens=self.num_tokens,
            block_size=self.block_size,
            dtype=self.dtype,
            layer_shapes=layers,
        )

    def layers(self, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(seed)
        return [
            tuple(torch.randn(self.layer_shape, generator=generator).to(DTYPES[self.dtype]) for _ in "kv")  # type: ignore[misc]
            for _ in range(self.num_layers)
        ]


@dataclass
class HopResult:
    hop: str
    num_bytes: int
    seconds: float
    layer_latencies_s: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        latencies = sorted(self.layer_latencies_s) or [0.0]
        return {
            "hop": self.hop,
            "MB": round(self.num_bytes / 1e6, 1),
            "seconds": round(self.seconds, 3),
            "MB_per_s": round(self.num_bytes / 1e6 / self.seconds, 1),
            "layer_latency_ms_p50": round(1e3 * statistics.median(latencies), 2),
            "layer_latency_ms_p90": round(1e3 * latencies[int(0.9 * (len(latencies) - 1))], 2),
        }


# ---- time stamps in a layer's first bytes --------------------------------------------------------------


def stamp(key: torch.Tensor) -> None:
    key.reshape(-1).view(torch.uint8)[:STAMP_BYTES] = torch.tensor(
        [time.monotonic()], dtype=torch.float64
    ).view(torch.uint8)


def stamped_at(key: torch.Tensor) -> float:
    return float(key.reshape(-1).view(torch.uint8)[:STAMP_BYTES].clone().view(torch.float64)[0])


def request_ids(num_requests: int) -> Iterator[str]:
    return (f"kv-{i}" for i in range(num_requests))


# ---- the sender process --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """How the KV moves: which transport, and where the KV lives at both ends."""

    transport: str = "tcp"
    device: str = "cpu"


def sender_main(address: str, shape: KVShape, num_requests: int, concurrency: int, setup: Setup) -> None:
    torch.set_num_threads(1)
    if setup.transport == "ipc":
        asyncio.run(_share_all(address, shape, num_requests, concurrency, torch.device(setup.device)))
    else:
        asyncio.run(_send_all(address, shape, num_requests, concurrency, torch.device(setup.device)))


async def _send_all(
    address: str, shape: KVShape, num_requests: int, concurrency: int, device: torch.device
) -> None:
    """As a prefill worker over tcp: each request's KV (on `device`) copied to the host, then sent."""
    transport = TcpKVTransport(secret=SECRET)
    slots: asyncio.Queue[list[tuple[torch.Tensor, torch.Tensor]]] = asyncio.Queue()
    for seed in range(concurrency):  # a slot's tensors are reused once its transfer is acknowledged
        slots.put_nowait([(k.to(device), v.to(device)) for k, v in shape.layers(seed)])

    async def send(request_id: str) -> None:
        layers = await slots.get()
        for key, _ in layers:
            stamp(key)
        on_host = [(key.cpu(), value.cpu()) for key, value in layers]
        async with await transport.open(address, shape.header(request_id)) as session:
            for index, (key, value) in enumerate(on_host):
                await session.send_layer("target", index, key, value)
            await session.close()
        slots.put_nowait(layers)

    await asyncio.gather(*(send(request_id) for request_id in request_ids(num_requests)))
    await transport.close()


async def _share_all(
    address: str, shape: KVShape, num_requests: int, concurrency: int, device: torch.device
) -> None:
    """As a prefill worker over ipc: each request's KV gathered into a shared buffer on `device`, its
    handle sent, the buffer freed once the receiver acknowledged."""
    transport = IpcKVTransport(secret=SECRET)
    buffers = SharedBuffers(device)
    layers = [(k.to(device), v.to(device)) for k, v in shape.layers(0)]
    in_flight = asyncio.Semaphore(concurrency)

    async def send(request_id: str) -> None:
        async with in_flight:
            stacked_shape = (shape.num_layers, 2, *shape.layer_shape)
            buffer = buffers.allocate(shape.num_layers * shape.layer_bytes)
            stacked = buffer.view(DTYPES[shape.dtype]).view(stacked_shape)
            torch.stack([torch.stack(kv) for kv in layers], out=stacked)  # the gather, as the engine's
            stamp(stacked[0, 0])
            shared = buffers.share(request_id, buffer, {"target": stacked}, {})
            try:
                async with await transport.open(address, shape.header(request_id)) as session:
                    refusal = await session.send_shared(shared)
                    if refusal is not None:
                        raise SystemExit(f"the receiver did not take the shared KV: {refusal}")
                    await session.close()
            finally:
                buffers.release(request_id)

    await asyncio.gather(*(send(request_id) for request_id in request_ids(num_requests)))
    await transport.close()
    buffers.close()


def start_sender(address: str, shape: KVShape, num_requests: int, concurrency: int, setup: Setup) -> Any:
    process = multiprocessing.get_context("spawn").Process(
        target=sender_main, args=(address, shape, num_requests, concurrency, setup), daemon=True
    )
    process.start()
    return process


# ---- the consumer process (engine-core-like) -----------------------------------------------------------


def consumer_main(
    sock: socket.socket, checkpoint: str | None, shape: KVShape, num_requests: int, threads: int, device: str
) -> None:
    """Reads import commands until Shutdown, importing into a real engine when `checkpoint` is given
    (`ImportShared`: opened, imported, then answered, as the decode engine core does); answers with
    the layers' latencies and when the last one was done."""
    if threads:
        torch.set_num_threads(threads)
    channel = BlockingChannel(sock)
    engine = build_engine(checkpoint, shape, num_requests, device) if checkpoint else None
    channel.send("ready")
    latencies: list[float] = []
    first_s, last_s = float("inf"), 0.0
    while not isinstance(command := channel.recv(), Shutdown):
        if isinstance(command, ImportKV):
            stamps = _import_bytes(engine, command)
        else:
            stamps = _import_shared(engine, command)
        if engine is not None and engine.runner.device.type == "cuda":
            torch.cuda.synchronize(engine.runner.device)
        last_s = time.monotonic()
        first_s = min(first_s, *stamps)
        latencies += [last_s - stamped for stamped in stamps]
        if isinstance(command, ImportShared):
            channel.send(Reply(command.call_id))
    channel.send({"latencies": latencies, "first_s": first_s, "last_s": last_s})


def _import_bytes(engine: LLMEngine | None, command: ImportKV) -> list[float]:
    """As the decode engine core takes `ImportKV`; each layer's send time."""
    if engine is not None:
        engine.import_layers(command.request_id, command.layers)
    return [stamped_at(key) for _, _, key, _ in command.layers]


def _import_shared(engine: LLMEngine | None, command: ImportShared) -> list[float]:
    """As the decode engine core takes `ImportShared` (one copy per cache); the request's send time,
    once per layer."""
    caches, _ = open_shared(command.shared)
    if engine is not None:
        engine.import_stacked(command.request_id, caches)
    target = caches["target"]
    return [stamped_at(target[0, 0])] * len(target)


def build_engine(checkpoint: str, shape: KVShape, num_requests: int, device: str = "cpu") -> LLMEngine:
    """An engine whose cache holds every request, each reserved as the decode worker does."""
    config = EngineConfig(
        model=checkpoint,
        device=device,
        dtype=shape.dtype,  # type: ignore[arg-type]
        max_model_len=shape.num_tokens + 8,
        block_size=shape.block_size,
        num_kv_blocks=num_requests * (shape.num_blocks + 1),
        enable_prefix_caching=False,
    )
    engine = LLMEngine(config)
    prompt = [(7 * i) % 97 + 3 for i in range(shape.num_tokens)]
    for request_id in request_ids(num_requests):
        engine.reserve(request_id, prompt, SamplingParams(max_tokens=1))
    return engine


def write_checkpoint(shape: KVShape, out_dir: Path) -> str:
    overrides = {
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_kv_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "hidden_size": shape.num_kv_heads * shape.head_dim,
        "intermediate_size": 256,
        "vocab_size": 512,
        "max_position_embeddings": max(4096, shape.num_tokens + 32),  # the engine's max_model_len below
    }
    return str(write_random_checkpoint("llama-tiny", out_dir, DTYPES[shape.dtype], overrides=overrides))


class Consumer:
    """A consumer process on the far end of a socket pair, as the worker starts its engine core."""

    def __init__(
        self, checkpoint: str | None, shape: KVShape, num_requests: int, threads: int, device: str = "cpu"
    ):
        ours, theirs = socket.socketpair()
        self.process = multiprocessing.get_context("spawn").Process(
            target=consumer_main, args=(theirs, checkpoint, shape, num_requests, threads, device), daemon=True
        )
        self.process.start()
        theirs.close()
        self.channel = AsyncChannel(ours, asyncio.get_running_loop())
        self.call_ids = iter(range(1 << 62))
        self._one_call = asyncio.Lock()

    async def ready(self) -> None:
        assert await self.channel.recv() == "ready"

    async def import_kv(
        self, request_id: str, layers: list[tuple[str, int, torch.Tensor, torch.Tensor]]
    ) -> None:
        await self.channel.send(ImportKV(request_id, layers))

    async def import_shared(self, request_id: str, shared: SharedKV) -> dict[str, torch.Tensor]:
        """As the decode worker's `_import_shared`: one command, then its answer (the only command in
        flight: transfers are serialised here, as their imports are in the engine core)."""
        async with self._one_call:
            await self.channel.send(ImportShared(next(self.call_ids), request_id, shared))
            reply = await self.channel.recv()
        assert isinstance(reply, Reply) and reply.error is None, reply
        return {}

    async def finish(self) -> dict[str, Any]:
        await self.channel.send(Shutdown())
        result: dict[str, Any] = await self.channel.recv()
        self.channel.close()
        self.process.join(10)
        return result


# ---- the hops ------------------------------------------------------------------------------------------


class Receiver:
    """The decode worker's side of the wire: expects every request; `forward` takes each request's
    layers once all arrived, as the worker hands them to its core."""

    def __init__(
        self, num_requests: int, forward: Any = None, import_shared: Any = None, transport: str = "tcp"
    ):
        """`import_shared`: what takes a shared transfer's handle (ipc); default: open and copy here."""
        if transport == "ipc":
            self.transport: TcpKVTransport = IpcKVTransport(
                secret=SECRET, import_shared=import_shared or self.copy_shared
            )
        else:
            self.transport = TcpKVTransport(secret=SECRET)
        self.forward = forward
        self.received: dict[str, list[tuple[str, int, torch.Tensor, torch.Tensor]]] = {}
        self.latencies: list[float] = []
        self.num_done = 0
        self.all_done = asyncio.Event()
        self.num_requests = num_requests
        self.first_s = float("inf")

    async def start(self) -> str:
        address = await self.transport.start("127.0.0.1", 0, advertise_host="127.0.0.1")
        for request_id in request_ids(self.num_requests):
            self.transport.expect(request_id, self.on_layer, self.on_done, self.on_error, timeout_s=600)
        return address

    async def copy_shared(self, request_id: str, shared: SharedKV) -> dict[str, torch.Tensor]:
        """The wire hop's ipc receiver: open the handle and copy the KV out, in this process."""
        caches, _ = open_shared(shared)
        sent_s = stamped_at(caches["target"][0, 0])
        self.first_s = min(self.first_s, sent_s)
        copies = {name: cache.clone() for name, cache in caches.items()}
        if copies["target"].is_cuda:
            torch.cuda.synchronize()
        self.latencies += [time.monotonic() - sent_s] * len(copies["target"])
        return {}

    async def on_layer(self, layer: ReceivedLayer) -> None:
        sent_s = stamped_at(layer.key)
        self.first_s = min(self.first_s, sent_s)
        self.latencies.append(time.monotonic() - sent_s)
        self.received.setdefault(layer.request_id, []).append(("target", layer.index, layer.key, layer.value))

    async def on_done(self, transfer: ReceivedTransfer) -> None:
        layers = self.received.pop(transfer.header.request_id, [])
        if self.forward is not None and layers:
            await self.forward(transfer.header.request_id, layers)
        self.num_done += 1
        if self.num_done == self.num_requests:
            self.all_done.set()

    def on_error(self, error: Exception) -> None:
        raise SystemExit(f"KV transfer failed: {error}")


async def wire_hop(shape: KVShape, num_requests: int, concurrency: int, setup: Setup) -> HopResult:
    receiver = Receiver(num_requests, transport=setup.transport)
    sender = start_sender(await receiver.start(), shape, num_requests, concurrency, setup)
    await receiver.all_done.wait()
    seconds = time.monotonic() - receiver.first_s
    await receiver.transport.close()
    sender.join(10)
    num_bytes = num_requests * shape.num_layers * shape.layer_bytes
    return HopResult(f"wire {setup.transport}", num_bytes, seconds, receiver.latencies)


async def channel_hop(shape: KVShape, num_requests: int, threads: int) -> HopResult:
    consumer = Consumer(None, shape, num_requests, threads)
    await consumer.ready()
    layers = shape.layers(0)
    first_s = time.monotonic()
    for request_id in request_ids(num_requests):
        for key, _ in layers:
            stamp(key)
        await consumer.import_kv(
            request_id, [("target", i, key, value) for i, (key, value) in enumerate(layers)]
        )
    result = await consumer.finish()
    num_bytes = num_requests * shape.num_layers * shape.layer_bytes
    return HopResult("channel", num_bytes, result["last_s"] - first_s, result["latencies"])


def import_hop(checkpoint: str, shape: KVShape, num_requests: int, threads: int) -> HopResult:
    """In this process, with the consumer's torch thread count."""
    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads or default_threads)
    try:
        return _import_all(checkpoint, shape, num_requests)
    finally:
        torch.set_num_threads(default_threads)


def _import_all(checkpoint: str, shape: KVShape, num_requests: int) -> HopResult:
    engine = build_engine(checkpoint, shape, num_requests)
    layers = shape.layers(0)
    latencies = []
    started = time.monotonic()
    for request_id in request_ids(num_requests):
        begin = time.monotonic()
        engine.import_layers(request_id, [("target", i, key, value) for i, (key, value) in enumerate(layers)])
        latencies += [(time.monotonic() - begin) / len(layers)] * len(layers)
    seconds = time.monotonic() - started
    return HopResult("import", num_requests * shape.num_layers * shape.layer_bytes, seconds, latencies)


async def end_to_end(
    checkpoint: str, shape: KVShape, num_requests: int, concurrency: int, threads: int, setup: Setup
) -> HopResult:
    consumer = Consumer(checkpoint, shape, num_requests, threads, setup.device)
    await consumer.ready()
    receiver = Receiver(num_requests, consumer.import_kv, consumer.import_shared, setup.transport)
    sender = start_sender(await receiver.start(), shape, num_requests, concurrency, setup)
    await receiver.all_done.wait()
    result = await consumer.finish()
    await receiver.transport.close()
    sender.join(10)
    num_bytes = num_requests * shape.num_layers * shape.layer_bytes
    first_s = min(receiver.first_s, result["first_s"])
    return HopResult(
        f"end-to-end {setup.transport}", num_bytes, result["last_s"] - first_s, result["latencies"]
    )


# ---- the prefill hand-off, whole and streamed ----------------------------------------------------------


def write_prefill_checkpoint(shape: KVShape, out_dir: Path) -> str:
    """A target of Llama-3.2-1B's width (4 query heads per KV head, an MLP 4x the hidden size) over the
    KV shape given: a prefill whose compute the streamed copies can hide under."""
    hidden_size = 4 * shape.num_kv_heads * shape.head_dim
    overrides = {
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": 4 * shape.num_kv_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "hidden_size": hidden_size,
        "intermediate_size": 4 * hidden_size,
        "vocab_size": 512,
    }
    return str(
        write_random_checkpoint("llama-tiny", out_dir / "prefill", DTYPES[shape.dtype], overrides=overrides)
    )


def prefill_engine(checkpoint: str, shape: KVShape, device: str) -> LLMEngine:
    config = EngineConfig(
        model=checkpoint,
        device=device,
        dtype=shape.dtype,  # type: ignore[arg-type]
        max_model_len=shape.num_tokens + 32,
        block_size=shape.block_size,
        num_kv_blocks=4 * (shape.num_blocks + 2),
        max_num_seqs=4,
        enable_prefix_caching=False,
    )
    return LLMEngine(config)


@dataclass
class PrefillResult(HopResult):
    """`layer_latencies_s` holds each hand-off's time to last byte."""

    prefill_steps_s: list[float] = field(default_factory=list)


class StreamedSender:
    """A prefill worker's side of one hand-off: the transfer opens at the `KVStreamStart`, each
    streamed layer goes as it comes, the export ends it (`Worker._stream_kv`)."""

    def __init__(self, transport: TcpKVTransport, address: str) -> None:
        self.transport = transport
        self.address = address
        self.items: asyncio.Queue[KVStreamMessage | KVExport] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()

    def sink(self, message: KVStreamMessage) -> None:
        """`LLMEngine.stream_kv`'s sink, called on the engine's threads."""
        self.loop.call_soon_threadsafe(self.items.put_nowait, message)

    async def send(self) -> None:
        start = await self.items.get()
        assert isinstance(start, KVStreamStart)
        async with await self.transport.open(self.address, stream_header(start, 0)) as session:
            while isinstance(item := await self.items.get(), KVLayers):
                for first_block, key, value in zip(item.first_blocks, item.keys, item.values):
                    await send_target_part(session, item.index, first_block, key, value)
            assert isinstance(item, KVExport)
            for cache, index, key, value in item.layers:
                await session.send_layer(cache, index, key, value)
            await session.close(extras={"first_token_id": item.first_token_id})


async def send_whole(transport: TcpKVTransport, address: str, export: KVExport) -> None:
    async with await transport.open(address, kv_header(export, 0)) as session:
        for cache, index, key, value in export.layers:
            await session.send_layer(cache, index, key, value)
        await session.close(extras={"first_token_id": export.first_token_id})


async def hand_off_one(
    engine: LLMEngine, request_id: str, prompt: list[int], sender: StreamedSender
) -> tuple[float, float]:
    """One request prefilled and handed off; (time to last byte, the prefill steps' time), seconds.
    Where the engine streams, `sender` takes its KV as it comes; else the export goes whole."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    streams = engine.runner.kv_stream is not None
    sending = asyncio.create_task(sender.send()) if streams else None
    started = time.perf_counter()
    engine.add_request(request_id, prompt_token_ids=prompt, params=params, handoff=True)
    while not engine.handoffs:
        await asyncio.to_thread(engine.step)
    stepped = time.perf_counter() - started
    export = engine.handoffs.pop()
    if sending is not None:
        sender.items.put_nowait(export)
        await sending
    else:
        await send_whole(sender.transport, sender.address, export)
    return time.perf_counter() - started, stepped


async def prefill_hop(checkpoint: str, shape: KVShape, num_requests: int, device: str) -> list[PrefillResult]:
    """Time to last byte of `num_requests` hand-offs, one at a time, whole then streamed."""
    engine = prefill_engine(checkpoint, shape, device)
    receiver = TcpKVTransport(secret=SECRET)
    address = await receiver.start("127.0.0.1", 0, advertise_host="127.0.0.1")
    sender = StreamedSender(TcpKVTransport(secret=SECRET), address)
    prompt = [(7 * i) % 97 + 3 for i in range(shape.num_tokens)]
    results = []
    try:
        for mode in ("whole", "streamed"):
            if mode == "streamed":
                assert engine.stream_kv(sender.sink)
            times, steps = [], []
            for i in range(num_requests + 1):  # the first: warm-up
                request_id = f"{mode}-{i}"
                receiver.expect(request_id, lambda _: None, lambda _: None, lambda _: None, timeout_s=600)
                ttlb, stepped = await hand_off_one(engine, request_id, prompt, sender)
                times += [ttlb] if i else []
                steps += [stepped] if i else []
                while engine.has_unfinished_requests():
                    engine.step()
            num_bytes = 2 * shape.layer_bytes * shape.num_layers * num_requests
            results.append(PrefillResult(f"prefill {mode}", num_bytes, sum(times), times, steps))
    finally:
        await sender.transport.close()
        await receiver.close()
        engine.close()
    return results


def prefill_summary(results: list[PrefillResult]) -> dict[str, Any]:
    """Per mode the time to last byte (mean, p50) and the prefill steps' mean; streamed / whole."""
    summary: dict[str, Any] = {}
    for result in results:
        times = result.layer_latencies_s
        summary[result.hop] = {
            "ttlb_ms_mean": round(1e3 * statistics.mean(times), 2),
            "ttlb_ms_p50": round(1e3 * statistics.median(times), 2),
            "prefill_step_ms_mean": round(1e3 * statistics.mean(result.prefill_steps_s), 2),
        }
    if {"prefill whole", "prefill streamed"} <= summary.keys():
        whole, streamed = summary["prefill whole"], summary["prefill streamed"]
        summary["ttlb streamed / whole"] = round(streamed["ttlb_ms_p50"] / whole["ttlb_ms_p50"], 3)
    return summary


# ---- main ----------------------------------------------------------------------------------------------


async def run(args: argparse.Namespace, shape: KVShape, checkpoint: str) -> list[HopResult]:
    hops = set(args.hops)
    setups = [Setup(transport, args.device) for transport in args.transport]
    results = []
    for setup in setups if "wire" in hops else []:
        results.append(await wire_hop(shape, args.num_requests, args.concurrency, setup))
    if "channel" in hops:
        results.append(await channel_hop(shape, args.num_requests, args.core_threads))
    if "import" in hops:
        results.append(import_hop(checkpoint, shape, args.num_requests, args.core_threads))
    for setup in setups if "end-to-end" in hops else []:
        results.append(
            await end_to_end(checkpoint, shape, args.num_requests, args.concurrency, args.core_threads, setup)
        )
    if "prefill" in hops:
        prefill_checkpoint = write_prefill_checkpoint(shape, Path(checkpoint).parent)
        results += await prefill_hop(prefill_checkpoint, shape, args.num_requests, args.device)
    return results


def ratios(results: list[HopResult]) -> dict[str, float]:
    """Each ipc hop's throughput over the same hop's over tcp in this run."""
    by_hop = {result.hop: result.num_bytes / result.seconds for result in results}
    return {
        f"{hop} ipc / tcp": round(by_hop[f"{hop} ipc"] / by_hop[f"{hop} tcp"], 2)
        for hop in ("wire", "end-to-end")
        if f"{hop} ipc" in by_hop and f"{hop} tcp" in by_hop
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--num-tokens", type=int, default=300, help="tokens of KV per request")
    parser.add_argument("--num-layers", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8, help="transfers in flight at once")
    parser.add_argument(
        "--core-threads", type=int, default=1, help="torch threads of the consumer (0: torch's default)"
    )
    parser.add_argument("--hops", nargs="+", default=["wire", "channel", "import", "end-to-end"],
                        choices=["wire", "channel", "import", "end-to-end", "prefill"])  # fmt: skip
    parser.add_argument(
        "--transport", nargs="+", default=["tcp"], choices=["tcp", "ipc"],
        help="KV transports of the wire and end-to-end hops (several: each, in this order)",
    )  # fmt: skip
    parser.add_argument("--device", default="cpu", help="where the KV lives at both ends: cpu or cuda")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.device not in ("cpu", "cuda") or (args.device == "cuda" and not torch.cuda.is_available()):
        parser.error(f"--device {args.device}: cpu, or cuda where a GPU is present")
    for name in (
        "num_requests",
        "num_tokens",
        "num_layers",
        "num_kv_heads",
        "head_dim",
        "block_size",
        "concurrency",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    shape = KVShape(
        args.num_layers, args.num_kv_heads, args.head_dim, args.dtype, args.num_tokens, args.block_size
    )
    if shape.layer_bytes // 2 < STAMP_BYTES:
        parser.error("a layer's K must hold at least 8 bytes (the time stamp)")
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_checkpoint(shape, Path(tmp))
        results = asyncio.run(run(args, shape, checkpoint))
    report = {
        "shape": asdict(shape),
        "num_requests": args.num_requests,
        "device": args.device,
        "hops": [result.summary() for result in results if not isinstance(result, PrefillResult)],
        "ratios": ratios(results),
        "prefill_handoff": prefill_summary([r for r in results if isinstance(r, PrefillResult)]),
    }
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
