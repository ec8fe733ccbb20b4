"""CUDA kernels of quantized linear layers (weight formats: kernels/quant_ref.py).

A decode step's few rows are bound by reading the weights, so the one-row product reads the
quantized bytes and dequantizes them in registers (`quant_gemv`): a quarter (int4) or half (fp8,
int8) of a bf16 weight's bytes. Layout as kernels/skinny_gemm.py: one warp per ROWS output
features, lanes striding the input features 16 weight bytes at a time (16 fp8 / int8 values, 32 int4
values), UNROLL loads in flight, float32 accumulation, each 16-byte chunk's dot product multiplied
by its group's scale, a warp-shuffle reduction, one rounding to x's dtype.

More rows (verify batches, prefill chunks) need tensor cores, where every weight value serves many
rows. FP8 quantizes the activations per token (`fp8_quantize_rows`) and multiplies on the FP8
tensor cores (`torch._scaled_mm`, row-wise scales; sm_89 and later). int8 / int4 (and fp8 before
sm_89) run `quant_mma`: bf16 / fp16 mma.sync with the weight dequantized in registers as it is read
(up to MMA_MAX_ROWS rows; each block of 64 rows reads the weight once). Past that the step is
compute-bound and the weight is dequantized into a temporary matrix (`dequantize_weight`) for
cuBLAS's GEMM, its extra write and read spread over the many rows.

fp8 values are decoded without the hardware conversion: e4m3's sign, 4 exponent and 3 mantissa
bits placed into an fp16's (exponent bits 10-13, mantissa 7-9) read as 2^-8 times the e4m3 value
for normals and subnormals alike, so the decode is two masks and a shift and the 256 goes into the
scale.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from kernels import _cuda
from kernels.quant_ref import FP8_DTYPE, FP8_MAX, MIN_SCALE, SCHEMES

MAX_ROWS = 16
"""Most rows `quant_gemv` takes; variants are compiled for 1, 2, 4, 8 and 16."""
ROW_VARIANTS = (1, 2, 4, 8, 16)
WARPS_PER_BLOCK = 4
UNROLL = 2
WIDE_OUTPUTS = 16384
"""From this many outputs up a warp computes two of them, below one (as in skinny_gemm)."""
SCHEME_IDS = {"fp8": 0, "int8": 1, "int4": 2}
VALUES_PER_CHUNK = {"fp8": 16, "int8": 16, "int4": 32}
"""Weight values in the 16 bytes one lane loads at a time."""
SCALED_MM_MIN_CAPABILITY = (8, 9)
FP8_GEMV_MAX_ROWS = 4
"""fp8 products of more rows go to `_scaled_mm` where it applies: the one-row kernel's time grows with
the rows (kernels/NOTES.md, quant_linear on an H200)."""
MMA_MIN_CAPABILITY = (8, 0)
MMA_MAX_ROWS = 256
"""Most rows `quant_mma` takes in `kernels.quant_linear`; more go to dequantize + cuBLAS."""
MMA_K = 64
MMA_BLOCK = (128, 64)
"""Outputs and rows of x one `quant_mma` block computes."""
MMA_ENV = "SPECMESH_QUANT_MMA"
"""Set to `off` to run every product past MAX_ROWS rows through dequantize + cuBLAS (A/B timing)."""
QUANTIZE_THREADS = 256

_DECODE = r"""
#define SCH_FP8 0
#define SCH_INT8 1
#define SCH_INT4 2
#if SCHEME == SCH_INT4
#define VALS 32
#else
#define VALS 16
#endif
__device__ __forceinline__ float half_bits_to_float(unsigned short h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
/* 16 stored bytes -> VALS float values (fp8: 2^-8 times the e4m3 value; the caller scales by 256) */
__device__ __forceinline__ void decode_chunk(const uint4& raw, float* out) {
    const unsigned char* b = reinterpret_cast<const unsigned char*>(&raw);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
#if SCHEME == SCH_FP8
        out[i] = half_bits_to_float((unsigned short)(((b[i] & 0x80) << 8) | ((b[i] & 0x7f) << 7)));
#elif SCHEME == SCH_INT8
        out[i] = (float)((int)b[i] - 128);
#else
        out[2 * i] = (float)((int)(b[i] & 15) - 8);
        out[2 * i + 1] = (float)((int)(b[i] >> 4) - 8);
#endif
    }
}
#if SCHEME == SCH_FP8
#define DECODE_SCALE 256.f
#else
#define DECODE_SCALE 1.f
#endif
"""

GEMV_SOURCE = (
    _cuda.CONVERSIONS
    + _DECODE
    + r"""
