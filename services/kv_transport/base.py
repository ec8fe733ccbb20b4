"""The KV transport's data model and interface, shared by every implementation (TCP now, NCCL later).

Terms:
- *transfer*: everything one prefill worker sends one decode worker for one request: a header, the
  K and V of every layer of every cache, named extra tensors, extras, an end mark.
- *cache*: one model's KV cache. The target model's layers, a draft model's layers and an MTP head's
  layer are all just layers, each tagged with its cache name and its index in that cache.
- *layer*: the K and V of one attention layer for the request's blocks, each
  `[num_blocks, block_size, num_kv_heads, head_dim]`.

The receiver (decode worker) registers what it expects with `expect()` before the sender (prefill
worker) calls `open()`; the scheduler's Reserve/ReserveReply handshake orders the two. Layers are
delivered one by one as they are verified, while the next is still on the wire (the decode worker
collects them and hands its engine core the whole request at the end).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}
"""Wire dtype names; a header naming any other dtype is refused."""

KNOWN_CACHES = ("target", "draft", "mtp", "eagle3")
"""Cache names the workers use; others are allowed (a transport does not interpret them)."""


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype (`torch.bfloat16` -> "bfloat16")."""
    for name, known in DTYPES.items():
        if known == dtype:
            return name
    raise ValueError(f"dtype {dtype} cannot be sent; known: {', '.join(DTYPES)}")


def _check_dtype(name: str) -> str:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}")
    return name


