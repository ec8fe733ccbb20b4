"""The KV transport's wire format (version 1), for stream transports (TCP).

Every frame, both directions:

    kind: u8 | length: u64 | payload: `length` bytes | crc32: u32      (integers big-endian)

`crc32` is `zlib.crc32` over kind, length and payload together, so a corrupted length or kind fails
too. CRC-32 rather than BLAKE2b: it detects every burst error up to 32 bits and random corruption
with probability 1 - 2**-32, which is what a checksum against transmission and memory errors needs
(it is not a defence against an attacker: the mesh trusts its network), and zlib's runs at about
4 GiB/s against BLAKE2b's 0.9 GiB/s on one core, so it stays out of the way of a 10+ Gbit/s link.
It is computed chunk by chunk as bytes are written and read, so neither side makes a second pass.

Sender -> receiver, in order (layers and tensors in any order, each exactly once):

    HEADER  b"SMKV" | version: u16 | msgpack(KVHeader.model_dump())
    LAYER   position: u32 (index into header.layer_shapes) | K bytes | V bytes   (one frame per layer)
    LAYER_PART  position: u32 | first_block: u32 | num_blocks: u32 | K bytes | V bytes
            (blocks [first_block, first_block + num_blocks) of a layer: a layer sent in parts, as a
            chunked prefill computes them; its parts cover its blocks once each, and it counts as
            received, and is delivered, once the last arrives)
    TENSOR  position: u32 (index into header.tensors) | tensor bytes
    END     msgpack({"extras": {...}})
    ABORT   msgpack({"message": str})              (the sender gives up; the connection closes)
    SHARED  msgpack(SharedKV.model_dump())         (ipc: every layer and tensor, by handle, instead)

Receiver -> sender:

    ACCEPT  msgpack({"request_id": str, "host": str})  (after HEADER: the transfer is expected and fits;
                                                    "host" only from an ipc receiver)
    SHARED_TAKEN    msgpack({})                    (after SHARED: the KV is copied; END follows)
    SHARED_REFUSED  msgpack({"message": str})      (after SHARED: not opened; the layers follow)
    ACK     msgpack({"request_id": str})           (after END: everything verified and stored)
    ERROR   msgpack({"request_id": str | None, "code": str, "message": str})  (the connection closes)

With a shared secret, every connection starts with the handshake of `auth.py` (CHALLENGE, RESPONSE,
PROOF: raw nonces and HMACs as payloads) before its first HEADER.

After ACK the connection may carry the next transfer, starting again with HEADER. Tensor bytes are
the tensor's memory in native (little-endian on every supported host) byte order, C-contiguous; the
receiver reads them straight into a new tensor's memory (`empty_tensor`), verifying as it goes.
Control frames (everything but LAYER, LAYER_PART and TENSOR) are at most `MAX_CONTROL_FRAME_BYTES`;
LAYER, LAYER_PART and TENSOR frames must have exactly the size the header implies.
"""

from __future__ import annotations

import asyncio
import struct
import zlib
from collections.abc import Sequence
from enum import IntEnum
from typing import Any

import msgpack
import torch
from pydantic import ValidationError

from services.kv_transport.base import (
    DTYPES,
    ERRORS_BY_CODE,
    KVConnectionError,
    KVHeader,
    KVIntegrityError,
    KVTransferError,
    KVTransferRefused,
)
from shared.errors import describe_validation_error

MAGIC = b"SMKV"
WIRE_VERSION = 1
MAX_CONTROL_FRAME_BYTES = 1 << 20

PREFIX = struct.Struct("!BQ")
TRAILER = struct.Struct("!I")
POSITION = struct.Struct("!I")
PART = struct.Struct("!III")
"""A LAYER_PART frame's position, first block and number of blocks."""
PREAMBLE = struct.Struct("!4sH")


class FrameKind(IntEnum):
    HEADER = 1
    LAYER = 2
    TENSOR = 3
    END = 4
    ABORT = 5
    SHARED = 6
    LAYER_PART = 7
    ACCEPT = 16
    ACK = 17
    ERROR = 18
    SHARED_TAKEN = 19
    SHARED_REFUSED = 20
    CHALLENGE = 32
    RESPONSE = 33
    PROOF = 34


CONTROL_KINDS = frozenset(FrameKind) - {FrameKind.LAYER, FrameKind.LAYER_PART, FrameKind.TENSOR}


# ---- payloads ---------------------------------------------------------------------------------------