/* y[m, n] = sum_k x[m, k] * q[n, k] * scale[n, k / group_size] (+ bias[n]) for m < num_rows <= MROWS */
extern "C" __global__ void __launch_bounds__(32 * WARPS) quant_gemv(
    const scalar_t* __restrict__ x,        /* [num_rows, K], rows x_stride elements apart */
    const unsigned char* __restrict__ w,   /* [N, row_bytes] stored weight */
    const float* __restrict__ scale,       /* [N, K / group_size] */
    const scalar_t* __restrict__ bias,     /* [N]; unused without HAS_BIAS */
    scalar_t* __restrict__ y,              /* [num_rows, N] contiguous */
    int num_rows, int N, int K, int group_size, long long x_stride)
{
    const int lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * ROWS;
    if (n0 >= N) return;
    const int num_chunks = K / VALS;
    const long long row_bytes = (long long)num_chunks * 16;
    const int num_groups = K / group_size;
    const uint4* wr[ROWS];
    const float* sr[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int n = min(n0 + r, N - 1);
        wr[r] = reinterpret_cast<const uint4*>(w + n * row_bytes);
        sr[r] = scale + (long long)n * num_groups;
    }
    float acc[ROWS][MROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int m = 0; m < MROWS; ++m) acc[r][m] = 0.f;

    for (int c0 = lane; c0 < num_chunks; c0 += 32 * UNROLL) {
        uint4 raw[UNROLL][ROWS];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + u * 32;
#pragma unroll
            for (int r = 0; r < ROWS; ++r) raw[u][r] = c < num_chunks ? __ldg(wr[r] + c) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + u * 32;
            if (c >= num_chunks) break;
            const int k = c * VALS;
            float wv[ROWS][VALS];
            float s[ROWS];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                decode_chunk(raw[u][r], wv[r]);
                s[r] = __ldg(sr[r] + k / group_size) * DECODE_SCALE;
            }
#pragma unroll
            for (int m = 0; m < MROWS; ++m) {
                if (m < num_rows) {
                    float dot[ROWS];
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) dot[r] = 0.f;
#pragma unroll
                    for (int v = 0; v < VALS; v += VEC) {
                        float xv[VEC];
                        load_vec(x + m * x_stride + k + v, xv);
#pragma unroll
                        for (int r = 0; r < ROWS; ++r)
#pragma unroll
                            for (int i = 0; i < VEC; ++i) dot[r] = fmaf(xv[i], wv[r][v + i], dot[r]);
                    }
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) acc[r][m] = fmaf(dot[r], s[r], acc[r][m]);
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
                y[(long long)m * N + n] = from_float(v);
            }
        }
    }
}

/* ---- tensor-core variant: y = x @ dequantize(w).T (+ bias) for any number of rows (bf16 / fp16) ----
   mma.sync m16n8k16 with the weight dequantized to x's dtype in registers (rounded as the reference
   rounds it), float32 accumulation. A block of 4 warps takes MMA_M rows of x (grid.y) and MMA_N
   outputs (grid.x), each warp 32 outputs (4 n8 tiles) for all the block's rows (4 m16 tiles); K goes
   in steps of 64, x's 64 x 64 tile staged in shared memory, the next step's weights loaded while
   this one multiplies. Lane (g = lane / 4, t = lane % 4) reads 16 consecutive weight values of output
   row g of each n8 tile, k = 16 t .. 16 t + 15 of the step, and feeds values 4 s .. 4 s + 3 to the
   fragment slots {2t, 2t+1, 2t+8, 2t+9} of the step's s-th k16 mma; its A fragments take x at the
   same k, so every mma sums matching products (a permutation of k, the same for both operands).
   bf16 mma needs sm_80: older cards compile the one-row kernels without it (mma_fits refuses them). */
