"""One TCP connection as both KV transport sides use it, addresses, and the sender's pool of idle ones."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass, field

from services.kv_transport.wire import FrameReader, FrameWriter

LINGER_S = 1.0
"""After sending an error frame, how long the receiver keeps reading (and dropping) what the sender had
already written before closing; closing with unread data would reset the connection and could lose
the error frame on its way to the sender."""


def split_address(address: str) -> tuple[str, int]:
    """("host", port) from "host:port" or "[v6]:port"."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"KV address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _set_nodelay(writer: asyncio.StreamWriter) -> None:
    """Control frames are tiny; without TCP_NODELAY an ACK could wait out a delayed-ACK timer."""
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


@dataclass(eq=False)
class Connection:
    """A TCP connection speaking frames (`wire.py`) both ways."""

    reader: FrameReader
    writer: FrameWriter
    idle: bool = False
    """Waiting for the first frame of a transfer (so closing it loses nothing)."""

    @classmethod
    def wrap(cls, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, chunk_bytes: int) -> Connection:
        _set_nodelay(writer)
        # drain() then waits until everything written is in the kernel (or, with TLS, encrypted): uvloop
        # and the SSL layer keep references to the memory they have not sent yet, and a caller may reuse
        # its tensors once send_layer() returns. A TLS transport pauses at a buffer >= its high-water
        # mark (a plain one at > it), so 0 there would never let drain() return.
        tls = writer.get_extra_info("sslcontext") is not None
        writer.transport.set_write_buffer_limits(high=1 if tls else 0, low=0)
        return cls(FrameReader(reader), FrameWriter(writer, chunk_bytes))

    @property
    def stream(self) -> asyncio.StreamWriter:
        return self.writer.writer

    @property
    def usable(self) -> bool:
        return not self.stream.is_closing() and not self.reader.reader.at_eof()

    def abort(self) -> None:
        self.stream.transport.abort()

    async def close(self) -> None:
        self.stream.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.stream.wait_closed()


@dataclass
class Pool:
    """Idle connections per destination address."""

    max_idle: int
    idle: dict[str, list[Connection]] = field(default_factory=dict)

    def take(self, address: str) -> Connection | None:
        connections = self.idle.get(address, [])
        while connections:
            connection = connections.pop()
            if connection.usable:
                return connection
            connection.abort()
        return None

    def give(self, address: str, connection: Connection) -> bool:
        connections = self.idle.setdefault(address, [])
        if len(connections) >= self.max_idle or not connection.usable:
            return False
        connections.append(connection)
        return True

    def drain(self) -> list[Connection]:
        connections = [c for idle in self.idle.values() for c in idle]
        self.idle.clear()
        return connections
