"""The socket between a worker and its engine-core process: whole Python objects, framed.

A frame is pickle protocol 5 with its large buffers out of band: numpy arrays (a step's token ids)
and torch tensors (KV handed between prefill and decode, as uint8 bytes plus dtype and shape) are
written straight from their own memory with one `sendmsg`, and read straight into fresh writable
buffers that the unpickled arrays and tensors then wrap. Both ends are the same program, started
together, so pickle is safe here; nothing else connects to the socket.

    header   <QI>  pickle length, number of buffers
    lengths  <Q>   one per buffer
    pickle, then each buffer
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import pickle
import socket
import struct
import threading
from typing import Any

import numpy as np
import torch

HEADER = struct.Struct("<QI")
LENGTH = struct.Struct("<Q")
MAX_IOV = 512
"""Buffers per sendmsg call (the kernel's IOV_MAX is 1024)."""


class ChannelClosed(ConnectionError):
    """The other end closed the socket (its process exited or crashed)."""


def _rebuild_tensor(dtype: str, shape: tuple[int, ...], data: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(data).view(getattr(torch, dtype)).reshape(shape)


class _Pickler(pickle.Pickler):
    """Pickles a torch tensor as its bytes (a uint8 numpy view, out of band): no torch.save copy,
    and dtypes numpy lacks (bfloat16) still travel. A device tensor is copied to the host here."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            host = obj.detach().contiguous().cpu()
            data = host.reshape(-1).view(torch.uint8).numpy()
            return _rebuild_tensor, (str(host.dtype).removeprefix("torch."), tuple(host.shape), data)
        return NotImplemented


def pack(obj: Any) -> list[memoryview]:
    """`obj` as the parts of one frame, the large ones views of the objects' own memory."""
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    _Pickler(stream, protocol=5, buffer_callback=buffers.append).dump(obj)
    raws = [b.raw() for b in buffers]
    body = stream.getbuffer()
    head = HEADER.pack(len(body), len(raws)) + b"".join(LENGTH.pack(r.nbytes) for r in raws)
    return [memoryview(head), body, *raws]


def _unpack(body: bytes | bytearray, buffers: list[bytearray]) -> Any:
    return pickle.loads(body, buffers=buffers)


def _after(parts: list[memoryview], sent: int) -> list[memoryview]:
    """What of `parts` is left once their first `sent` bytes went out."""
    while parts and sent >= parts[0].nbytes:
        sent -= parts[0].nbytes
        parts = parts[1:]
    if parts and sent:
        parts = [parts[0][sent:], *parts[1:]]
    return parts


class BlockingChannel:
    """The engine-core end: blocking sends and receives. Frames are sent whole, one at a time: the
    core's KV-stream thread sends beside its step loop."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.sock.setblocking(True)
        self._send_lock = threading.Lock()

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, obj: Any) -> None:
        parts = [p for p in pack(obj) if p.nbytes]
        with self._send_lock:
            while parts:
                parts = _after(parts, self.sock.sendmsg(parts[:MAX_IOV]))

    def recv(self) -> Any:
        body_len, num_buffers = HEADER.unpack(self._read(HEADER.size))
        lengths = [LENGTH.unpack_from(self._read(LENGTH.size))[0] for _ in range(num_buffers)]
        body = self._read(body_len)
        return _unpack(body, [self._read(n) for n in lengths])

    def _read(self, num_bytes: int) -> bytearray:
        buffer = bytearray(num_bytes)
        view = memoryview(buffer)
        while view.nbytes:
            received = self.sock.recv_into(view)
            if received == 0:
                raise ChannelClosed("the worker closed the engine-core channel")
            view = view[received:]
        return buffer

    def close(self) -> None:
        self.sock.close()


class AsyncChannel:
    """The worker end, on its event loop: sends never block the loop, reads await the socket."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop):
        self.sock = sock
        self.sock.setblocking(False)
        self.loop = loop
        self._send_lock = asyncio.Lock()

    async def send(self, obj: Any) -> None:
        """Frames are written whole, one at a time, in call order: as much of each as the socket
        takes at once in one `sendmsg` (a small frame whole, so the core wakes once for it, not
        once per part), the rest as the socket drains."""
        parts = [p for p in pack(obj) if p.nbytes]
        async with self._send_lock:
            with contextlib.suppress(BlockingIOError, InterruptedError):  # full: all of it waits below
                parts = _after(parts, self.sock.sendmsg(parts[:MAX_IOV]))
            for part in parts:
                await self.loop.sock_sendall(self.sock, part)

    async def recv(self) -> Any:
        body_len, num_buffers = HEADER.unpack(await self._read(HEADER.size))
        lengths = struct.unpack(f"<{num_buffers}Q", await self._read(LENGTH.size * num_buffers))
        body = await self._read(body_len)
        buffers = [await self._read(n) for n in lengths]
        return _unpack(body, buffers)

    async def _read(self, num_bytes: int) -> bytearray:
        """`num_bytes` of the socket: first what it holds already, then as they come."""
        buffer = bytearray(num_bytes)
        view = memoryview(buffer)
        first = True
        while view.nbytes:
            received = self._received_now(view) if first else None
            if received is None:
                received = await self.loop.sock_recv_into(self.sock, view)
            if received == 0:
                raise ChannelClosed("the engine core closed its channel")
            view = view[received:]
            first = False
        return buffer

    def _received_now(self, view: memoryview) -> int | None:
        """Reads what the socket holds already into `view` (None: nothing yet). uvloop's
        `sock_recv_into` waits for the socket to be readable before reading, one turn of the loop
        per call even where the bytes are there: a frame of five parts took five. One read per part
        this way, so that a large frame still yields the loop between its chunks."""
        try:
            return self.sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            return None

    def close(self) -> None:
        self.sock.close()
