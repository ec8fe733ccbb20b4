"""Shared plumbing of the CUDA kernels: lazy CuPy import, NVRTC compilation, launches on torch's stream.

CuPy is imported only when a CUDA tensor first reaches a kernel, so CPU-only machines (and CI) never
import it. Kernels take raw device pointers (passed as 64-bit integers) and run on torch's current
stream, so they order with torch's own work and can be captured in a CUDA graph.

Sources are header-free (bf16 / fp16 conversions are inline PTX), so NVRTC needs no CUDA include path.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

DISABLE_ENV = "SPECMESH_KERNELS"
"""Set to `ref` to run the torch references even on CUDA (A/B timing, debugging)."""

NVRTC_OPTIONS = ("-std=c++17",)

DTYPE_IDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

CONVERSIONS = r"""
#define DT_F32 0
#define DT_BF16 1
#define DT_F16 2
#if DTYPE == DT_F32
typedef float scalar_t;
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float from_float(float x) { return x; }
#else
typedef unsigned short scalar_t;
__device__ __forceinline__ float to_float(unsigned short x) {
#if DTYPE == DT_BF16
    return __uint_as_float(((unsigned int)x) << 16);
#else
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x)); return f;
#endif
}
__device__ __forceinline__ unsigned short from_float(float x) {
    unsigned short h;
#if DTYPE == DT_BF16
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
#endif
    return h;
}
#endif
#if DTYPE == DT_F32
#define VEC 4
#else
#define VEC 8
#endif
/* 16 bytes holding VEC scalar_t -> VEC floats */
__device__ __forceinline__ void unpack_vec(uint4 raw, float* out) {
#if DTYPE == DT_F32
    out[0] = __uint_as_float(raw.x); out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z); out[3] = __uint_as_float(raw.w);
#else
    const unsigned short* h = reinterpret_cast<const unsigned short*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = to_float(h[i]);
#endif
}
/* VEC floats -> 16 bytes holding VEC scalar_t, rounded to nearest even */
__device__ __forceinline__ uint4 pack_vec(const float* v) {
    uint4 raw;
#if DTYPE == DT_F32
    raw.x = __float_as_uint(v[0]); raw.y = __float_as_uint(v[1]);
    raw.z = __float_as_uint(v[2]); raw.w = __float_as_uint(v[3]);
#else
    unsigned short* h = reinterpret_cast<unsigned short*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) h[i] = from_float(v[i]);
#endif
    return raw;
}
/* 16 bytes of scalar_t (16-byte aligned) <-> VEC floats */
__device__ __forceinline__ void load_vec(const scalar_t* p, float* out) {
    unpack_vec(*reinterpret_cast<const uint4*>(p), out);
}
__device__ __forceinline__ void store_vec(scalar_t* p, const float* v) {
    *reinterpret_cast<uint4*>(p) = pack_vec(v);
}
"""


class KernelError(ValueError):
    """Inputs a CUDA kernel cannot take (wrong dtype, shape, layout or device)."""


@functools.cache
def cupy_module() -> Any | None:
    """The cupy module, or None where it cannot be imported or sees no device."""
    if os.environ.get(DISABLE_ENV, "").lower() == "ref":
        return None
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() == 0:
            return None
        return cupy
    except Exception:  # noqa: BLE001 - any import or driver failure means: use the references
        return None


def available(*tensors: torch.Tensor) -> bool:
    """True when every tensor is on a CUDA device and CuPy works there."""
    return all(t.is_cuda for t in tensors) and cupy_module() is not None


@functools.cache
def _arch_of(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


def _arch(device: torch.device) -> str:
    return _arch_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _kernel(source: str, name: str, defines: tuple[tuple[str, int], ...], arch: str) -> Any:
    cupy = cupy_module()
    assert cupy is not None
    options = NVRTC_OPTIONS + (f"--gpu-architecture={arch}",) + tuple(f"-D{k}={v}" for k, v in defines)
    return cupy.RawKernel(source, name, options=options)


def compiled_variants() -> int:
    """Kernel variants built so far in this process (each is compiled on its first launch)."""
    return _kernel.cache_info().currsize


def function(source: str, name: str, device: torch.device, **defines: int) -> Any:
    """The kernel `name` of `source` compiled with the given -D macros (cached per variant)."""
    return _kernel(source, name, tuple(sorted(defines.items())), _arch(device))


@functools.cache
def num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _external_stream(handle: int, device_id: int) -> Any:
    cupy = cupy_module()
    assert cupy is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(handle, device_id)


def launch(
    kernel: Any,
    grid: Sequence[int],
    block: Sequence[int],
    args: Sequence[Any],
    device: torch.device,
    shared_mem: int = 0,
) -> None:
    """Launches on torch's current stream of `device`; tensors are passed as device pointers."""
    packed = tuple(_arg(a) for a in args)
    stream = torch.cuda.current_stream(device)
    with _external_stream(stream.cuda_stream, device.index or 0):
        kernel(tuple(grid), tuple(block), packed, shared_mem=shared_mem)


def _arg(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return np.uint64(value.data_ptr())
    if value is None:  # a null pointer
        return np.uint64(0)
    if isinstance(value, (np.generic,)):
        return value
    raise KernelError(
        f"kernel argument {value!r}: pass tensors or numpy scalars (np.int32, np.float32, ...) or None"
    )


_SMEM_LIMITS: dict[int, int] = {}


def set_max_dynamic_shared(kernel: Any, num_bytes: int) -> None:
    """Raises the kernel's dynamic shared-memory limit past the default 48 KB when needed."""
    if num_bytes > 48 * 1024 and _SMEM_LIMITS.get(id(kernel), 0) < num_bytes:
        kernel.max_dynamic_shared_size_bytes = num_bytes
        _SMEM_LIMITS[id(kernel)] = num_bytes


def check(condition: bool, message: str) -> None:
    if not condition:
        raise KernelError(message)


def check_cuda_tensor(
    name: str, tensor: torch.Tensor, dtypes: Sequence[torch.dtype], ndim: int, device: torch.device
) -> None:
    check(tensor.device == device, f"{name} is on {tensor.device}, expected {device}")
    check(tensor.dtype in dtypes, f"{name} has dtype {tensor.dtype}, expected one of {list(dtypes)}")
    check(tensor.dim() == ndim, f"{name} has shape {tuple(tensor.shape)}, expected {ndim} dimensions")
