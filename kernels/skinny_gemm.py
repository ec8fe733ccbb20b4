"""CUDA skinny matrix product for decode steps: y = x @ weight.T + bias with few rows of x.

A decode step at batch 1 multiplies one token row by every weight matrix of the model, so its
time is the time to stream the weights from memory once. This kernel reads each weight row once,
16 bytes per lane, UNROLL loads in flight per warp. Measured on an H100 (kernels/NOTES.md) it reads
the large wide matrices at 95-102% of copy bandwidth against cuBLAS's 86-95% (LM heads, Qwen2.5-7B's
gate_up: ~5% of a 7B model's step), while cuBLAS is as fast or faster on smaller or tall matrices and
stays flat from 1 to 16 rows where this kernel's time grows with the rows (every warp re-reads x
from cache). So `kernels.linear` uses it for one row and large matrices only (`preferred`).

Layout: one warp computes ROWS consecutive outputs (weight rows) for all rows of x; lanes stride
the reduction dimension 16 bytes at a time, UNROLL loads in flight, float32 accumulation, a warp
shuffle reduction, and one rounding to the output dtype (cuBLAS rounds once too, so the two differ
only by float32 summation order). x is read through the read-only cache; every warp reads all of
it; the kernel takes up to MAX_ROWS rows (tested), `preferred` says when it beats cuBLAS. Its torch
twin is `F.linear`, which `kernels.linear` runs everywhere else.

The small and tall projections of a decode step at batch 1-4 (qkv, o, down) have too few outputs
for one warp per output to keep enough loads in flight, so `skinny_linear_splitk` also splits the
reduction dimension over the grid's second axis and the last block of each output tile to finish
sums the slices (an arrival counter per tile, reset by that block): one launch where cuBLAS runs a
split-K product and a reduce kernel. `splitk_preferred` says when it runs, `splitk_plan` how many
slices (kernels/NOTES.md).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from kernels import _cuda

DISABLE_ENV = "SPECMESH_SKINNY_GEMM"
"""Set to `off` to run every product on cuBLAS (A/B timing against this kernel)."""
MAX_ROWS = 16
"""Most rows of x the kernel takes; the variants are compiled for 1, 2, 4, 8 and 16 rows."""
ROW_VARIANTS = (1, 2, 4, 8, 16)
WARPS_PER_BLOCK = 4
UNROLL = 4
PREFERRED_MIN_WEIGHT_BYTES = 128 * 2**20
"""`preferred` from this weight size up (one row); below, cuBLAS is as fast (H100 sweep)."""
WIDE_OUTPUTS = 16384
"""From this many outputs up, a warp computes two of them (more bytes in flight per warp);
below it one (more warps over the card)."""
SPLITK_ENV = "SPECMESH_SPLITK_GEMV"
"""Set to `off` to run the small and tall products of 1-4 rows on cuBLAS again (A/B timing)."""
SPLITK_WARPS_ENV = "SPECMESH_SPLITK_WARPS_PER_SM"
"""Overrides SPLITK_WARPS_PER_SM (tuning on a GPU)."""
SPLITK_MAX_ROWS = 4
"""Most rows of x the split-K path takes (decode at batch 1-4)."""
SPLITK_VARIANTS = (1, 2, 4)
SPLITK_MAX_WIDE_BYTES = 48 * 2**20
"""The split-K path takes a matrix with at least as many outputs as inputs up to this size (the
qkv and o projections); tall ones (down projections) at any size. cuBLAS keeps the mid-size wide
ones (Llama-1B's gate_up), the one-row kernel the large wide ones (LM heads)."""
SPLITK_WARPS_PER_SM = 48
"""Warps the split-K grid aims for per SM (slices = that / the warps one slice needs): enough
16-byte loads in flight to cover memory latency. Not yet tuned on a GPU."""
SPLITK_MIN_SLICE = 1024
"""Fewest columns of a K slice (elements): one full pass of a warp's unrolled loads (bf16)."""
SPLITK_MAX_SLICES = 32

SOURCE = (
    _cuda.CONVERSIONS
    + r"""
#if OUT_F32
typedef float out_t;
__device__ __forceinline__ out_t to_out(float v) { return v; }
#else
typedef scalar_t out_t;
__device__ __forceinline__ out_t to_out(float v) { return from_float(v); }
#endif

/* y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for m < num_rows <= MROWS. */
extern "C" __global__ void __launch_bounds__(32 * WARPS) skinny_linear(
    const scalar_t* __restrict__ x,      /* [num_rows, K], rows x_stride elements apart */
    const scalar_t* __restrict__ w,      /* [N, K] contiguous */
    const scalar_t* __restrict__ bias,   /* [N]; unused without HAS_BIAS */
    out_t* __restrict__ y,               /* [num_rows, N] contiguous */
    int num_rows, int N, int K, long long x_stride)
{
    const int lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * ROWS;
    if (n0 >= N) return;
    const scalar_t* wr[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) wr[r] = w + (long long)min(n0 + r, N - 1) * K;
    float acc[ROWS][MROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int m = 0; m < MROWS; ++m) acc[r][m] = 0.f;

    for (int k0 = lane * VEC; k0 < K; k0 += 32 * VEC * UNROLL) {
        uint4 raw[UNROLL][ROWS];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int k = k0 + u * 32 * VEC;
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
                raw[u][r] = k < K ? __ldg(reinterpret_cast<const uint4*>(wr[r] + k)) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int k = k0 + u * 32 * VEC;
            if (k >= K) break;
            float wv[ROWS][VEC];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
#if DTYPE == DT_F32
                wv[r][0] = __uint_as_float(raw[u][r].x); wv[r][1] = __uint_as_float(raw[u][r].y);
                wv[r][2] = __uint_as_float(raw[u][r].z); wv[r][3] = __uint_as_float(raw[u][r].w);
#else
                const unsigned short* h = reinterpret_cast<const unsigned short*>(&raw[u][r]);
#pragma unroll
                for (int i = 0; i < VEC; ++i) wv[r][i] = to_float(h[i]);
#endif
            }
#pragma unroll
            for (int m = 0; m < MROWS; ++m) {
                if (m < num_rows) {
                    float xv[VEC];
                    const uint4 xraw = __ldg(reinterpret_cast<const uint4*>(x + m * x_stride + k));
#if DTYPE == DT_F32
                    xv[0] = __uint_as_float(xraw.x); xv[1] = __uint_as_float(xraw.y);
                    xv[2] = __uint_as_float(xraw.z); xv[3] = __uint_as_float(xraw.w);
#else
                    const unsigned short* h = reinterpret_cast<const unsigned short*>(&xraw);
#pragma unroll
                    for (int i = 0; i < VEC; ++i) xv[i] = to_float(h[i]);
#endif
#pragma unroll
                    for (int r = 0; r < ROWS; ++r)
#pragma unroll
                        for (int i = 0; i < VEC; ++i) acc[r][m] = fmaf(xv[i], wv[r][i], acc[r][m]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int n = n0 + r;
#pragma unroll
        for (int m = 0; m < MROWS; ++m) {
            float v = acc[r][m];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0 && m < num_rows && n < N) {
#if HAS_BIAS
                v += to_float(bias[n]);
#endif
                y[(long long)m * N + n] = to_out(v);
            }
        }
    }
}

/* Split-K variant for few rows (decode at batch 1-4) of small or tall matrices: the grid is
   (output tiles of WARPS * ROWS outputs, K slices); each warp sums its outputs over its slice of
   k_per_split columns. One slice (gridDim.y == 1): the result is written directly. Otherwise each
   block writes its float32 partial sums to `partial`, and the last block of an output tile to
   finish (a per-tile arrival counter) adds the slices in slice order (deterministic), adds the
   bias, rounds once and resets the counter to zero for the next launch (or graph replay). */
extern "C" __global__ void __launch_bounds__(32 * WARPS) skinny_linear_splitk(
    const scalar_t* __restrict__ x,      /* [num_rows, K], rows x_stride elements apart */
    const scalar_t* __restrict__ w,      /* [N, K] contiguous */
    const scalar_t* __restrict__ bias,   /* [N]; unused without HAS_BIAS */
    out_t* __restrict__ y,               /* [num_rows, N] contiguous */
    float* __restrict__ partial,         /* [gridDim.y, num_rows, N]; unused with one slice */
    unsigned int* __restrict__ counters, /* [gridDim.x], zero between launches */
    int num_rows, int N, int K, long long x_stride, int k_per_split)
{
    __shared__ int is_last;
    const int lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * ROWS;
    const int k_begin = blockIdx.y * k_per_split;
    const int k_end = min(K, k_begin + k_per_split);
    const int slices = gridDim.y;
    float acc[ROWS][MROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int m = 0; m < MROWS; ++m) acc[r][m] = 0.f;
    if (n0 < N) {
        const scalar_t* wr[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) wr[r] = w + (long long)min(n0 + r, N - 1) * K;
        for (int k0 = k_begin + lane * VEC; k0 < k_end; k0 += 32 * VEC * UNROLL) {
            uint4 raw[UNROLL][ROWS];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int k = k0 + u * 32 * VEC;
#pragma unroll
                for (int r = 0; r < ROWS; ++r)
                    raw[u][r] = k < k_end ? __ldg(reinterpret_cast<const uint4*>(wr[r] + k)) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int k = k0 + u * 32 * VEC;
                if (k >= k_end) break;
                float wv[ROWS][VEC];
#pragma unroll
                for (int r = 0; r < ROWS; ++r) unpack_vec(raw[u][r], wv[r]);
#pragma unroll
                for (int m = 0; m < MROWS; ++m) {
                    if (m < num_rows) {
                        float xv[VEC];
                        unpack_vec(__ldg(reinterpret_cast<const uint4*>(x + m * x_stride + k)), xv);
#pragma unroll
                        for (int r = 0; r < ROWS; ++r)
#pragma unroll
                            for (int i = 0; i < VEC; ++i) acc[r][m] = fmaf(xv[i], wv[r][i], acc[r][m]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int n = n0 + r;
#pragma unroll
        for (int m = 0; m < MROWS; ++m) {
            float v = acc[r][m];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0 && m < num_rows && n < N) {
                if (slices == 1) {
#if HAS_BIAS
                    v += to_float(bias[n]);
#endif
                    y[(long long)m * N + n] = to_out(v);
                } else {
                    partial[((long long)blockIdx.y * num_rows + m) * N + n] = v;
                }
            }
        }
    }
    if (slices == 1) return;
    __threadfence();   /* this block's partial sums are visible device-wide before it arrives */
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(&counters[blockIdx.x], 1u) == (unsigned)(slices - 1);
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    const int tile_n = blockIdx.x * WARPS * ROWS;
    for (int i = threadIdx.x; i < WARPS * ROWS * MROWS; i += 32 * WARPS) {
        const int m = i / (WARPS * ROWS), n = tile_n + i % (WARPS * ROWS);
        if (m >= num_rows || n >= N) continue;
        float v = 0.f;
        for (int s = 0; s < slices; ++s) v += __ldcg(&partial[((long long)s * num_rows + m) * N + n]);
#if HAS_BIAS
        v += to_float(bias[n]);
#endif
        y[(long long)m * N + n] = to_out(v);
    }
    if (threadIdx.x == 0) counters[blockIdx.x] = 0u;
}
"""
)


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when the kernel takes this product: 1..MAX_ROWS rows, bf16 / fp16, 16-byte aligned rows
    (and SPECMESH_SKINNY_GEMM is not `off`)."""
    if os.environ.get(DISABLE_ENV, "").lower() == "off":
        return False
    if x.dim() != 2 or weight.dim() != 2 or x.dtype != weight.dtype:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16):
        return False
    num_rows, k = x.shape
    vec = 16 // x.element_size()
    return (
        0 < num_rows <= MAX_ROWS
        and weight.shape[1] == k
        and k % vec == 0
        and x.stride(1) == 1
        and x.stride(0) % vec == 0
        and x.data_ptr() % 16 == 0
        and weight.is_contiguous()
        and weight.data_ptr() % 16 == 0
    )


def preferred(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when the kernel should run instead of cuBLAS: one row and a large weight with at least
    as many outputs as inputs (with fewer, e.g. a down projection, too few warps stream the long
    rows and cuBLAS's split-K is faster)."""
    large = weight.numel() * weight.element_size() >= PREFERRED_MIN_WEIGHT_BYTES
    wide = weight.dim() == 2 and weight.shape[0] >= weight.shape[1]
    return x.dim() == 2 and x.shape[0] == 1 and large and wide and fits(x, weight)


def skinny_linear_cuda(
    x: torch.Tensor,  # [num_rows, K], num_rows <= MAX_ROWS
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype | None = None,  # x.dtype (default) or torch.float32
    rows_per_warp: int | None = None,  # 1 or 2; None: by the number of outputs
    out: torch.Tensor | None = None,  # [num_rows, N] contiguous, of out_dtype: written in place
) -> torch.Tensor:  # [num_rows, N]
    """Same result as `F.linear(x, weight, bias).to(out_dtype)` up to float32 summation order
    (when out_dtype is float32, the product is not rounded to x's dtype first)."""
    device = x.device
    _cuda.check(fits(x, weight), f"skinny_linear takes {tuple(x.shape)} x {tuple(weight.shape)}: see fits()")
    _cuda.check(weight.device == device, f"weight is on {weight.device}, expected {device}")
    out_dtype = out_dtype or x.dtype
    _cuda.check(out_dtype in (x.dtype, torch.float32), f"out_dtype {out_dtype}: {x.dtype} or float32")
    num_rows, k = x.shape
    n = weight.shape[0]
    if bias is not None:
        _cuda.check_cuda_tensor("bias", bias, [x.dtype], 1, device)
        _cuda.check(bias.shape[0] == n and bias.is_contiguous(), f"bias has shape {tuple(bias.shape)}")
    rows = rows_per_warp or (2 if n >= WIDE_OUTPUTS else 1)
    _cuda.check(rows in (1, 2), f"rows_per_warp {rows}: 1 or 2")
    mrows = next(v for v in ROW_VARIANTS if v >= num_rows)
    if out is None:
        out = torch.empty(num_rows, n, dtype=out_dtype, device=device)
    _cuda.check(
        out.shape == (num_rows, n)
        and out.dtype == out_dtype
        and out.is_contiguous()
        and out.device == device,
        f"out must be a contiguous {out_dtype} [{num_rows}, {n}] tensor on {device}",
    )
    kernel = _cuda.function(
        SOURCE,
        "skinny_linear",
        device,
        DTYPE=_cuda.DTYPE_IDS[x.dtype],
        MROWS=mrows,
        ROWS=rows,
        WARPS=WARPS_PER_BLOCK,
        UNROLL=UNROLL,
        HAS_BIAS=int(bias is not None),
        OUT_F32=int(out_dtype == torch.float32 and x.dtype != torch.float32),
    )
    warps = -(-n // rows)
    _cuda.launch(
        kernel,
        (-(-warps // WARPS_PER_BLOCK),),
        (32 * WARPS_PER_BLOCK,),
        (
            x,
            weight,
            bias if bias is not None else weight,
            out,
            np.int32(num_rows),
            np.int32(n),
            np.int32(k),
            np.int64(x.stride(0)),
        ),
        device,
    )
    return out


def splitk_preferred(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when the split-K kernel should run instead of cuBLAS: 1-4 rows of x against a tall
    matrix (out < in: a down projection) or a wide one up to SPLITK_MAX_WIDE_BYTES (qkv, o), and
    SPECMESH_SPLITK_GEMV is not `off`."""
    if os.environ.get(SPLITK_ENV, "").lower() == "off" or x.dim() != 2 or weight.dim() != 2:
        return False
    tall = weight.shape[0] < weight.shape[1]
    small = weight.numel() * weight.element_size() <= SPLITK_MAX_WIDE_BYTES
    return x.shape[0] <= SPLITK_MAX_ROWS and (tall or small) and fits(x, weight)


def splitk_plan(n: int, k: int, num_sms: int, warps_per_sm: int | None = None) -> tuple[int, int]:
    """(slices, columns per slice) of the split-K grid for an [n, k] matrix: about
    `warps_per_sm` warps per SM (one warp per output and slice), each slice at least
    SPLITK_MIN_SLICE columns, slices a multiple of 256 columns (a warp's 16-byte step, bf16) so
    every slice but the last is full; the last is never empty."""
    if warps_per_sm is None:
        warps_per_sm = int(os.environ.get(SPLITK_WARPS_ENV, SPLITK_WARPS_PER_SM))
    by_occupancy = -(-num_sms * warps_per_sm // n)
    by_length = max(1, k // SPLITK_MIN_SLICE)
    return _slices(k, max(1, min(by_occupancy, by_length, SPLITK_MAX_SLICES)))


def _slices(k: int, slices: int) -> tuple[int, int]:
    """(slices, columns per slice) for about `slices` slices of 256-column multiples, none empty."""
    step = 256
    per_slice = -(-k // slices)
    k_per_split = -(-per_slice // step) * step
    return -(-k // k_per_split), k_per_split


class _Workspace:
    """One device's float32 partial sums and per-tile arrival counters (zero between launches).
    The products sharing it must not overlap: eager calls and graph replays on one stream (as the
    engine runs them; a graph is captured on a side stream but replayed on the engine's). A CUDA
    graph keeps the pointers it captured, so a workspace that grows keeps its old buffers alive."""

    def __init__(self) -> None:
        self.partial: torch.Tensor | None = None
        self.counters: torch.Tensor | None = None
        self.retired: list[torch.Tensor] = []

    def get(self, floats: int, tiles: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Buffers of at least this size, or None where they would have to grow during a capture."""
        fresh_partial = self.partial is None or self.partial.numel() < floats
        fresh_counters = self.counters is None or self.counters.numel() < tiles
        if (fresh_partial or fresh_counters) and torch.cuda.is_current_stream_capturing():
            return None
        if fresh_partial:
            self.retired += [self.partial] if self.partial is not None else []
            self.partial = torch.empty(max(floats, 1 << 16), dtype=torch.float32, device=device)
        if fresh_counters:
            self.retired += [self.counters] if self.counters is not None else []
            self.counters = torch.zeros(max(tiles, 1 << 12), dtype=torch.int32, device=device)
        assert self.partial is not None and self.counters is not None
        return self.partial, self.counters


_WORKSPACES: dict[int, _Workspace] = {}


def _workspace(device: torch.device) -> _Workspace:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _WORKSPACES.setdefault(index, _Workspace())


def skinny_linear_splitk_cuda(
    x: torch.Tensor,  # [num_rows, K], num_rows <= SPLITK_MAX_ROWS
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype | None = None,  # x.dtype (default) or torch.float32
    out: torch.Tensor | None = None,  # [num_rows, N] contiguous, of out_dtype: written in place
    slices: int | None = None,  # K slices; None: `splitk_plan`
) -> torch.Tensor:  # [num_rows, N]
    """Same result as `F.linear(x, weight, bias).to(out_dtype)` up to float32 summation order, in
    one launch whatever the slices (no separate reduce kernel); CUDA-graph capturable once a
    call of at least this size ran eagerly on the device (the workspace is allocated then; a
    capture that would need a larger one runs unsplit)."""
    device = x.device
    _cuda.check(
        fits(x, weight) and x.shape[0] <= SPLITK_MAX_ROWS,
        f"skinny_linear_splitk takes {tuple(x.shape)} x {tuple(weight.shape)}: see fits(), <= {SPLITK_MAX_ROWS} rows",
    )
    _cuda.check(weight.device == device, f"weight is on {weight.device}, expected {device}")
    out_dtype = out_dtype or x.dtype
    _cuda.check(out_dtype in (x.dtype, torch.float32), f"out_dtype {out_dtype}: {x.dtype} or float32")
    num_rows, k = x.shape
    n = weight.shape[0]
    if bias is not None:
        _cuda.check_cuda_tensor("bias", bias, [x.dtype], 1, device)
        _cuda.check(bias.shape[0] == n and bias.is_contiguous(), f"bias has shape {tuple(bias.shape)}")
    if slices is None:
        slices, k_per_split = splitk_plan(n, k, _cuda.num_sms(device.index or 0))
    else:
        _cuda.check(slices >= 1, f"slices {slices}: at least 1")
        slices, k_per_split = _slices(k, slices)
    if out is None:
        out = torch.empty(num_rows, n, dtype=out_dtype, device=device)
    _cuda.check(
        out.shape == (num_rows, n)
        and out.dtype == out_dtype
        and out.is_contiguous()
        and out.device == device,
        f"out must be a contiguous {out_dtype} [{num_rows}, {n}] tensor on {device}",
    )
    tiles = -(-n // WARPS_PER_BLOCK)
    buffers = _workspace(device).get(slices * num_rows * n, tiles, device) if slices > 1 else None
    if buffers is None:
        slices, k_per_split = 1, k
    partial, counters = buffers if buffers is not None else (out, out)
    kernel = _cuda.function(
        SOURCE,
        "skinny_linear_splitk",
        device,
        DTYPE=_cuda.DTYPE_IDS[x.dtype],
        MROWS=next(v for v in SPLITK_VARIANTS if v >= num_rows),
        ROWS=1,
        WARPS=WARPS_PER_BLOCK,
        UNROLL=UNROLL,
        HAS_BIAS=int(bias is not None),
        OUT_F32=int(out_dtype == torch.float32 and x.dtype != torch.float32),
    )
    _cuda.launch(
        kernel,
        (tiles, slices),
        (32 * WARPS_PER_BLOCK,),
        (
            x,
            weight,
            bias if bias is not None else weight,
            out,
            partial,
            counters,
            np.int32(num_rows),
            np.int32(n),
            np.int32(k),
            np.int64(x.stride(0)),
            np.int32(k_per_split),
        ),
        device,
    )
    return out