#if DTYPE != DT_F32 && __CUDA_ARCH__ >= 800
#define MMA_M 64
#define MMA_N 128
#define MMA_K 64
#define X_PITCH (MMA_K + 8)   /* elements a shared row: padding spreads the rows over banks */
#if DTYPE == DT_BF16
#define MMA_TYPE "bf16"
#else
#define MMA_TYPE "f16"
#endif
#if SCHEME == SCH_INT4
typedef uint2 wraw_t;          /* 16 int4 values */
#else
typedef uint4 wraw_t;          /* 16 fp8 / int8 values */
#endif
__device__ __forceinline__ void mma16816(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    return (unsigned)from_float(lo) | ((unsigned)from_float(hi) << 16);
}
/* 16 stored values -> 16 floats (fp8: 2^-8 times the value, as decode_chunk) */
__device__ __forceinline__ void decode16(const wraw_t& raw, float* out) {
    const unsigned char* b = reinterpret_cast<const unsigned char*>(&raw);
#if SCHEME == SCH_INT4
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        out[2 * i] = (float)((int)(b[i] & 15) - 8);
        out[2 * i + 1] = (float)((int)(b[i] >> 4) - 8);
    }
#else
    uint4 whole = raw;
    decode_chunk(whole, out);
#endif
}

extern "C" __global__ void __launch_bounds__(128) quant_mma(
    const scalar_t* __restrict__ x,        /* [num_rows, K], rows x_stride elements apart */
    const unsigned char* __restrict__ w,   /* [N, row_bytes] stored weight */
    const float* __restrict__ scale,       /* [N, K / group_size] */
    const scalar_t* __restrict__ bias,     /* [N]; unused without HAS_BIAS */
    scalar_t* __restrict__ y,              /* [num_rows, N] contiguous */
    int num_rows, int N, int K, int group_size, long long x_stride)
{
    __shared__ __align__(16) scalar_t xs[MMA_M * X_PITCH];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int m0 = blockIdx.y * MMA_M;
    const int n_warp = blockIdx.x * MMA_N + warp * 32;
    const long long row_bytes = (long long)K * (SCHEME == SCH_INT4 ? 1 : 2) / 2;
    const int num_groups = K / group_size;
    const unsigned char* wr[4];
    const float* sr[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int n = min(n_warp + 8 * j + g, N - 1);
        wr[j] = w + n * row_bytes;
        sr[j] = scale + (long long)n * num_groups;
    }
    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

    const int value_bytes_x2 = SCHEME == SCH_INT4 ? 1 : 2;   /* bytes of two values */
    wraw_t raw[4], next[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) raw[j] = *reinterpret_cast<const wraw_t*>(wr[j] + (16 * t) * value_bytes_x2 / 2);
    for (int k0 = 0; k0 < K; k0 += MMA_K) {
        const int k_next = k0 + MMA_K;
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (k_next < K) next[j] = *reinterpret_cast<const wraw_t*>(wr[j] + (k_next + 16 * t) * value_bytes_x2 / 2);
        __syncthreads();   /* the previous step's readers are done with xs */
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int row = q * 16 + (threadIdx.x >> 3), col = (threadIdx.x & 7) * 8;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (m0 + row < num_rows) v = *reinterpret_cast<const uint4*>(x + (m0 + row) * x_stride + k0 + col);
            *reinterpret_cast<uint4*>(&xs[row * X_PITCH + col]) = v;
        }
        __syncthreads();
        unsigned b[4][8];   /* per n8 tile, per k16 mma: (b0, b1) */
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float v[16];
            decode16(raw[j], v);
            const float s = __ldg(sr[j] + (k0 + 16 * t) / group_size) * DECODE_SCALE;
#pragma unroll
            for (int i = 0; i < 8; ++i) b[j][i] = pack2(v[2 * i] * s, v[2 * i + 1] * s);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const scalar_t* lo = &xs[(16 * i + g) * X_PITCH + 16 * t];
            const scalar_t* hi = lo + 8 * X_PITCH;
            const uint4 lo0 = *reinterpret_cast<const uint4*>(lo), lo1 = *reinterpret_cast<const uint4*>(lo + 8);
            const uint4 hi0 = *reinterpret_cast<const uint4*>(hi), hi1 = *reinterpret_cast<const uint4*>(hi + 8);
            /* values 4s .. 4s+3 of row g (lo) and g + 8 (hi) for mma s: a = {lo[4s..], hi[4s..], lo[4s+2..], hi[4s+2..]} */
            const unsigned a[4][4] = {
                {lo0.x, hi0.x, lo0.y, hi0.y}, {lo0.z, hi0.z, lo0.w, hi0.w},
                {lo1.x, hi1.x, lo1.y, hi1.y}, {lo1.z, hi1.z, lo1.w, hi1.w}};
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int s = 0; s < 4; ++s) mma16816(acc[i][j], a[s], b[j][2 * s], b[j][2 * s + 1]);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) raw[j] = next[j];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int m = m0 + 16 * i + g + (c >= 2 ? 8 : 0);
                const int n = n_warp + 8 * j + 2 * t + (c & 1);
                if (m < num_rows && n < N) {
                    float v = acc[i][j][c];
#if HAS_BIAS
                    v += to_float(bias[n]);
#endif
                    y[(long long)m * N + n] = from_float(v);
                }
            }
}
#endif

