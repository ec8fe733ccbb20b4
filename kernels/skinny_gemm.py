"""CUDA skinny matrix product for decode steps: y = x @ weight.T + bias with few rows of x.

A decode step at batch 1 multiplies one token row by every weight matrix of the model, so its
time is the time to stream the weights from memory once. This kernel reads each weight row once,
16 bytes per lane, UNROLL loads in flight per warp. Measured on an H100 (kernels/NOTES.md) it reads
the large wide matrices at 95-102% of copy bandwidth against cuBLAS's 86-95% (LM heads, Qwen2.5-7B's
gate_up: ~5% of a 7B model's step) and, on an H200, beats cuBLAS on the small wide projections too
(Llama-3.2-1B's qkv / o, Qwen2.5-7B's o), while cuBLAS is as fast or faster on mid-size or tall
matrices and stays flat from 1 to 16 rows where this kernel's time grows with the rows (every warp
re-reads x from cache). So `kernels.linear` uses it for one row of a large or small wide matrix
only (`preferred`).

Layout: one warp computes ROWS consecutive outputs (weight rows) for all rows of x; lanes stride
the reduction dimension 16 bytes at a time, UNROLL loads in flight, float32 accumulation, a warp
shuffle reduction, and one rounding to the output dtype (cuBLAS rounds once too, so the two differ
only by float32 summation order). x is read through the read-only cache; every warp reads all of
it; the kernel takes up to MAX_ROWS rows (tested), `preferred` says when it beats cuBLAS. Its torch
twin is `F.linear`, which `kernels.linear` runs everywhere else.
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
"""`preferred` from this weight size up (one row, H100 sweep: LM heads, 7B gate_up)."""
PREFERRED_MAX_SMALL_BYTES = 30 * 2**20
"""`preferred` up to this weight size too (one row, H200: 1B qkv 12.6 MB and o 8.4 MB, 7B o 25.7 MB
beat cuBLAS; 7B qkv 33.0 MB loses slightly). Between the two bounds cuBLAS is as fast or faster."""
WIDE_OUTPUTS = 16384
"""From this many outputs up, a warp computes two of them (more bytes in flight per warp);
below it one (more warps over the card)."""

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
    """True when the kernel should run instead of cuBLAS: one row and a weight with at least as many
    outputs as inputs (with fewer, e.g. a down projection, too few warps stream the long rows and
    cuBLAS's split-K is faster) that is large (>= PREFERRED_MIN_WEIGHT_BYTES) or small
    (<= PREFERRED_MAX_SMALL_BYTES)."""
    weight_bytes = weight.numel() * weight.element_size()
    sized = weight_bytes >= PREFERRED_MIN_WEIGHT_BYTES or weight_bytes <= PREFERRED_MAX_SMALL_BYTES
    wide = weight.dim() == 2 and weight.shape[0] >= weight.shape[1]
    return x.dim() == 2 and x.shape[0] == 1 and sized and wide and fits(x, weight)


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
