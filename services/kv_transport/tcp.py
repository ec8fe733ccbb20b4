"""The TCP KV transport: asyncio streams, the frame format of `wire.py`, one connection per transfer in
flight (connections are reused per destination once a transfer is acknowledged). This file holds the
transport and its receiving side; `tcp_sender.py` the sending sessions `open()` returns.

Receiver: one task per inbound connection reads frames; each verified layer goes on a small bounded
queue whose consumer task runs `on_layer`, so reading layer i + 1 off the socket overlaps the callback
storing layer i, and a slow callback pushes back on the sender through TCP flow control. The sender
pushes back the same way: every chunk written awaits `drain()`.

With a shared secret, each connection is authenticated both ways (`auth.py`) before its first
header; a peer that fails is refused and logged, and nothing it sent reaches a callback. With TLS
files (`tls.py`) every connection is mutual TLS.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from services.kv_transport.auth import authenticate_receiver, authenticate_sender, check_secret
from services.kv_transport.base import (
    KVAuthenticationError,
    KVCallbackError,
    KVConnectionError,
    KVExpectation,
    KVHeader,
    KVIntegrityError,
    KVTransferCancelled,
    KVTransferError,
    KVTransferRefused,
    KVTransferTimeout,
    KVTransport,
    OnDone,
    OnError,
    OnLayer,
    ReceivedLayer,
    ReceivedTransfer,
    TransferStats,
    TransportStats,
)
from services.kv_transport.connection import LINGER_S, Connection, Pool, join_address, split_address
from services.kv_transport.tcp_sender import TcpSendSession
from services.kv_transport.tls import TlsFiles
from services.kv_transport.wire import (
    PART,
    POSITION,
    PREFIX,
    FrameKind,
    FrameReader,
    decode_header,
    empty_tensor,
    encode_header,
    error_from_payload,
    error_payload,
    pack,
    unpack,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


async def _call(callback: Callable[[T], Awaitable[None] | None], arg: T) -> None:
    result = callback(arg)
    if inspect.isawaitable(result):
        await result


# ---- receiver ---------------------------------------------------------------------------------------


@dataclass
class _Expected:
    """A transfer the receiver waits for (registered by `expect()`)."""

    request_id: str
    on_layer: OnLayer
    on_done: OnDone
    on_error: OnError
    expectation: KVExpectation | None
    deadline: float
    timer: asyncio.TimerHandle | None = None
    task: asyncio.Task[ReceivedTransfer] | None = None
    """Receives the transfer once its header arrived."""
    cancelled: bool = False


class _LayerDelivery:
    """Runs `on_layer` for verified layers, in arrival order, in its own task; holds at most `depth` layers
    waiting. After a callback fails the rest are dropped, and `error` says why."""

    def __init__(self, on_layer: OnLayer, depth: int):
        self.on_layer = on_layer
        self.error: KVCallbackError | None = None
        self._queue: asyncio.Queue[ReceivedLayer | None] = asyncio.Queue(depth)
        self._task = asyncio.create_task(self._run())

    async def put(self, layer: ReceivedLayer) -> None:
        self._raise_if_failed()
        await self._queue.put(layer)

    async def finish(self) -> None:
        """Wait until every queued layer was delivered."""
        await self._queue.put(None)
        await self._task
        self._raise_if_failed()

    async def stop(self) -> None:
        """Cancel delivery and wait until no callback runs any more."""
        self._task.cancel()
        await asyncio.wait({self._task})

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    async def _run(self) -> None:
        while (layer := await self._queue.get()) is not None:
            if self.error is not None:
                continue
            try:
                await _call(self.on_layer, layer)
            except Exception as exc:
                logger.exception(
                    "on_layer failed for %s layer %s[%d]", layer.request_id, layer.cache, layer.index
                )
                self.error = KVCallbackError(
                    f"storing layer {layer.cache}[{layer.index}] failed: {exc!r}", layer.request_id
                )


# ---- the transport ----------------------------------------------------------------------------------


class TcpKVTransport(KVTransport):
    """KV transport over TCP; see the module docstring and `wire.py`."""

    name = "tcp"

    def __init__(
        self,
        *,
        connect_timeout_s: float = 5.0,
        ack_timeout_s: float = 60.0,
        chunk_bytes: int = 1 << 20,
        max_idle_connections: int = 4,
        delivery_depth: int = 2,
        read_buffer_bytes: int = 4 << 20,
        pin_memory: bool = False,
        secret: bytes | None = None,
        tls: TlsFiles | None = None,
    ):
        """
        connect_timeout_s: connecting to a receiver and its accepting the header.
        ack_timeout_s: from the sender's end frame to the receiver's acknowledgement (the receiver
            stores the last layers meanwhile).
        chunk_bytes: bytes written (and checksummed) between `drain()`s; reads take what has arrived.
        max_idle_connections: idle connections kept per destination for reuse.
        delivery_depth: verified layers a receiver holds while `on_layer` is busy.
        read_buffer_bytes: the stream reader's buffer limit on received connections.
        pin_memory: receive into page-locked CPU tensors (needs CUDA), so that the decode worker's copy
            to the GPU can be asynchronous.
        secret: the mesh's shared KV secret (at least 16 bytes): every connection proves it both ways
            before any KV moves, within `connect_timeout_s`. None: no authentication.
        tls: certificate, key and CA files for mutual TLS on every connection. None: plain TCP.
        """
        self.connect_timeout_s = connect_timeout_s
        self.ack_timeout_s = ack_timeout_s
        self.chunk_bytes = chunk_bytes
        self.delivery_depth = delivery_depth
        self.read_buffer_bytes = read_buffer_bytes
        self.pin_memory = pin_memory
        self.secret = None if secret is None else check_secret(secret)
        self._server_tls = tls.server_context() if tls else None
        self._client_tls = tls.client_context() if tls else None
        self.stats = TransportStats()
        self.address: str | None = None
        self._server: asyncio.Server | None = None
        self._expected: dict[str, _Expected] = {}
        self._handlers: set[asyncio.Task[Any]] = set()
        self._inbound: set[Connection] = set()
        self._closing = False
        self._callbacks: set[asyncio.Task[None]] = set()
        self._pool = Pool(max_idle_connections)
        self._sessions: set[TcpSendSession] = set()

    # -- receiver API --

    async def start(self, host: str = "0.0.0.0", port: int = 0, advertise_host: str | None = None) -> str:
        if self._server is not None:
            raise RuntimeError(f"KV transport already listening on {self.address}")
        self._server = await asyncio.start_server(
            self._serve,
            host,
            port,
            limit=self.read_buffer_bytes,
            ssl=self._server_tls,
            ssl_handshake_timeout=self.connect_timeout_s if self._server_tls else None,
        )
        bound_port = self._server.sockets[0].getsockname()[1]
        if advertise_host is None:
            advertise_host = socket.gethostname() if host in ("", "0.0.0.0", "::") else host
        self.address = join_address(advertise_host, bound_port)
        logger.info(
            "KV transport listening on %s:%d, advertised as %s", host or "*", bound_port, self.address
        )
        return self.address

    def expect(
        self,
        request_id: str,
        on_layer: OnLayer,
        on_done: OnDone,
        on_error: OnError,
        timeout_s: float = 60.0,
        expectation: KVExpectation | None = None,
    ) -> None:
        if self._closing:
            raise RuntimeError("the KV transport is closed")
        if request_id in self._expected:
            raise ValueError(f"a KV transfer for {request_id!r} is already expected")
        loop = asyncio.get_running_loop()
        expected = _Expected(request_id, on_layer, on_done, on_error, expectation, loop.time() + timeout_s)
        expected.timer = loop.call_later(timeout_s, self._expire, expected)
        self._expected[request_id] = expected

    def cancel(self, request_id: str) -> bool:
        expected = self._expected.pop(request_id, None)
        if expected is None:
            return False
        expected.cancelled = True
        if expected.timer is not None:
            expected.timer.cancel()
        if expected.task is not None:
            expected.task.cancel()
        return True

    @property
    def num_expected(self) -> int:
        """Transfers expected and not yet complete (registered, or being received)."""
        return len(self._expected)

    @property
    def num_inbound_connections(self) -> int:
        return len(self._inbound)

    # -- sender API --

    async def open(self, address: str, header: KVHeader, timeout_s: float | None = None) -> TcpSendSession:
        if self._closing:
            raise RuntimeError("the KV transport is closed")
        timeout_s = self.connect_timeout_s if timeout_s is None else timeout_s
        header_payload = encode_header(header)
        stats = TransferStats(header.request_id)
        connection = self._pool.take(address)
        if connection is not None:
            try:
                return await self._start_session(
                    address, connection, header, header_payload, stats, timeout_s
                )
            except KVConnectionError:
                logger.debug("idle KV connection to %s was stale; reconnecting", address)
        try:
            connection = await self._connect(address, timeout_s)
            return await self._start_session(address, connection, header, header_payload, stats, timeout_s)
        except KVTransferError as exc:
            self.stats.send_failures += 1
            exc.request_id = header.request_id
            raise

    async def close(self) -> None:
        """Stop accepting; let transfers already acknowledged or refused finish their last frame; cancel
        the rest (their senders get an error frame, their owners `on_error`); abort outgoing sessions."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        pending = list(self._expected.values())
        self._expected.clear()
        for expected in pending:
            expected.cancelled = True  # reported below, once, whatever stage each was in
            if expected.timer is not None:
                expected.timer.cancel()
            if expected.task is not None:
                expected.task.cancel()
        await self._stop_handlers()
        for expected in pending:
            await self._report(expected, KVTransferCancelled("KV transport closed", expected.request_id))
        for session in list(self._sessions):
            await session.abort("KV transport closed")
        for connection in self._pool.drain():
            connection.abort()
        await asyncio.gather(*self._callbacks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _stop_handlers(self) -> None:
        """Close idle inbound connections; busy handlers finish their transfer's last frame and see
        `_closing`. Whatever is still running after the grace period is aborted."""
        for connection in self._inbound:
            if connection.idle:
                connection.stream.close()
        if self._handlers:
            await asyncio.wait(self._handlers, timeout=2 * LINGER_S)
        for connection in self._inbound:
            connection.abort()
        if self._handlers:
            _, stuck = await asyncio.wait(self._handlers, timeout=LINGER_S)
            for task in stuck:  # a callback that never returns
                task.cancel()

    # -- receiving --

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        connection = Connection.wrap(reader, writer, self.chunk_bytes)
        self._handlers.add(task)
        self._inbound.add(connection)
        peer = writer.get_extra_info("peername")
        try:
            if self.secret is not None and not await self._authenticated(connection, peer):
                return
            while not self._closing and await self._receive_one(connection, peer):
                pass
        except KVTransferError as exc:
            logger.warning("KV connection from %s dropped: %s", peer, exc)
        except asyncio.CancelledError:
            # Only close() cancels a handler. Returning instead of raising keeps Python 3.11's stream
            # callback from calling exception() on a cancelled task (which logs a spurious error).
            pass
        except Exception:
            logger.exception("KV connection from %s failed", peer)
        finally:
            self._handlers.discard(task)
            self._inbound.discard(connection)
            connection.stream.close()  # graceful: an ACK or error frame still buffered goes out first

    async def _authenticated(self, connection: Connection, peer: object) -> bool:
        """Whether the peer proved it holds the secret; a peer that did not is told so and logged."""
        assert self.secret is not None
        try:
            await authenticate_sender(connection, self.secret, self.connect_timeout_s)
            return True
        except KVAuthenticationError as exc:
            self.stats.refused_peers += 1
            logger.warning("KV connection from %s refused: %s", peer, exc)
            with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError):
                refusal = KVAuthenticationError("authentication failed")
                await asyncio.wait_for(
                    connection.writer.write_control(FrameKind.ERROR, error_payload(refusal)), LINGER_S
                )
            return False

    async def _receive_one(self, connection: Connection, peer: object) -> bool:
        """Receive one transfer; True if the connection can carry another."""
        connection.idle = True
        try:
            frame = await connection.reader.next()
        finally:
            connection.idle = False
        if frame is None:
            return False
        bytes_before = connection.reader.num_bytes - PREFIX.size  # the prefix is already read
        stats = TransferStats("")
        try:
            header = decode_header(await connection.reader.read_control(frame))
            stats.request_id = header.request_id
            expected = self._admit(header)
        except KVTransferError as exc:
            # An expected transfer whose header is unusable fails; anything else is just refused.
            failed = (
                self._expected.pop(exc.request_id, None) if exc.request_id and exc.code == "refused" else None
            )
            await self._refuse(connection, exc, peer, failed)
            return False

        expected.task = asyncio.create_task(
            self._receive_body(connection, header, expected, stats, bytes_before)
        )
        try:
            error = await self._await_body(connection, expected, header)
        except BaseException:
            expected.task.cancel()
            raise
        if self._expected.get(header.request_id) is expected:
            del self._expected[header.request_id]
        if error is None:
            self._count_received(stats, ok=True)
            logger.debug(
                "KV received %s: %d bytes, %d layers in %.3f s (%.2f GiB/s)",
                header.request_id, stats.num_bytes, stats.num_layers, stats.seconds, stats.bytes_per_s / 2**30,
            )  # fmt: skip
            try:
                await connection.writer.write_control(FrameKind.ACK, pack({"request_id": header.request_id}))
            except (ConnectionError, OSError) as exc:
                logger.warning("KV sender %s left before the ACK of %s: %r", peer, header.request_id, exc)
                return False
            return True
        stats.num_bytes = connection.reader.num_bytes - bytes_before
        stats.finish()
        self._count_received(stats, ok=False)
        await self._refuse(connection, error, peer, None if expected.cancelled else expected)
        return False

    async def _await_body(
        self, connection: Connection, expected: _Expected, header: KVHeader
    ) -> KVTransferError | None:
        """Accept the header, then wait for the body task until the transfer's deadline; why it failed."""
        assert expected.task is not None
        error: KVTransferError | None = None
        try:
            await connection.writer.write_control(FrameKind.ACCEPT, pack(self._accept_fields(header)))
            remaining_s = max(expected.deadline - asyncio.get_running_loop().time(), 0.0)
            done, _ = await asyncio.wait({expected.task}, timeout=remaining_s)
        except (ConnectionError, OSError) as exc:
            done, error = set(), KVConnectionError(f"sender left: {exc!r}", header.request_id)
        if not done:  # stop reading, and let on_layer finish before on_error runs
            expected.task.cancel()
            await asyncio.wait({expected.task})
        return error or self._outcome(expected, bool(done), header)

    def _admit(self, header: KVHeader) -> _Expected:
        """The registration `header` belongs to, now bound to this connection; KVTransferRefused if none.
        The error carries the request id only when the registration fails with it."""
        expected = self._expected.get(header.request_id)
        if expected is None:
            raise KVTransferRefused(f"no KV transfer expected for request {header.request_id!r}")
        if expected.task is not None:
            raise KVTransferRefused(f"request {header.request_id!r} is already being received")
        problems = expected.expectation.problems(header) if expected.expectation else []
        if problems:
            raise KVTransferRefused(f"header does not fit: {'; '.join(problems)}", header.request_id)
        if expected.timer is not None:
            expected.timer.cancel()
        return expected

    @staticmethod
    def _outcome(expected: _Expected, in_time: bool, header: KVHeader) -> KVTransferError | None:
        assert expected.task is not None
        task = expected.task
        if not in_time:
            return KVTransferTimeout(
                f"transfer of {header.request_id!r} incomplete at its deadline", header.request_id
            )
        if task.cancelled():
            return KVTransferCancelled(
                f"transfer of {header.request_id!r} cancelled by the receiver", header.request_id
            )
        exc = task.exception()
        if exc is None:
            return None
        if isinstance(exc, KVTransferError):
            exc.request_id = header.request_id
            return exc
        return KVTransferError(f"receiving {header.request_id!r} failed: {exc!r}", header.request_id)

    async def _receive_body(
        self,
        connection: Connection,
        header: KVHeader,
        expected: _Expected,
        stats: TransferStats,
        bytes_before: int,
    ) -> ReceivedTransfer:
        """Read the frames after the header, deliver the layers, then call `on_done`."""
        delivery = _LayerDelivery(expected.on_layer, self.delivery_depth)
        received_layers: set[int] = set()
        parts: dict[int, _PartLayer] = {}
        tensors: dict[str, torch.Tensor] = {}
        reader = connection.reader
        try:
            while True:
                frame = await reader.next()
                if frame is None:
                    raise KVIntegrityError("sender closed the connection mid-transfer (truncated)")
                kind, length = frame
                if kind == FrameKind.LAYER:
                    layer = await self._read_layer(reader, header, length, received_layers)
                    if header.layer_position(layer.cache, layer.index) in parts:
                        raise KVIntegrityError(f"layer {layer.cache}[{layer.index}] sent whole and in parts")
                    stats.num_layers += 1
                    await delivery.put(layer)
                elif kind == FrameKind.LAYER_PART:
                    whole = await self._read_layer_part(reader, header, length, received_layers, parts)
                    if whole is not None:
                        stats.num_layers += 1
                        await delivery.put(whole)
                elif kind == FrameKind.TENSOR:
                    name, tensor = await self._read_tensor(reader, header, length, tensors)
                    tensors[name] = tensor
                elif kind == FrameKind.END:
                    extras = unpack(await reader.read_control(frame)).get("extras") or {}
                    break
                elif kind == FrameKind.ABORT:
                    message = unpack(await reader.read_control(frame)).get("message", "")
                    raise KVTransferCancelled(f"sender aborted: {message}")
                else:
                    await self._other_frame(connection, frame, header, stats, received_layers, tensors)
            self._check_complete(header, received_layers, tensors)
            await delivery.finish()
        finally:
            await delivery.stop()
        stats.num_bytes = reader.num_bytes - bytes_before
        stats.finish()
        if self._expected.get(header.request_id) is expected:  # complete: cancel() and close() pass it by
            del self._expected[header.request_id]
        done = ReceivedTransfer(header, {**header.extras, **extras}, tensors, stats)
        try:
            await _call(expected.on_done, done)
        except Exception as exc:
            logger.exception("on_done failed for %s", header.request_id)
            raise KVCallbackError(f"completing the transfer failed: {exc!r}") from None
        return done

    async def _read_layer(
        self, reader: FrameReader, header: KVHeader, length: int, received: set[int]
    ) -> ReceivedLayer:
        position = _read_position(
            await reader.read_bytes(POSITION.size), header.layer_shapes, received, "layer"
        )
        spec = header.layer_shapes[position]
        num_bytes = spec.num_bytes(header.dtype)
        if length != POSITION.size + 2 * num_bytes:
            raise KVIntegrityError(
                f"layer {spec.cache}[{spec.index}] frame has {length - POSITION.size} bytes, "
                f"expected {2 * num_bytes} for K and V of {list(spec.shape)} {header.dtype}"
            )
        key, key_bytes = empty_tensor(header.dtype, spec.shape, self.pin_memory)
        value, value_bytes = empty_tensor(header.dtype, spec.shape, self.pin_memory)
        await reader.read_into(key_bytes)
        await reader.read_into(value_bytes)
        await reader.finish()
        received.add(position)
        return ReceivedLayer(header.request_id, spec.cache, spec.index, key, value)

    async def _read_layer_part(
        self,
        reader: FrameReader,
        header: KVHeader,
        length: int,
        received: set[int],
        parts: dict[int, _PartLayer],
    ) -> ReceivedLayer | None:
        """Reads a part of a layer into the layer's tensors; returns the layer once it is whole."""
        position, first_block, num_blocks = PART.unpack(await reader.read_bytes(PART.size))
        position = _read_position(POSITION.pack(position), header.layer_shapes, received, "layer")
        spec = header.layer_shapes[position]
        block_bytes = spec.num_bytes(header.dtype) // max(spec.num_blocks, 1)
        if length != PART.size + 2 * num_blocks * block_bytes:
            raise KVIntegrityError(
                f"layer {spec.cache}[{spec.index}] part frame has {length - PART.size} bytes, "
                f"expected {2 * num_blocks * block_bytes} for K and V of {num_blocks} blocks"
            )
        layer = parts.get(position)
        if layer is None:
            layer = parts[position] = _PartLayer(
                empty_tensor(header.dtype, spec.shape, self.pin_memory),
                empty_tensor(header.dtype, spec.shape, self.pin_memory),
                [False] * spec.num_blocks,
            )
        blocks = range(first_block, first_block + num_blocks)
        if blocks.stop > spec.num_blocks or any(layer.received[b] for b in blocks):
            raise KVIntegrityError(
                f"layer {spec.cache}[{spec.index}] part of blocks [{blocks.start}, {blocks.stop}) overlaps "
                f"what came or passes its {spec.num_blocks} blocks"
            )
        for _, data in (layer.key, layer.value):
            await reader.read_into(data[first_block * block_bytes : blocks.stop * block_bytes])
        await reader.finish()
        for block in blocks:
            layer.received[block] = True
        if not all(layer.received):
            return None
        del parts[position]
        received.add(position)
        return ReceivedLayer(header.request_id, spec.cache, spec.index, layer.key[0], layer.value[0])

    async def _read_tensor(
        self, reader: FrameReader, header: KVHeader, length: int, received: dict[str, torch.Tensor]
    ) -> tuple[str, torch.Tensor]:
        positions = {header.tensor_position(name) for name in received}
        position = _read_position(await reader.read_bytes(POSITION.size), header.tensors, positions, "tensor")
        spec = header.tensors[position]
        if length != POSITION.size + spec.num_bytes:
            raise KVIntegrityError(
                f"tensor {spec.name!r} frame has {length - POSITION.size} bytes, "
                f"expected {spec.num_bytes} for {list(spec.shape)} {spec.dtype}"
            )
        tensor, tensor_bytes = empty_tensor(spec.dtype, spec.shape, self.pin_memory)
        await reader.read_into(tensor_bytes)
        await reader.finish()
        return spec.name, tensor

    def _accept_fields(self, header: KVHeader) -> dict[str, Any]:
        """What the ACCEPT frame tells the sender."""
        return {"request_id": header.request_id}

    async def _other_frame(
        self,
        connection: Connection,
        frame: tuple[FrameKind, int],
        header: KVHeader,
        stats: TransferStats,
        received_layers: set[int],
        tensors: dict[str, torch.Tensor],
    ) -> None:
        """A frame of a kind this transport does not take during a transfer."""
        raise KVIntegrityError(f"unexpected {frame[0].name} frame during a transfer")

    @staticmethod
    def _check_complete(
        header: KVHeader, received_layers: set[int], tensors: dict[str, torch.Tensor]
    ) -> None:
        missing = [
            f"layer {layer.cache}[{layer.index}]"
            for position, layer in enumerate(header.layer_shapes)
            if position not in received_layers
        ]
        missing += [f"tensor {t.name!r}" for t in header.tensors if t.name not in tensors]
        if missing:
            raise KVIntegrityError(f"transfer ended without {', '.join(missing)}")

    async def _refuse(
        self, connection: Connection, error: KVTransferError, peer: object, expected: _Expected | None
    ) -> None:
        """Tell the sender why (best effort), report to the receiver's owner, and close gracefully."""
        level = logging.DEBUG if self._closing else logging.WARNING
        logger.log(level, "KV transfer from %s refused or failed: %s", peer, error)
        with contextlib.suppress(KVTransferError, ConnectionError, OSError, asyncio.TimeoutError):
            await asyncio.wait_for(
                connection.writer.write_control(FrameKind.ERROR, error_payload(error)), LINGER_S
            )
        if expected is not None:
            await self._report(expected, error)
        with contextlib.suppress(KVTransferError, asyncio.TimeoutError):
            await asyncio.wait_for(_discard_until_eof(connection.reader), LINGER_S)

    def _expire(self, expected: _Expected) -> None:
        """The deadline of a transfer whose header never came."""
        if self._expected.get(expected.request_id) is not expected or expected.task is not None:
            return
        del self._expected[expected.request_id]
        self.stats.receive_failures += 1
        error = KVTransferTimeout(
            f"no KV transfer for {expected.request_id!r} arrived in time", expected.request_id
        )
        logger.warning("%s", error)
        task = asyncio.ensure_future(self._report(expected, error))
        self._callbacks.add(task)
        task.add_done_callback(self._callbacks.discard)

    @staticmethod
    async def _report(expected: _Expected, error: KVTransferError) -> None:
        try:
            await _call(expected.on_error, error)
        except Exception:
            logger.exception("on_error failed for %s", expected.request_id)

    def _count_received(self, stats: TransferStats, ok: bool) -> None:
        self.stats.bytes_received += stats.num_bytes
        if ok:
            self.stats.transfers_received += 1
            self.stats.receive_seconds += stats.seconds
        else:
            self.stats.receive_failures += 1

    # -- sending --

    async def _connect(self, address: str, timeout_s: float) -> Connection:
        host, port = split_address(address)
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, ssl=self._client_tls), timeout_s
            )
        except asyncio.TimeoutError:
            raise KVConnectionError(
                f"connecting to the KV receiver at {address} timed out after {timeout_s} s"
            ) from None
        except ssl.SSLError as exc:
            raise KVAuthenticationError(f"TLS with the KV receiver at {address} failed: {exc}") from None
        except OSError as exc:
            raise KVConnectionError(f"cannot reach the KV receiver at {address}: {exc}") from None
        connection = Connection.wrap(reader, writer, self.chunk_bytes)
        if self.secret is not None:
            try:
                await authenticate_receiver(connection, self.secret, timeout_s)
            except KVAuthenticationError as exc:
                connection.abort()
                raise KVAuthenticationError(f"KV receiver at {address}: {exc}") from None
        return connection

    async def _start_session(
        self,
        address: str,
        connection: Connection,
        header: KVHeader,
        header_payload: bytes,
        stats: TransferStats,
        timeout_s: float,
    ) -> TcpSendSession:
        """Send the header and wait for the receiver to accept it."""
        bytes_before = connection.writer.num_bytes
        try:
            await connection.writer.write_control(FrameKind.HEADER, header_payload)
            kind, payload = await asyncio.wait_for(connection.reader.next_control(), timeout_s)
        except asyncio.TimeoutError:
            connection.abort()
            raise KVTransferTimeout(
                f"the KV receiver at {address} did not answer the header within {timeout_s} s",
                header.request_id,
            ) from None
        except (ConnectionError, OSError) as exc:
            connection.abort()
            raise KVConnectionError(
                f"connection to the KV receiver at {address} lost: {exc!r}", header.request_id
            ) from None
        except KVTransferError as exc:
            connection.abort()
            exc.request_id = header.request_id
            raise
        if kind == FrameKind.ERROR:
            await connection.close()
            raise error_from_payload(payload, header.request_id)
        if kind == FrameKind.CHALLENGE:
            connection.abort()
            raise KVAuthenticationError(
                f"the KV receiver at {address} requires the KV secret, which this worker lacks",
                header.request_id,
            )
        if kind != FrameKind.ACCEPT or unpack(payload).get("request_id") != header.request_id:
            connection.abort()
            raise KVIntegrityError(
                f"the KV receiver at {address} answered {kind.name}, not ACCEPT", header.request_id
            )
        session = self._new_session(address, connection, header, stats, bytes_before, unpack(payload))
        self._sessions.add(session)
        return session

    def _new_session(
        self,
        address: str,
        connection: Connection,
        header: KVHeader,
        stats: TransferStats,
        bytes_before: int,
        accepted: dict[str, Any],
    ) -> TcpSendSession:
        """The session of a transfer whose header the receiver accepted with `accepted`."""
        return TcpSendSession(
            address, connection, header, stats, bytes_before, self.ack_timeout_s, self._finish_send
        )

    def _finish_send(self, session: TcpSendSession, reusable: Connection | None) -> None:
        """Book-keeping when a session ends; `reusable` is its connection if it ended cleanly."""
        self._sessions.discard(session)
        self.stats.bytes_sent += session.stats.num_bytes
        if reusable is None:
            self.stats.send_failures += 1
            return
        self.stats.transfers_sent += 1
        self.stats.send_seconds += session.stats.seconds
        if not self._pool.give(session.address, reusable):
            reusable.abort()


@dataclass
class _PartLayer:
    """A layer arriving in parts: its K and V (each a tensor and its bytes) and the blocks come."""

    key: tuple[torch.Tensor, memoryview]
    value: tuple[torch.Tensor, memoryview]
    received: list[bool]


def _read_position(data: bytes, specs: list[Any], received: set[int], what: str) -> int:
    (position,) = POSITION.unpack(data)
    if position >= len(specs):
        raise KVIntegrityError(f"{what} position {position} is out of range (the header lists {len(specs)})")
    if position in received:
        raise KVIntegrityError(f"{what} at position {position} sent twice")
    return position


async def _discard_until_eof(reader: FrameReader) -> None:
    stream = reader.reader
    with contextlib.suppress(ConnectionError, OSError):
        while await stream.read(1 << 20):
            pass