def pack(value: Any) -> bytes:
    """msgpack, with a ValueError naming the problem when `value` holds something msgpack cannot carry."""
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"not msgpack-serialisable: {exc}") from None


def unpack(payload: bytes) -> dict[str, Any]:
    try:
        value = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise KVIntegrityError(f"undecodable control frame: {exc}") from None
    if not isinstance(value, dict):
        raise KVIntegrityError(f"control frame holds {type(value).__name__}, not a map")
    return value


def encode_header(header: KVHeader) -> bytes:
    return PREAMBLE.pack(MAGIC, WIRE_VERSION) + pack(header.model_dump(mode="python"))


def decode_header(payload: bytes) -> KVHeader:
    """The header of a HEADER frame; `KVTransferRefused` (with the request id when readable) if invalid."""
    if len(payload) < PREAMBLE.size:
        raise KVIntegrityError("header frame too short to hold the magic and version")
    magic, version = PREAMBLE.unpack_from(payload)
    if magic != MAGIC:
        raise KVIntegrityError(f"not a specmesh KV stream (magic {magic!r}, expected {MAGIC!r})")
    if version != WIRE_VERSION:
        raise KVTransferRefused(f"KV wire version {version} not supported (this side speaks {WIRE_VERSION})")
    fields = unpack(payload[PREAMBLE.size :])
    request_id = fields.get("request_id")
    try:
        return KVHeader.model_validate(fields)
    except ValidationError as exc:
        raise KVTransferRefused(
            f"invalid KV header: {describe_validation_error(exc)}",
            request_id if isinstance(request_id, str) else None,
        ) from None


def error_payload(error: KVTransferError) -> bytes:
    return pack({"request_id": error.request_id, "code": error.code, "message": str(error)})


def error_from_payload(payload: bytes, request_id: str | None = None) -> KVTransferError:
    """The receiver's error frame as the exception of its code, its message prefixed "receiver: "."""
    fields = unpack(payload)
    error_cls = ERRORS_BY_CODE.get(str(fields.get("code")), KVTransferError)
    return error_cls(f"receiver: {fields.get('message', '')}", fields.get("request_id") or request_id)


def encode_frame(kind: FrameKind, *parts: bytes | memoryview) -> bytes:
    """One whole frame in memory (control frames, tests)."""
    prefix = PREFIX.pack(kind, sum(len(part) for part in parts))
    crc = zlib.crc32(prefix)
    for part in parts:
        crc = zlib.crc32(part, crc)
    return b"".join([prefix, *parts, TRAILER.pack(crc)])