def _num_elements(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


# ---- the header -------------------------------------------------------------------------------------


class LayerShape(BaseModel):
    """One layer of one cache: K and V each have `shape` = [num_blocks, block_size, num_kv_heads, head_dim]."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cache: str = Field(min_length=1, max_length=64)
    """Which cache the layer belongs to: "target", "draft", "mtp", ..."""
    index: int = Field(ge=0)
    """The layer's index within its cache."""
    shape: tuple[int, int, int, int]

    @field_validator("shape")
    @classmethod
    def _non_negative(cls, shape: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
        if any(dim < 0 for dim in shape):
            raise ValueError(f"negative dimension in {list(shape)}")
        return shape

    @property
    def num_blocks(self) -> int:
        return self.shape[0]

    def num_bytes(self, dtype: str) -> int:
        """Bytes of K alone (V is the same size)."""
        return _num_elements(self.shape) * DTYPES[dtype].itemsize


class TensorSpec(BaseModel):
    """A named extra tensor sent after the layers (e.g. a drafting model's state, [hidden_size])."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=128)
    shape: tuple[int, ...]
    dtype: str

    @field_validator("dtype")
    @classmethod
    def _dtype_known(cls, value: str) -> str:
        return _check_dtype(value)

    @field_validator("shape")
    @classmethod
    def _non_negative(cls, shape: tuple[int, ...]) -> tuple[int, ...]:
        if any(dim < 0 for dim in shape):
            raise ValueError(f"negative dimension in {list(shape)}")
        return shape

    @property
    def num_bytes(self) -> int:
        return _num_elements(self.shape) * DTYPES[self.dtype].itemsize


class KVHeader(BaseModel):
    """What a transfer carries; the first frame on the wire. Msgpack-serialisable via `model_dump()`."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=256)
    num_tokens: int = Field(ge=0)
    """Tokens whose KV is sent; every layer holds at most ceil(num_tokens / block_size) blocks."""
    block_size: int = Field(ge=1)
    dtype: str
    """dtype of every layer's K and V (a key of `DTYPES`)."""
    layer_shapes: list[LayerShape] = Field(default_factory=list)
    """Layers in the order the sender means to send them (any order is accepted, each exactly once)."""
    extras: dict[str, Any] = Field(default_factory=dict)
    """Small msgpack-able values (e.g. "first_token_id"); `close(extras=...)` may add more."""
    tensors: list[TensorSpec] = Field(default_factory=list)

    @field_validator("dtype")
    @classmethod
    def _dtype_known(cls, value: str) -> str:
        return _check_dtype(value)

    @model_validator(mode="after")
    def _consistent(self) -> KVHeader:
        max_blocks = -(-self.num_tokens // self.block_size)
        seen: set[tuple[str, int]] = set()
        for layer in self.layer_shapes:
            key = (layer.cache, layer.index)
            if key in seen:
                raise ValueError(f"layer {layer.cache}[{layer.index}] listed twice")
            seen.add(key)
            if layer.shape[1] != self.block_size:
                raise ValueError(
                    f"layer {layer.cache}[{layer.index}] has block size {layer.shape[1]}, header says {self.block_size}"
                )
            if layer.num_blocks > max_blocks:
                raise ValueError(
                    f"layer {layer.cache}[{layer.index}] has {layer.num_blocks} blocks; "
                    f"{self.num_tokens} tokens fill at most {max_blocks}"
                )
        names = [tensor.name for tensor in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"tensor names repeat: {names}")
        return self

    @property
    def num_bytes(self) -> int:
        """Payload bytes of the whole transfer: K and V of every layer plus the extra tensors."""
        layers = sum(2 * layer.num_bytes(self.dtype) for layer in self.layer_shapes)
        return layers + sum(tensor.num_bytes for tensor in self.tensors)

    def layer_position(self, cache: str, index: int) -> int:
        """Position of layer `cache`[`index`] in `layer_shapes`; KeyError if the header lacks it."""
        for position, layer in enumerate(self.layer_shapes):
            if layer.cache == cache and layer.index == index:
                return position
        raise KeyError(f"layer {cache}[{index}] is not in the header of request {self.request_id!r}")

    def tensor_position(self, name: str) -> int:
        for position, tensor in enumerate(self.tensors):
            if tensor.name == name:
                return position
        raise KeyError(f"tensor {name!r} is not in the header of request {self.request_id!r}")


@dataclass(frozen=True)
class CacheLayout:
    """One cache as the receiver holds it: `num_layers` layers of [*, block_size, num_kv_heads, head_dim]."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class KVExpectation:
    """What the receiver will accept for one request; a None field is not checked."""

    block_size: int | None = None
    dtype: str | None = None
    max_num_blocks: int | None = None
    """Blocks reserved for the request: no layer may carry more."""
    caches: Mapping[str, CacheLayout] | None = None
    """Every cache the receiver needs, each with all its layers; a cache not named here is refused."""
    extras: Mapping[str, Any] | None = None
    """Header extras the transfer must carry, with these values (a worker's placement epoch: the
    KV of an earlier placement of the request is refused)."""

    def problems(self, header: KVHeader) -> list[str]:
        """Why `header` does not fit; empty when it does."""
        found: list[str] = []
        if self.block_size is not None and header.block_size != self.block_size:
            found.append(f"block_size {header.block_size} != expected {self.block_size}")
        if self.dtype is not None and header.dtype != self.dtype:
            found.append(f"dtype {header.dtype} != expected {self.dtype}")
        if self.max_num_blocks is not None:
            too_many = [layer for layer in header.layer_shapes if layer.num_blocks > self.max_num_blocks]
            if too_many:
                found.append(f"{too_many[0].num_blocks} blocks > {self.max_num_blocks} reserved")
        if self.caches is not None:
            found.extend(self._cache_problems(header, self.caches))
        for name, value in (self.extras or {}).items():
            if header.extras.get(name) != value:
                found.append(f"extras {name!r} is {header.extras.get(name)!r}, expected {value!r}")
        return found

    @staticmethod
    def _cache_problems(header: KVHeader, caches: Mapping[str, CacheLayout]) -> list[str]:
        found: list[str] = []
        indices: dict[str, set[int]] = {name: set() for name in caches}
        for layer in header.layer_shapes:
            layout = caches.get(layer.cache)
            if layout is None:
                found.append(f"unexpected cache {layer.cache!r}")
                continue
            indices[layer.cache].add(layer.index)
            if layer.shape[2:] != (layout.num_kv_heads, layout.head_dim):
                found.append(
                    f"layer {layer.cache}[{layer.index}] has [num_kv_heads, head_dim] {list(layer.shape[2:])}, "
                    f"expected {[layout.num_kv_heads, layout.head_dim]}"
                )
        for name, layout in caches.items():
            if indices[name] != set(range(layout.num_layers)):
                found.append(
                    f"cache {name!r} has layers {sorted(indices[name])}, expected 0..{layout.num_layers - 1}"
                )
        return found


# ---- what the receiver delivers ---------------------------------------------------------------------


@dataclass
class TransferStats:
    """One transfer as one side saw it (exported to Prometheus by the worker)."""

    request_id: str
    num_bytes: int = 0
    """Bytes on the wire for this transfer, framing included."""
    num_layers: int = 0
    started_at: float = field(default_factory=time.monotonic)
    seconds: float = 0.0
    """Open (sender) or header arrival (receiver) to acknowledgement."""

    @property
    def bytes_per_s(self) -> float:
        return self.num_bytes / self.seconds if self.seconds > 0 else 0.0

    def finish(self) -> None:
        self.seconds = time.monotonic() - self.started_at


@dataclass
class TransportStats:
    """Running totals of one transport, both directions."""

    bytes_sent: int = 0
    bytes_received: int = 0
    transfers_sent: int = 0
    transfers_received: int = 0
    send_failures: int = 0
    receive_failures: int = 0
    refused_peers: int = 0
    """Inbound connections refused for failing the authentication (`auth.py`, TLS)."""
    send_seconds: float = 0.0
    receive_seconds: float = 0.0


@dataclass
class ReceivedLayer:
    """One verified layer. `key` and `value`: [num_blocks, block_size, num_kv_heads, head_dim], on the CPU
    for the TCP transport; copying them to the device is the callback's job."""

    request_id: str
    cache: str
    index: int
    key: torch.Tensor
    value: torch.Tensor


@dataclass
class ReceivedTransfer:
    """The end of a verified transfer: every layer has been delivered to `on_layer` before this."""

    header: KVHeader
    extras: dict[str, Any]
    """The header's extras updated with those the sender passed to `close()`."""
    tensors: dict[str, torch.Tensor]
    stats: TransferStats


# ---- errors -----------------------------------------------------------------------------------------


class KVTransferError(Exception):
    """A transfer failed. `code` is also what goes on the wire in an error frame."""

    code = "error"

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id


class KVConnectionError(KVTransferError):
    """The peer is unreachable or the connection broke."""

    code = "connection"


class KVTransferRefused(KVTransferError):
    """The receiver refused the transfer: it expects no such request, or the header does not fit."""

    code = "refused"


class KVIntegrityError(KVTransferError):
    """A frame failed its checksum, was truncated, had the wrong size or broke the protocol."""

    code = "integrity"


class KVTransferTimeout(KVTransferError):
    """The transfer did not complete in time."""

    code = "timeout"


class KVTransferCancelled(KVTransferError):
    """The transfer was cancelled by either side or by the transport shutting down."""

    code = "cancelled"


class KVCallbackError(KVTransferError):
    """The receiver's own callback failed while storing the data."""

    code = "callback"


class KVAuthenticationError(KVTransferError):
    """The peer did not prove that it holds the KV secret (or TLS refused it)."""

    code = "unauthenticated"


ERRORS_BY_CODE: dict[str, type[KVTransferError]] = {
    cls.code: cls
    for cls in (
        KVTransferError,
        KVConnectionError,
        KVTransferRefused,
        KVIntegrityError,
        KVTransferTimeout,
        KVTransferCancelled,
        KVCallbackError,
        KVAuthenticationError,
    )
}


# ---- the interface ----------------------------------------------------------------------------------

OnLayer = Callable[[ReceivedLayer], Awaitable[None] | None]
OnDone = Callable[[ReceivedTransfer], Awaitable[None] | None]
OnError = Callable[[KVTransferError], Awaitable[None] | None]
"""Callbacks may be plain functions or coroutines; each runs to completion before the next."""


class KVSendSession(ABC):
    """One outgoing transfer, opened by `KVTransport.open()` once the receiver accepted the header."""

    header: KVHeader
    stats: TransferStats
    shared_unanswered: bool = False
    """A handle went out (`send_shared`) and the receiver never said it was done with it: it may
    still read that memory, so the caller keeps it (until its deadline) whatever became of the session."""

    @abstractmethod
    async def send_layer(self, cache: str, index: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Send one layer's K and V (shape and dtype as the header says); returns once they are handed to
        the transport, so `key` and `value` may be reused afterwards. The TCP transport copies GPU tensors
        to the host first, synchronously; a caller that must not stall passes host (pinned) tensors."""

    async def send_layer_part(
        self, cache: str, index: int, first_block: int, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Send blocks [first_block, first_block + len(key)) of one layer's K and V; a layer's parts
        cover its blocks once each, and the receiver delivers it once they all came (a chunked
        prefill sends each chunk's blocks as its step ends)."""
        raise NotImplementedError(f"the {type(self).__name__} sends whole layers only")

    @abstractmethod
    async def send_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Send one of the header's named extra tensors."""

    async def send_shared(self, shared: Any) -> str | None:
        """Hand over every layer and tensor at once by the handle of memory the receiver opens (a
        `SharedKV`, ipc transport); returns None once the receiver copied them, or why it did not (the
        caller then sends them with `send_layer` / `send_tensor`)."""
        return f"the {type(self).__name__} moves KV only as bytes"

    @abstractmethod
    async def close(self, extras: Mapping[str, Any] | None = None) -> TransferStats:
        """Mark the end (adding `extras`) and wait until the receiver has stored everything."""

    @abstractmethod
    async def abort(self, reason: str = "aborted by sender") -> None:
        """Give up; the receiver reports the transfer as cancelled. Never raises."""

    async def __aenter__(self) -> KVSendSession:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Aborts unless `close()` succeeded (abort() does nothing after that)."""
        await self.abort(f"sender failed: {exc!r}" if exc is not None else "session left without close()")


class KVTransport(ABC):
    """Moves KV caches between workers. One object does both sides: a decode worker `start()`s it and
    `expect()`s transfers; a prefill worker `open()`s sessions to decode workers' addresses."""

    name: str
    stats: TransportStats

    @abstractmethod
    async def start(self, host: str = "0.0.0.0", port: int = 0, advertise_host: str | None = None) -> str:
        """Start receiving; returns the address senders pass to `open()` ("host:port"). Port 0 picks a free one."""

    @abstractmethod
    def expect(
        self,
        request_id: str,
        on_layer: OnLayer,
        on_done: OnDone,
        on_error: OnError,
        timeout_s: float = 60.0,
        expectation: KVExpectation | None = None,
    ) -> None:
        """Accept one transfer for `request_id`, described by a header that fits `expectation`.

        Each layer goes to `on_layer` as soon as it is verified, in arrival order, one call at a time;
        then `on_done` runs once, and only after it returns does the sender's `close()` return. Or
        `on_error` runs once: if the transfer fails (`on_layer` or `on_done` raising included; no
        `on_layer` call runs after it) or has not completed `timeout_s` after this call. A transfer for
        an id nobody expects is refused, and only its sender hears of it."""

    @abstractmethod
    def cancel(self, request_id: str) -> bool:
        """Stop expecting `request_id` (its sender gets an error); no callback runs. False if unknown."""

    @abstractmethod
    async def open(self, address: str, header: KVHeader, timeout_s: float | None = None) -> KVSendSession:
        """Start a transfer to the receiver at `address`; returns once it accepted `header`.
        Raises `KVTransferError` (a subclass) if it is unreachable or refuses."""

    @abstractmethod
    async def close(self) -> None:
        """Stop receiving and sending; pending expected transfers get `on_error` (cancelled)."""
