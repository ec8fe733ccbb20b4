"""KV in memory that another process on this host opens by handle: the buffers of the ipc transport.

Terms:
- *shared buffer*: one uint8 buffer a prefill engine core gathers a request's KV into. On CUDA a
  device allocation, opened elsewhere through its CUDA IPC handle (the one torch's
  `reduce_tensor` makes, which also carries an event the opener's stream waits on, so the gather
  needs no host wait); on the CPU a file in /dev/shm, mapped by both sides.
- *segment*: one tensor in a shared buffer: a cache's layers stacked
  [num_layers, 2 (key, value), num_blocks, block_size, num_kv_heads, head_dim], or a named extra
  tensor.
- *handle* (`SharedKV`): the segments and where they live; msgpack-able, small, validated on
  arrival, and opened without unpickling anything.

`SharedBuffers` is the producer side: it allocates buffers and keeps each alive until it is
released or its deadline passes. `open_shared` is the consumer side.

Lifetime: a buffer lives exactly as long as `SharedBuffers` holds it, on CUDA as on the CPU. torch's
own IPC reference count cannot say this: its counter starts at one for the one opener, an opener
that drops its storage decrements it, and the producer's allocator keeps a freed block "in limbo"
(`torch.cuda.ipc_collect`) until the counter is exactly zero. A handle nobody opens would hold its
block for ever, and the producer cannot know whether a consumer that never answered opened it. So
the producer releases torch's count when it makes the handle, the handle does not carry the counter,
and `open_shared` opens the memory against a counter name no shared memory has
(`NO_REF_COUNTER`), whose decrement torch skips: nothing but `SharedBuffers.release` frees a block.
That leaves the protocol to keep readers safe: a consumer answers (taken or refused) only once its
reads are done, and a sender whose handle got no answer keeps the buffer until its deadline
(`ipc.py`, `Worker._hand_off`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.kv_transport.base import DTYPES, KVHeader, LayerShape, TensorSpec, dtype_name

SHM_DIR = "/dev/shm"
SHM_PREFIX = "specmesh-kv-"
SHM_NAME = re.compile(rf"^{SHM_PREFIX}(\d+)-[0-9a-f]{{16}}$")
"""Shared buffer files: the producer's pid, then a random tag (a handle naming another file is refused)."""


NO_REF_COUNTER = b"/specmesh-kv-no-ref-counter"
"""The IPC reference counter a consumer opens CUDA memory against: no shared memory object has this
name, so torch's decrement when the consumer drops the memory does nothing (the producer owns the
buffer's life)."""

CUDA_IPC_EVENT_HANDLE_BYTES = 64
"""The size of a `cudaIpcEventHandle_t`."""

ALIGN_BYTES = 16
"""Where extra tensors start in their buffer (every dtype's alignment divides it)."""


class SharedKVError(ValueError):
    """A handle that does not describe a usable shared buffer (malformed, or it cannot be opened)."""


def host_identity() -> str:
    """What two processes compare to know they share a host: the kernel's boot id and the hostname."""
    boot_id = ""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as file:
        boot_id = file.read().strip()
    return f"{os.uname().nodename}/{boot_id}"


# ---- the handle -------------------------------------------------------------------------------------


class ShmRegion(BaseModel):
    """Bytes [offset, offset + num_bytes) of a file in /dev/shm."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["shm"] = "shm"
    name: str
    """The file's name in /dev/shm (`SHM_NAME`)."""
    offset: int = Field(ge=0)
    num_bytes: int = Field(ge=0)

    @field_validator("name")
    @classmethod
    def _ours(cls, name: str) -> str:
        if not SHM_NAME.match(name):
            raise ValueError(f"{name!r} is not a shared KV file name ({SHM_PREFIX}<pid>-<16 hex digits>)")
        return name


class CudaRegion(BaseModel):
    """Bytes [offset, offset + num_bytes) of a CUDA allocation, opened by its IPC handle."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["cuda"] = "cuda"
    device_uuid: str
    """The GPU holding the allocation (device indices differ between processes)."""
    handle: bytes
    storage_size_bytes: int = Field(ge=0)
    storage_offset_bytes: int = Field(ge=0)
    """Where the buffer starts in the allocation `handle` names (allocations hold several buffers)."""
    event_handle: bytes | None
    """An IPC event recorded after the gather: the opener's stream waits on it."""
    event_sync_required: bool
    offset: int = Field(ge=0)
    num_bytes: int = Field(ge=0)

    @model_validator(mode="after")
    def _inside(self) -> CudaRegion:
        if self.event_sync_required and len(self.event_handle or b"") != CUDA_IPC_EVENT_HANDLE_BYTES:
            raise ValueError(f"an event to wait on needs a {CUDA_IPC_EVENT_HANDLE_BYTES}-byte event handle")
        if self.offset + self.num_bytes > self.storage_size_bytes:
            raise ValueError(
                f"region [{self.offset}, {self.offset + self.num_bytes}) exceeds the "
                f"{self.storage_size_bytes}-byte allocation"
            )
        return self