# ---- tensors ----------------------------------------------------------------------------------------


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, flat; no copy for a contiguous CPU tensor (one device-to-host copy otherwise).
    The uint8 view makes this work for dtypes numpy lacks (bfloat16, float8)."""
    flat = tensor.detach().contiguous().cpu().reshape(-1)
    return flat.view(torch.uint8).numpy().data.cast("B")


def empty_tensor(
    dtype: str, shape: Sequence[int], pin_memory: bool = False
) -> tuple[torch.Tensor, memoryview]:
    """A new CPU tensor and a writable view of its bytes, to receive into: the bytes land in the tensor's
    own memory (page-locked with `pin_memory`, so the callback's copy to the GPU can be asynchronous)."""
    tensor = torch.empty(tuple(shape), dtype=DTYPES[dtype], pin_memory=pin_memory)
    return tensor, tensor.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def tensor_from_bytes(buffer: bytearray, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    """A CPU tensor over `buffer`'s memory (no copy); `buffer` must be writable, hence a bytearray."""
    if len(buffer) == 0:
        return torch.empty(tuple(shape), dtype=DTYPES[dtype])
    return torch.frombuffer(buffer, dtype=torch.uint8).view(DTYPES[dtype]).reshape(tuple(shape))


# ---- streams ----------------------------------------------------------------------------------------


class FrameWriter:
    """Writes frames to a stream, `chunk_bytes` at a time, awaiting `drain()` between chunks (backpressure)."""

    def __init__(self, writer: asyncio.StreamWriter, chunk_bytes: int = 1 << 20):
        self.writer = writer
        self.chunk_bytes = chunk_bytes
        self.num_bytes = 0

    async def write(self, kind: FrameKind, parts: Sequence[bytes | memoryview]) -> None:
        length = sum(len(part) for part in parts)
        prefix = PREFIX.pack(kind, length)
        crc = zlib.crc32(prefix)
        self.writer.write(prefix)
        for part in parts:
            view = memoryview(part)
            for start in range(0, len(view), self.chunk_bytes):
                chunk = view[start : start + self.chunk_bytes]
                crc = zlib.crc32(chunk, crc)
                self.writer.write(chunk)
                await self.writer.drain()
        self.writer.write(TRAILER.pack(crc))
        await self.writer.drain()
        self.num_bytes += PREFIX.size + length + TRAILER.size

    async def write_control(self, kind: FrameKind, payload: bytes) -> None:
        await self.write(kind, [payload])


class FrameReader:
    """Reads frames from a stream, verifying each frame's CRC in `finish()` before its data is used.

    `next()` starts a frame; `read_into()` / `read_bytes()` consume its payload; `finish()` checks that the
    payload was consumed exactly and that the trailer matches.
    """

    def __init__(self, reader: asyncio.StreamReader):
        self.reader = reader
        self.num_bytes = 0
        self._crc = 0
        self._remaining = 0

    async def next(self) -> tuple[FrameKind, int] | None:
        """Kind and payload length of the next frame; None if the peer closed cleanly between frames."""
        prefix = await self._read(PREFIX.size, allow_eof=True)
        if not prefix:
            return None
        kind, length = PREFIX.unpack(prefix)
        if kind not in FrameKind._value2member_map_:
            raise KVIntegrityError(f"unknown frame kind {kind}")
        self._crc = zlib.crc32(prefix)
        self._remaining = length
        return FrameKind(kind), length

    async def read_bytes(self, size: int) -> bytes:
        self._take(size)
        data = await self._read(size)
        self._crc = zlib.crc32(data, self._crc)
        return data

    async def read_into(self, view: memoryview) -> None:
        """Fill `view` with the next `len(view)` payload bytes, taking whatever the stream holds each time
        (taking less than all of it would shift the rest of the stream's buffer down)."""
        self._take(len(view))
        filled = 0
        while filled < len(view):
            chunk = await self._read_some(len(view) - filled)
            view[filled : filled + len(chunk)] = chunk
            self._crc = zlib.crc32(chunk, self._crc)
            filled += len(chunk)

    async def finish(self) -> None:
        if self._remaining:
            raise KVIntegrityError(f"frame has {self._remaining} bytes more than expected")
        (crc,) = TRAILER.unpack(await self._read(TRAILER.size))
        if crc != self._crc:
            raise KVIntegrityError(
                f"frame checksum mismatch (crc32 {crc:#010x} on the wire, {self._crc:#010x} computed)"
            )

    async def read_control(self, frame: tuple[FrameKind, int]) -> bytes:
        """The whole verified payload of a control frame already started with `next()`."""
        kind, length = frame
        if kind not in CONTROL_KINDS:
            raise KVIntegrityError(f"expected a control frame, got {kind.name}")
        if length > MAX_CONTROL_FRAME_BYTES:
            raise KVIntegrityError(f"{kind.name} frame of {length} bytes exceeds {MAX_CONTROL_FRAME_BYTES}")
        payload = await self.read_bytes(length)
        await self.finish()
        return payload

    async def next_control(self) -> tuple[FrameKind, bytes]:
        """The next frame, which must be a control frame; KVConnectionError if the peer closed instead."""
        frame = await self.next()
        if frame is None:
            raise KVConnectionError("the peer closed the connection")
        return frame[0], await self.read_control(frame)

    def _take(self, size: int) -> None:
        if size > self._remaining:
            raise KVIntegrityError(f"frame payload is {self._remaining} bytes short")
        self._remaining -= size

    async def _read(self, size: int, allow_eof: bool = False) -> bytes:
        try:
            data = await self.reader.readexactly(size)
        except asyncio.IncompleteReadError as exc:
            if allow_eof and not exc.partial:
                return b""
            raise KVIntegrityError(
                f"connection closed mid-frame (truncated after {len(exc.partial)} bytes)"
            ) from None
        except (ConnectionError, OSError) as exc:
            raise KVConnectionError(f"connection lost: {exc!r}") from None
        self.num_bytes += size
        return data

    async def _read_some(self, size: int) -> bytes:
        try:
            data = await self.reader.read(size)
        except (ConnectionError, OSError) as exc:
            raise KVConnectionError(f"connection lost: {exc!r}") from None
        if not data:
            raise KVIntegrityError("connection closed mid-frame (truncated)")
        self.num_bytes += len(data)
        return data
