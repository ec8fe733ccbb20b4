"""The worker <-> engine-core channel: whole objects, arrays and tensors out of band, any size."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import numpy as np
import pytest
import torch

from services.worker.channel import AsyncChannel, BlockingChannel, ChannelClosed


def roundtrip_objects() -> list[Any]:
    return [
        {"ids": np.arange(10, dtype=np.int32), "text": "héllo"},
        torch.randn(3, 4, dtype=torch.bfloat16),
        torch.arange(4 * 1024 * 1024, dtype=torch.float32).reshape(1024, 4096),  # 16 MiB: partial writes
        [torch.zeros(0), np.zeros(0, dtype=np.int64), b"", None],
    ]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and bool(np.array_equal(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


async def test_objects_cross_both_ways_intact_and_writable() -> None:
    ours, theirs = socket.socketpair()
    blocking = BlockingChannel(theirs)
    channel = AsyncChannel(ours, asyncio.get_running_loop())
    objects = roundtrip_objects()

    def echo() -> None:
        for _ in objects:
            blocking.send(blocking.recv())

    thread = threading.Thread(target=echo)
    thread.start()
    for obj in objects:
        await channel.send(obj)
    received = [await channel.recv() for _ in objects]
    thread.join()
    assert all(same(a, b) for a, b in zip(objects, received))
    received[1].add_(1)  # received tensors own writable memory
    channel.close()
    blocking.close()


async def test_a_closed_end_is_reported() -> None:
    ours, theirs = socket.socketpair()
    channel = AsyncChannel(ours, asyncio.get_running_loop())
    theirs.close()
    with pytest.raises(ChannelClosed):
        await channel.recv()
    channel.close()


class CountingSocket(socket.socket):
    """A socket that counts its writes."""

    num_writes = 0

    def send(self, data: Any, flags: int = 0) -> int:
        CountingSocket.num_writes += 1
        return super().send(data, flags)

    def sendmsg(self, buffers: Any, *args: Any) -> int:
        CountingSocket.num_writes += 1
        return super().sendmsg(buffers, *args)


async def test_a_small_frame_leaves_the_worker_end_in_one_write() -> None:
    """Header, pickle and out-of-band arrays go in one `sendmsg`: the core, woken by the frame's
    first bytes, finds all of it there instead of blocking for the rest."""
    ours, theirs = socket.socketpair()
    counted = CountingSocket(fileno=ours.detach())
    channel = AsyncChannel(counted, asyncio.get_running_loop())
    blocking = BlockingChannel(theirs)
    message = {"token_ids": np.arange(64, dtype=np.int32), "cu": np.arange(3, dtype=np.int32), "text": "x"}
    CountingSocket.num_writes = 0
    await channel.send(message)
    assert CountingSocket.num_writes == 1
    assert same(blocking.recv(), message)
    channel.close()
    blocking.close()


async def test_a_frame_already_in_the_socket_is_read_without_waiting_on_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step batch that is whole in the socket when the worker reads it (the core wrote it in one
    `sendmsg`) costs the worker's loop no turn per part: uvloop's `sock_recv_into` waits for the
    socket to be readable first, even where the bytes are there."""
    ours, theirs = socket.socketpair()
    loop = asyncio.get_running_loop()
    channel = AsyncChannel(ours, loop)
    blocking = BlockingChannel(theirs)
    waits = 0
    sock_recv_into = loop.sock_recv_into

    async def counted(sock: socket.socket, buffer: Any) -> int:
        nonlocal waits
        waits += 1
        return await sock_recv_into(sock, buffer)

    monkeypatch.setattr(loop, "sock_recv_into", counted)
    batch = {"token_ids": np.arange(64, dtype=np.int32), "cu": np.arange(3, dtype=np.int32), "text": "x"}
    blocking.send(batch)
    assert same(await channel.recv(), batch)
    assert waits == 0
    sent = threading.Timer(0.2, blocking.send, [batch])  # not there yet: the read waits for it
    sent.start()
    assert same(await channel.recv(), batch)
    sent.join()
    assert waits == 1
    channel.close()
    blocking.close()