Region = Annotated[ShmRegion | CudaRegion, Field(discriminator="kind")]


class Segment(BaseModel):
    """One tensor in a shared buffer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=128)
    """The cache ("target", "mtp", "draft") or the extra tensor's name."""
    dtype: str
    shape: tuple[int, ...]
    region: Region

    @field_validator("dtype")
    @classmethod
    def _dtype_known(cls, value: str) -> str:
        if value not in DTYPES:
            raise ValueError(f"unknown dtype {value!r}; known: {', '.join(DTYPES)}")
        return value

    @model_validator(mode="after")
    def _sized(self) -> Segment:
        if any(dim < 0 for dim in self.shape):
            raise ValueError(f"negative dimension in {list(self.shape)}")
        num_bytes = DTYPES[self.dtype].itemsize
        for dim in self.shape:
            num_bytes *= dim
        if num_bytes != self.region.num_bytes:
            raise ValueError(
                f"segment {self.name!r} is {list(self.shape)} {self.dtype} ({num_bytes} bytes) "
                f"in a region of {self.region.num_bytes}"
            )
        if self.region.offset % DTYPES[self.dtype].itemsize:
            raise ValueError(f"segment {self.name!r} is not aligned to its dtype")
        return self


class SharedKV(BaseModel):
    """A request's KV in shared buffers: every layer of every cache, and the extra tensors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    caches: list[Segment]
    """Each [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]."""
    tensors: list[Segment] = Field(default_factory=list)

    @field_validator("caches")
    @classmethod
    def _stacked(cls, caches: list[Segment]) -> list[Segment]:
        for segment in caches:
            if len(segment.shape) != 6 or segment.shape[1] != 2:
                raise ValueError(
                    f"cache {segment.name!r} has shape {list(segment.shape)}, expected "
                    "[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]"
                )
        if len({segment.dtype for segment in caches}) > 1:
            raise ValueError("the caches differ in dtype")
        return caches

    @property
    def dtype(self) -> str:
        return self.caches[0].dtype if self.caches else "float32"

    def layer_shapes(self) -> list[LayerShape]:
        """The layers as a transport header lists them."""
        return [
            LayerShape(cache=segment.name, index=index, shape=segment.shape[2:])  # type: ignore[arg-type]
            for segment in self.caches
            for index in range(segment.shape[0])
        ]

    def tensor_specs(self) -> list[TensorSpec]:
        return [TensorSpec(name=t.name, shape=t.shape, dtype=t.dtype) for t in self.tensors]

    def problems(self, header: KVHeader) -> list[str]:
        """Where this handle and the transfer's header disagree; empty when they describe the same KV."""
        found = []
        if self.caches and self.dtype != header.dtype:
            found.append(f"dtype {self.dtype} != the header's {header.dtype}")
        shapes = {(layer.cache, layer.index): layer.shape for layer in self.layer_shapes()}
        expected = {(layer.cache, layer.index): layer.shape for layer in header.layer_shapes}
        if shapes != expected:
            found.append(f"layers {_describe(shapes)} != the header's {_describe(expected)}")
        tensors = {spec.name: (spec.shape, spec.dtype) for spec in self.tensor_specs()}
        if tensors != {spec.name: (spec.shape, spec.dtype) for spec in header.tensors}:
            found.append(f"tensors {sorted(tensors)} != the header's {[t.name for t in header.tensors]}")
        return found


def _describe(layers: Mapping[tuple[str, int], tuple[int, ...]]) -> str:
    return ", ".join(f"{cache}[{index}]{list(shape)}" for (cache, index), shape in sorted(layers.items()))


# ---- the producer -----------------------------------------------------------------------------------


@dataclass
class _Held:
    buffers: list[torch.Tensor]
    files: list[str]
    caches: dict[str, torch.Tensor]
    tensors: dict[str, torch.Tensor]
    deadline: float


