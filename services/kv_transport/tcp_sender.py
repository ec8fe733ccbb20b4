"""The sending side of a TCP KV transfer: one session per request, over one connection."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from services.kv_transport.base import (
    DTYPES,
    KVConnectionError,
    KVHeader,
    KVIntegrityError,
    KVSendSession,
    KVTransferCancelled,
    KVTransferError,
    KVTransferTimeout,
    TransferStats,
)
from services.kv_transport.connection import LINGER_S, Connection
from services.kv_transport.wire import (
    PART,
    POSITION,
    FrameKind,
    error_from_payload,
    pack,
    tensor_bytes,
    unpack,
)


class TcpSendSession(KVSendSession):
    """One outgoing transfer over one connection. Sends are serialised; a receiver's error frame (read by
    a watcher task) makes the next call, or the one in progress, raise that error."""

    def __init__(
        self,
        address: str,
        connection: Connection,
        header: KVHeader,
        stats: TransferStats,
        bytes_before: int,
        ack_timeout_s: float,
        on_finish: Callable[[TcpSendSession, Connection | None], None],
    ):
        """`stats` started when `open()` was called; `bytes_before`: the connection's byte count before the
        header. `on_finish` runs once when the session ends, with its connection if it can be reused."""
        self.header = header
        self.address = address
        self.stats = stats
        self._bytes_before = bytes_before
        self._ack_timeout_s = ack_timeout_s
        self._on_finish = on_finish
        self._connection = connection
        self._lock = asyncio.Lock()
        self._sent_layers: set[int] = set()
        self._sent_blocks: dict[int, int] = {}
        """Blocks sent of each layer sent in parts and not complete yet."""
        self._sent_tensors: set[int] = set()
        self._error: KVTransferError | None = None
        self._closed = False
        self._watcher = asyncio.create_task(self._watch())

    @property
    def closed(self) -> bool:
        return self._closed

    async def send_layer(self, cache: str, index: int, key: torch.Tensor, value: torch.Tensor) -> None:
        # key, value: [num_blocks, block_size, num_kv_heads, head_dim]
        position = self._position(self.header.layer_position, cache, index)
        if position in self._sent_layers:
            raise ValueError(f"layer {cache}[{index}] of {self.header.request_id!r} already sent")
        spec = self.header.layer_shapes[position]
        for what, tensor in (("key", key), ("value", value)):
            self._check_tensor(f"layer {cache}[{index}] {what}", tensor, spec.shape, self.header.dtype)
        await self._send(FrameKind.LAYER, [POSITION.pack(position), tensor_bytes(key), tensor_bytes(value)])
        self._sent_layers.add(position)
        self.stats.num_layers += 1

    async def send_layer_part(
        self, cache: str, index: int, first_block: int, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        # key, value: [num_blocks of the part, block_size, num_kv_heads, head_dim]
        position = self._position(self.header.layer_position, cache, index)
        if position in self._sent_layers:
            raise ValueError(f"layer {cache}[{index}] of {self.header.request_id!r} already sent")
        spec = self.header.layer_shapes[position]
        num_blocks = int(key.shape[0]) if key.dim() else 0
        if first_block < 0 or first_block + num_blocks > spec.num_blocks:
            raise ValueError(
                f"blocks [{first_block}, {first_block + num_blocks}) of layer {cache}[{index}] are out of "
                f"its {spec.num_blocks}"
            )
        shape = (num_blocks, *spec.shape[1:])
        for what, tensor in (("key", key), ("value", value)):
            self._check_tensor(f"layer {cache}[{index}] {what} part", tensor, shape, self.header.dtype)
        header = PART.pack(position, first_block, num_blocks)
        await self._send(FrameKind.LAYER_PART, [header, tensor_bytes(key), tensor_bytes(value)])
        sent = self._sent_blocks.get(position, 0) + num_blocks
        self._sent_blocks[position] = sent
        if sent >= spec.num_blocks:
            del self._sent_blocks[position]
            self._sent_layers.add(position)
            self.stats.num_layers += 1

    async def send_tensor(self, name: str, tensor: torch.Tensor) -> None:
        position = self._position(self.header.tensor_position, name)
        if position in self._sent_tensors:
            raise ValueError(f"tensor {name!r} of {self.header.request_id!r} already sent")
        spec = self.header.tensors[position]
        self._check_tensor(f"tensor {name!r}", tensor, spec.shape, spec.dtype)
        await self._send(FrameKind.TENSOR, [POSITION.pack(position), tensor_bytes(tensor)])
        self._sent_tensors.add(position)

    async def close(self, extras: Mapping[str, Any] | None = None) -> TransferStats:
        self._check_open()
        missing = [
            f"{layer.cache}[{layer.index}]"
            for position, layer in enumerate(self.header.layer_shapes)
            if position not in self._sent_layers
        ]
        missing += [
            t.name for position, t in enumerate(self.header.tensors) if position not in self._sent_tensors
        ]
        if missing:
            raise ValueError(
                f"cannot close the transfer of {self.header.request_id!r}: not sent: {', '.join(missing)}"
            )
        await self._send(FrameKind.END, [pack({"extras": dict(extras or {})})])
        try:
            await asyncio.wait_for(asyncio.shield(self._watcher), self._ack_timeout_s)
        except asyncio.TimeoutError:
            await self._fail(KVTransferTimeout(f"no acknowledgement within {self._ack_timeout_s} s"))
        if self._error is not None:
            await self._fail(self._error)
        self._closed = True
        self.stats.num_bytes = self._wire_bytes()
        self.stats.finish()
        self._on_finish(self, self._connection)
        return self.stats

    async def abort(self, reason: str = "aborted by sender") -> None:
        if self._closed:
            return
        self._closed = True
        self._watcher.cancel()
        if not self._lock.locked() and self._error is None and self._connection.usable:
            with contextlib.suppress(KVTransferError, asyncio.TimeoutError, ConnectionError, OSError):
                await asyncio.wait_for(
                    self._connection.writer.write_control(FrameKind.ABORT, pack({"message": reason})), 1.0
                )
        self._connection.abort()
        self.stats.num_bytes = self._wire_bytes()
        self.stats.finish()
        self._on_finish(self, None)

    # -- helpers --

    def _check_open(self) -> None:
        if self._closed:
            raise KVTransferCancelled(
                f"the transfer of {self.header.request_id!r} is closed", self.header.request_id
            )

    def _position(self, lookup: Callable[..., int], *key: Any) -> int:
        self._check_open()
        try:
            return lookup(*key)
        except KeyError as exc:
            raise ValueError(exc.args[0]) from None

    @staticmethod
    def _check_tensor(what: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: str) -> None:
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != DTYPES[dtype]:
            raise ValueError(
                f"{what} is {list(tensor.shape)} {tensor.dtype}, the header says {list(shape)} {DTYPES[dtype]}"
            )

    async def _send(self, kind: FrameKind, parts: list[bytes | memoryview]) -> None:
        async with self._lock:
            if self._error is not None:
                await self._fail(self._error)
            self._check_open()  # abort() may have run while this waited for the lock
            try:
                await self._connection.writer.write(kind, parts)
            except (ConnectionError, OSError, RuntimeError) as exc:
                # The receiver most likely sent an error frame and closed: report its reason if it came.
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._watcher), LINGER_S)
                await self._fail(
                    self._error or KVConnectionError(f"connection to {self.address} lost: {exc!r}")
                )
            if self._error is not None:
                await self._fail(self._error)

    async def _fail(self, error: KVTransferError) -> None:
        """Close the session and raise `error` (with this request's id)."""
        error.request_id = error.request_id or self.header.request_id
        if not self._closed:
            self._closed = True
            self._watcher.cancel()
            self._connection.abort()
            self.stats.num_bytes = self._wire_bytes()
            self.stats.finish()
            self._on_finish(self, None)
        raise error

    def _interim(self, kind: FrameKind, payload: bytes) -> bool:
        """Whether `kind` is an answer mid-transfer that this session takes (then the watcher goes on
        waiting for the final one)."""
        return False

    async def _watch(self) -> None:
        """Wait for the receiver's one answer to the transfer: ACK, or ERROR at any time."""
        try:
            kind, payload = await self._connection.reader.next_control()
            while self._interim(kind, payload):
                kind, payload = await self._connection.reader.next_control()
            if kind == FrameKind.ERROR:
                self._error = error_from_payload(payload, self.header.request_id)
            elif kind != FrameKind.ACK:
                self._error = KVIntegrityError(f"receiver sent {kind.name} where ACK or ERROR was due")
            elif (acked := unpack(payload).get("request_id")) != self.header.request_id:
                self._error = KVIntegrityError(f"receiver acknowledged {acked!r} instead")
            else:
                return
        except KVTransferError as exc:
            self._error = exc
        # Unblock a send stuck in drain(); it then raises `self._error`.
        self._connection.abort()

    def _wire_bytes(self) -> int:
        return self._connection.writer.num_bytes - self._bytes_before