/* out[n, k] = q[n, k] * scale[n, k / group_size], one 16-byte chunk per thread */
extern "C" __global__ void dequantize_weight(
    const unsigned char* __restrict__ w, const float* __restrict__ scale, scalar_t* __restrict__ out,
    int N, int K, int group_size)
{
    const long long chunk = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int num_chunks = K / VALS;
    if (chunk >= (long long)N * num_chunks) return;
    const long long n = chunk / num_chunks;
    const int k = (int)(chunk % num_chunks) * VALS;
    float v[VALS];
    decode_chunk(__ldg(reinterpret_cast<const uint4*>(w) + chunk), v);
    const float s = scale[n * (K / group_size) + k / group_size] * DECODE_SCALE;
    scalar_t* dst = out + n * K + k;
#pragma unroll
    for (int i = 0; i < VALS; ++i) dst[i] = from_float(v[i] * s);
}
"""
)

QUANTIZE_SOURCE = (
    _cuda.CONVERSIONS
    + f"#define FP8_MAX {FP8_MAX!r}f\n#define MIN_SCALE {MIN_SCALE!r}f\n"
    + r"""
/* Per row: scale = max(amax / FP8_MAX, MIN_SCALE), q = e4m3(x / scale) (round to nearest, saturated). */
extern "C" __global__ void __launch_bounds__(THREADS) fp8_quantize_rows(
    const scalar_t* __restrict__ x,       /* [num_rows, K], rows x_stride elements apart */
    unsigned short* __restrict__ q,       /* [num_rows, K] e4m3, two a 16-bit word */
    float* __restrict__ scale,            /* [num_rows] */
    int K, long long x_stride)
{
    __shared__ float warp_max[THREADS / 32];
    const scalar_t* row = x + blockIdx.x * x_stride;
    float amax = 0.f;
    for (int k = threadIdx.x; k < K; k += THREADS) amax = fmaxf(amax, fabsf(to_float(row[k])));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
    __syncthreads();
    amax = 0.f;
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) amax = fmaxf(amax, warp_max[w]);
    const float s = fmaxf(amax / FP8_MAX, MIN_SCALE);
    if (threadIdx.x == 0) scale[blockIdx.x] = s;
    unsigned short* out = q + (long long)blockIdx.x * (K / 2);
    for (int k = 2 * threadIdx.x; k < K; k += 2 * THREADS) {
        const float lo = to_float(row[k]) / s, hi = to_float(row[k + 1]) / s;
        unsigned short pair;
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
        out[k / 2] = pair;
    }
}
"""
)


def stored_in_features(qweight: torch.Tensor, scheme: str) -> int:
    """Input features of a stored weight: its bytes a row, times two for int4."""
    return qweight.shape[1] * qweight.element_size() * (2 if scheme == "int4" else 1)


def _operands_fit(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, scheme: str, group_multiple: int
) -> bool:
    """What both dequantizing kernels need: 2-D bf16 / fp16 rows, 16-byte aligned; a contiguous,
    16-byte aligned weight of the scheme's storage and x's input features; float32 scales, one row
    per output, in groups that divide the input features in multiples of `group_multiple`."""
    if scheme not in SCHEMES or x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if qweight.dim() != 2 or qweight.dtype != (FP8_DTYPE if scheme == "fp8" else torch.int32):
        return False
    if scale.dim() != 2:
        return False
    k = x.shape[1]
    num_groups = scale.shape[1]
    return (
        stored_in_features(qweight, scheme) == k
        and num_groups > 0
        and k % num_groups == 0
        and (k // num_groups) % group_multiple == 0
        and x.stride(1) == 1
        and x.stride(0) % 8 == 0
        and x.data_ptr() % 16 == 0
        and qweight.is_contiguous()
        and qweight.data_ptr() % 16 == 0
        and qweight.shape[0] == scale.shape[0]
        and scale.dtype == torch.float32
        and scale.is_contiguous()
    )


def gemv_fits(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, scheme: str) -> bool:
    """True when `quant_gemv` takes this product: 1..MAX_ROWS rows (`_operands_fit`), the input
    features and the group size whole 16-byte chunks of the stored weight."""
    if not _operands_fit(x, qweight, scale, scheme, VALUES_PER_CHUNK.get(scheme, 1)):
        return False
    num_rows, k = x.shape
    return 0 < num_rows <= MAX_ROWS and k % VALUES_PER_CHUNK[scheme] == 0


def mma_fits(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, scheme: str) -> bool:
    """True when `quant_mma` takes this product (`_operands_fit`) on sm_80+: input features a
    multiple of 64, groups of 16 or more (and SPECMESH_QUANT_MMA is not `off`)."""
    if os.environ.get(MMA_ENV, "").lower() == "off" or not _operands_fit(x, qweight, scale, scheme, 16):
        return False
    return (
        x.shape[0] > 0
        and x.shape[1] % MMA_K == 0
        and x.is_cuda
        and torch.cuda.get_device_capability(x.device) >= MMA_MIN_CAPABILITY
    )


def scaled_mm_fits(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """True when the FP8 tensor-core path takes x @ qweight.T: an sm_89+ card, bf16 activations
    (`_scaled_mm`'s row-wise scaling writes bf16 only), 16-multiple sizes."""
    return (
        qweight.dtype == FP8_DTYPE
        and x.dim() == 2
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= SCALED_MM_MIN_CAPABILITY
        and x.shape[-1] % 16 == 0
        and qweight.shape[0] % 16 == 0
    )


def _weight_bytes(qweight: torch.Tensor) -> torch.Tensor:
    return qweight.view(torch.uint8)


def quant_gemv_cuda(
    x: torch.Tensor,  # [num_rows, K], num_rows <= MAX_ROWS
    qweight: torch.Tensor,  # fp8 [N, K] or packed int32 [N, K * bits / 32]
    scale: torch.Tensor,  # [N, num_groups] float32
    scheme: str,
    bias: torch.Tensor | None = None,  # [N]
    rows_per_warp: int | None = None,  # 1 or 2; None: by the number of outputs
) -> torch.Tensor:  # [num_rows, N] in x's dtype
    """Same result as `quant_linear_ref` up to float32 summation order."""
    device = x.device
    _cuda.check(
        gemv_fits(x, qweight, scale, scheme),
        f"quant_gemv takes {scheme} {tuple(x.shape)} x "
        f"{tuple(qweight.shape)} (scale {tuple(scale.shape)}): see gemv_fits()",
    )
    _cuda.check(qweight.device == device and scale.device == device, "weight and scale must be on x's device")
    num_rows, k = x.shape
    n = qweight.shape[0]
    if bias is not None:
        _cuda.check_cuda_tensor("bias", bias, [x.dtype], 1, device)
        _cuda.check(bias.shape[0] == n and bias.is_contiguous(), f"bias has shape {tuple(bias.shape)}")
    rows = rows_per_warp or (2 if n >= WIDE_OUTPUTS else 1)
    _cuda.check(rows in (1, 2), f"rows_per_warp {rows}: 1 or 2")
    kernel = _cuda.function(
        GEMV_SOURCE,
        "quant_gemv",
        device,
        DTYPE=_cuda.DTYPE_IDS[x.dtype],
        SCHEME=SCHEME_IDS[scheme],
        MROWS=next(v for v in ROW_VARIANTS if v >= num_rows),
        ROWS=rows,
        WARPS=WARPS_PER_BLOCK,
        UNROLL=UNROLL,
        HAS_BIAS=int(bias is not None),
    )
    out = torch.empty(num_rows, n, dtype=x.dtype, device=device)
    warps = -(-n // rows)
    args = (x, _weight_bytes(qweight), scale, bias if bias is not None else x, out)
    sizes = (
        np.int32(num_rows),
        np.int32(n),
        np.int32(k),
        np.int32(k // scale.shape[1]),
        np.int64(x.stride(0)),
    )
    _cuda.launch(kernel, (-(-warps // WARPS_PER_BLOCK),), (32 * WARPS_PER_BLOCK,), args + sizes, device)
    return out


def quant_mma_cuda(
    x: torch.Tensor,  # [num_rows, K]
    qweight: torch.Tensor,  # fp8 [N, K] or packed int32 [N, K * bits / 32]
    scale: torch.Tensor,  # [N, num_groups] float32
    scheme: str,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [num_rows, N] in x's dtype
    """Same result as `quant_linear_ref` (the weight dequantized to x's dtype) up to float32
    summation order, on tensor cores."""
    device = x.device
    _cuda.check(
        mma_fits(x, qweight, scale, scheme),
        f"quant_mma takes {scheme} {tuple(x.shape)} x {tuple(qweight.shape)} (scale {tuple(scale.shape)}): "
        "see mma_fits()",
    )
    _cuda.check(qweight.device == device and scale.device == device, "weight and scale must be on x's device")
    num_rows, k = x.shape
    n = qweight.shape[0]
    if bias is not None:
        _cuda.check_cuda_tensor("bias", bias, [x.dtype], 1, device)
        _cuda.check(bias.shape[0] == n and bias.is_contiguous(), f"bias has shape {tuple(bias.shape)}")
    kernel = _cuda.function(
        GEMV_SOURCE,
        "quant_mma",
        device,
        DTYPE=_cuda.DTYPE_IDS[x.dtype],
        SCHEME=SCHEME_IDS[scheme],
        MROWS=1,
        ROWS=1,
        WARPS=WARPS_PER_BLOCK,
        UNROLL=UNROLL,
        HAS_BIAS=int(bias is not None),
    )
    out = torch.empty(num_rows, n, dtype=x.dtype, device=device)
    grid = (-(-n // MMA_BLOCK[0]), -(-num_rows // MMA_BLOCK[1]))
    args = (x, _weight_bytes(qweight), scale, bias if bias is not None else x, out)
    sizes = (
        np.int32(num_rows),
        np.int32(n),
        np.int32(k),
        np.int32(k // scale.shape[1]),
        np.int64(x.stride(0)),
    )
    _cuda.launch(kernel, grid, (128,), args + sizes, device)
    return out


def dequantize_weight_cuda(
    qweight: torch.Tensor,  # fp8 [N, K] or packed int32 [N, K * bits / 32]
    scale: torch.Tensor,  # [N, num_groups] float32
    scheme: str,
    dtype: torch.dtype,  # bfloat16 or float16
) -> torch.Tensor:  # [N, K]
    """Same result as `dequantize_weight_ref` (q * scale in float32, rounded once)."""
    device = qweight.device
    n = qweight.shape[0]
    k = stored_in_features(qweight, scheme)
    vals = VALUES_PER_CHUNK[scheme]
    _cuda.check(
        dtype in (torch.bfloat16, torch.float16), f"dequantize_weight writes bf16 / fp16, not {dtype}"
    )
    _cuda.check(
        qweight.is_contiguous() and k % vals == 0,
        f"weight {tuple(qweight.shape)}: contiguous, {vals}-value chunks",
    )
    _cuda.check(
        scale.dtype == torch.float32
        and scale.is_contiguous()
        and scale.shape[0] == n
        and (k // scale.shape[1]) % vals == 0,
        f"scale {tuple(scale.shape)} does not fit the weight",
    )
    kernel = _cuda.function(
        GEMV_SOURCE,
        "dequantize_weight",
        device,
        DTYPE=_cuda.DTYPE_IDS[dtype],
        SCHEME=SCHEME_IDS[scheme],
        MROWS=1,
        ROWS=1,
        WARPS=1,
        UNROLL=1,
        HAS_BIAS=0,
    )
    out = torch.empty(n, k, dtype=dtype, device=device)
    num_chunks = n * k // vals
    threads = 256
    args = (_weight_bytes(qweight), scale, out, np.int32(n), np.int32(k), np.int32(k // scale.shape[1]))
    _cuda.launch(kernel, (-(-num_chunks // threads),), (threads,), args, device)
    return out


def fp8_quantize_rows_cuda(
    x: torch.Tensor,  # [num_rows, K] bf16 / fp16, K even
) -> tuple[torch.Tensor, torch.Tensor]:  # (float8_e4m3fn [num_rows, K], scale float32 [num_rows, 1])
    """Same result as `quantize_fp8_per_token_ref`; sm_89 and later (the e4m3 conversion)."""
    device = x.device
    _cuda.check_cuda_tensor("x", x, [torch.bfloat16, torch.float16], 2, device)
    num_rows, k = x.shape
    _cuda.check(k % 2 == 0 and x.stride(1) == 1, f"x {tuple(x.shape)}: an even number of contiguous columns")
    kernel = _cuda.function(
        QUANTIZE_SOURCE, "fp8_quantize_rows", device, DTYPE=_cuda.DTYPE_IDS[x.dtype], THREADS=QUANTIZE_THREADS
    )
    q = torch.empty(num_rows, k, dtype=FP8_DTYPE, device=device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=device)
    if num_rows:
        args = (x, q.view(torch.uint8), scale, np.int32(k), np.int64(x.stride(0)))
        _cuda.launch(kernel, (num_rows,), (QUANTIZE_THREADS,), args, device)
    return q, scale


def fp8_scaled_mm_cuda(
    x: torch.Tensor,  # [num_rows, K] bf16
    qweight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N, 1] float32
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [num_rows, N] bf16
    """Same result as `fp8_scaled_mm_ref` up to float32 summation order: x quantized per token,
    the product on the FP8 tensor cores with row-wise scales."""
    _cuda.check(
        scaled_mm_fits(x, qweight),
        f"fp8 _scaled_mm takes {tuple(x.shape)} x {tuple(qweight.shape)}: see scaled_mm_fits()",
    )
    x_q, x_scale = fp8_quantize_rows_cuda(x)
    out = torch._scaled_mm(x_q, qweight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype)
    return out if bias is None else out.add_(bias)