class SharedBuffers:
    """A prefill engine core's shared buffers: allocated for an export, held by request id until
    released or `timeout_s` after they were shared."""

    def __init__(self, device: torch.device, timeout_s: float = 120.0):
        self.device = device
        self.timeout_s = timeout_s
        self._files: dict[int, str] = {}
        """Buffer data pointer -> its /dev/shm file (CPU buffers)."""
        self._held: dict[str, _Held] = {}
        if device.type == "cpu":
            remove_orphans()

    def allocate(self, num_bytes: int) -> torch.Tensor:
        """A uint8 buffer of `num_bytes` on the device that another process can open."""
        if self.device.type == "cuda":
            return torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
        name = f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        buffer = _map_file(os.path.join(SHM_DIR, name), num_bytes, create=True)
        self._files[buffer.data_ptr()] = name
        return buffer

    def share(
        self,
        request_id: str,
        buffer: torch.Tensor,
        caches: dict[str, torch.Tensor],
        tensors: dict[str, torch.Tensor],
    ) -> SharedKV:
        """The handle of `caches` (name -> [num_layers, 2, ...], views of `buffer`, from `allocate`)
        and of `tensors` (copied into a buffer of their own); both are held for `request_id` until
        `release`."""
        buffers = [buffer]
        if tensors:
            sizes = [-(-_num_bytes(tensor) // ALIGN_BYTES) * ALIGN_BYTES for tensor in tensors.values()]
            buffers.append(self.allocate(sum(sizes)))
            parts = buffers[1].split(sizes)
            tensors = {
                name: part[: _num_bytes(tensor)].view(tensor.dtype).view(tensor.shape).copy_(tensor)
                for (name, tensor), part in zip(tensors.items(), parts)
            }
        regions = [self._region_maker(b) for b in buffers]  # one handle a buffer
        shared = SharedKV(
            caches=[_segment(name, view, regions[0]) for name, view in caches.items()],
            tensors=[_segment(name, view, regions[-1]) for name, view in tensors.items()],
        )
        self.release(request_id)  # a placement of the request shared earlier is superseded
        files = [self._files.pop(b.data_ptr()) for b in buffers if b.data_ptr() in self._files]
        deadline = time.monotonic() + self.timeout_s
        self._held[request_id] = _Held(buffers, files, caches, tensors, deadline)
        return shared

    def release(self, request_id: str) -> bool:
        """Frees the request's buffer (its file leaves /dev/shm at once); False if none is held."""
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        for name in held.files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
        held.buffers.clear()
        held.caches.clear()
        held.tensors.clear()
        return True

    def host_copy(self, request_id: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None:
        """The caches and tensors held for `request_id`, copied to the host (None: none held)."""
        held = self._held.get(request_id)
        if held is None:
            return None
        caches = {name: view.cpu() for name, view in held.caches.items()}
        return caches, {name: tensor.cpu() for name, tensor in held.tensors.items()}

    def expire(self, now: float | None = None) -> list[str]:
        """Releases every buffer whose deadline is `now` (`time.monotonic()`, the default) or
        earlier; their request ids."""
        now = time.monotonic() if now is None else now
        expired = [request_id for request_id, held in self._held.items() if held.deadline <= now]
        for request_id in expired:
            self.release(request_id)
        return expired

    def seconds_to_deadline(self) -> float | None:
        """Until the next buffer expires (None: none held)."""
        if not self._held:
            return None
        return max(0.0, min(held.deadline for held in self._held.values()) - time.monotonic())

    @property
    def num_held(self) -> int:
        return len(self._held)

    def close(self) -> None:
        for request_id in list(self._held):
            self.release(request_id)

    def _region_maker(self, buffer: torch.Tensor) -> Callable[[torch.Tensor], ShmRegion | CudaRegion]:
        base = buffer.data_ptr()
        if buffer.device.type == "cuda":
            cuda = _cuda_handle(buffer)
            return lambda view: CudaRegion(
                **{**cuda, "offset": cuda["offset"] + view.data_ptr() - base}, num_bytes=_num_bytes(view)
            )
        name = self._files.get(base)
        if name is None:
            raise ValueError("not a buffer of SharedBuffers.allocate()")
        return lambda view: ShmRegion(name=name, offset=view.data_ptr() - base, num_bytes=_num_bytes(view))


def remove_orphans() -> list[str]:
    """Removes the shared KV files of processes that no longer run (a core killed while it held
    some); the names removed."""
    removed = []
    for name in os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else []:
        match = SHM_NAME.match(name)
        if match is None or _alive(int(match.group(1))):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _num_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _segment(
    name: str, view: torch.Tensor, region: Callable[[torch.Tensor], ShmRegion | CudaRegion]
) -> Segment:
    if not view.is_contiguous():
        raise ValueError(f"segment {name!r} is not contiguous")
    return Segment(name=name, dtype=dtype_name(view.dtype), shape=tuple(view.shape), region=region(view))


def _cuda_handle(buffer: torch.Tensor) -> dict[str, Any]:
    """The IPC handle torch makes for `buffer`'s allocation (it records the event the opener waits
    on). torch's reference count for the opener is released here: the buffer's life is
    `SharedBuffers`' alone (the module docstring says why)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    tensor_offset, device, handle, size, storage_offset = args[3], args[6], args[7], args[8], args[9]
    counter, counter_offset, event, sync = args[11:15]
    torch.UntypedStorage._release_ipc_counter_cuda(counter, counter_offset)
    return {
        "device_uuid": str(torch.cuda.get_device_properties(device).uuid),
        "handle": handle,
        "storage_size_bytes": size,
        "storage_offset_bytes": storage_offset,
        "event_handle": event,
        "event_sync_required": sync,
        "offset": tensor_offset * buffer.element_size(),
    }


def _map_file(path: str, num_bytes: int, create: bool) -> torch.Tensor:
    """A uint8 tensor over a shared mapping of `path` (created with `num_bytes`, or opened: then it must
    hold at least that many)."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, max(num_bytes, 1))
        elif os.fstat(fd).st_size < num_bytes:
            raise SharedKVError(f"{path} holds {os.fstat(fd).st_size} bytes, the handle needs {num_bytes}")
        mapping = mmap.mmap(fd, max(num_bytes, 1), mmap.MAP_SHARED)
    finally:
        os.close(fd)
    return torch.frombuffer(mapping, dtype=torch.uint8)[:num_bytes]


# ---- the consumer -----------------------------------------------------------------------------------


def open_shared(shared: SharedKV) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The caches (name -> [num_layers, 2, ...]) and extra tensors of a handle, as views of the
    producer's buffers (on its GPU, or a mapping of its file). SharedKVError if they cannot be opened."""
    opened: dict[Any, torch.Tensor] = {}
    caches = {s.name: _open_segment(s, opened) for s in shared.caches}
    tensors = {s.name: _open_segment(s, opened) for s in shared.tensors}
    return caches, tensors


def _open_segment(segment: Segment, opened: dict[Any, torch.Tensor]) -> torch.Tensor:
    region = segment.region
    key = region.name if isinstance(region, ShmRegion) else (region.handle, region.storage_offset_bytes)
    if key not in opened:
        opened[key] = _open_shm(region) if isinstance(region, ShmRegion) else _open_cuda(region)
    buffer = opened[key]
    if region.offset + region.num_bytes > buffer.numel():
        raise SharedKVError(f"segment {segment.name!r} lies past the end of its {buffer.numel()}-byte buffer")
    view = buffer[region.offset : region.offset + region.num_bytes]
    return view.view(DTYPES[segment.dtype]).view(segment.shape)


def _open_shm(region: ShmRegion) -> torch.Tensor:
    path = os.path.join(SHM_DIR, region.name)
    try:
        return _map_file(path, os.stat(path).st_size, create=False)
    except FileNotFoundError:
        raise SharedKVError(f"{path} does not exist (released by its producer, or on another host)") from None
    except (OSError, ValueError) as exc:
        raise SharedKVError(f"cannot map {path}: {exc}") from None


def _open_cuda(region: CudaRegion) -> torch.Tensor:
    """The region's whole buffer, opened without a reference count (`NO_REF_COUNTER`); each call maps
    a storage of its own (torch's `rebuild_cuda_tensor` would hand back a live one of the same
    allocation and offset, whatever its size)."""
    if not torch.cuda.is_available():
        raise SharedKVError("the KV is on a GPU and this process has no CUDA device")
    devices = [
        i
        for i in range(torch.cuda.device_count())
        if str(torch.cuda.get_device_properties(i).uuid) == region.device_uuid
    ]
    if not devices:
        raise SharedKVError(f"the KV's GPU {region.device_uuid} is not visible here (CUDA_VISIBLE_DEVICES)")
    torch.cuda.init()
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            devices[0],
            region.handle,
            region.storage_size_bytes,
            region.storage_offset_bytes,
            NO_REF_COUNTER,
            0,
            region.event_handle or b"",
            region.event_sync_required,
        )
    except RuntimeError as exc:
        raise SharedKVError(f"cannot open the CUDA IPC handle: {exc}") from None
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{devices[0]}").set_(storage)
