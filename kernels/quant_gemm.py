"""CUDA kernels of quantized linear layers (weight formats: kernels/quant_ref.py).

int8 / int4 (`quant_mma`, any row count; `kernels.quant_linear` gives it up to MMA_MAX_ROWS): the
weight is the A operand of bf16 / fp16 mma.sync m16n8k16, x the B operand, so one row wastes the
B columns but not the weight bytes, and the arithmetic per weight byte stays small at any row count.
Each lane loads 16 stored bytes at a time (16 int8 / 32 int4 values of one output) and turns them
into exact x-dtype values with a few bit operations (`decode_constants`); the four lanes of a quad
cover MMA_STEP consecutive input features of 8 outputs, so a warp's loads of one output row are 64
contiguous bytes. The stored layout is the compressed-tensors one unchanged: instead of permuting
the weight, each lane gives x's B fragments the same order of input features as its weights
(`x_pairs`). Products accumulate unscaled in float32 over one K step and are multiplied by the step's
group scale, which is why groups must be whole steps. Up to 16 rows the weight read bounds the time:
two steps' loads in flight a warp and K split over the grid until the SMs hold several blocks each,
the partial sums added by `quant_mma_reduce`; more rows take up to 64 rows a block.

fp8 (and int8 / int4 groups that are not whole steps): `quant_gemv`, one warp per output or two, lanes
striding the input features 16 weight bytes at a time, dequantized in registers, float32 FMAs (as
kernels/skinny_gemm.py), up to MAX_ROWS rows; its time grows with the rows. More fp8 rows quantize
the activations per token (`fp8_quantize_rows`) and multiply on the FP8 tensor cores
(`torch._scaled_mm`, row-wise scales; sm_89 and later). Past what the kernels take the weight is
dequantized into a temporary matrix (`dequantize_weight`) for cuBLAS's GEMM.

fp8 values are decoded without the hardware conversion: e4m3's sign, 4 exponent and 3 mantissa
bits placed into an fp16's (exponent bits 10-13, mantissa 7-9) read as 2^-8 times the e4m3 value
for normals and subnormals alike, so the decode is two masks and a shift and the 256 goes into the
scale.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch

from kernels import _cuda, ptx
from kernels.quant_ref import BITS, FP8_DTYPE, FP8_MAX, MIN_SCALE, SCHEMES

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
MMA_MAX_ROWS = 64
"""Most rows `kernels.quant_linear` gives `quant_mma` (where `quant_tiled` does not take them); more
go to dequantize + cuBLAS, whose 16-byte dequantize made it the fastest past 64 rows on an H100
(7B matrices at 256 rows, int4: 36-336 us against quant_mma's 66-843 and quant_tiled's 56-491)."""
TILED_MIN_ROWS = 16
TILED_MAX_ROWS = 64
TILED_MIN_WIDTH = 0
"""`quant_tiled` takes TILED_MIN_ROWS-TILED_MAX_ROWS rows of a matrix with at least TILED_MIN_WIDTH
outputs per input feature (0: every matrix). Its K split summed by a second kernel
(kernels/quant_tiled.py `split_reduce`) is what lets it take the small matrices again. Set from
`benchmarks.gpu_kernels --only quant_linear` on an H200 (1B and 7B matrices): quant_tiled the
fastest int8 / int4 kernel at 32 and 64 rows on every matrix, at 16 within a few percent of
quant_mma for int8 (ahead for int4), and at 128 rows behind dequantize + cuBLAS on every int8
matrix (kernels/NOTES.md)."""
INT_GEMV_MAX_ROWS = 1
"""int8 / int4 products of this many rows stay on `quant_gemv` (H100, one row, summed over the 1B /
7B matrices: 132 us int4 against quant_mma's 136 and quant_tiled's 144; int8 149 / 180 / 204)."""
MMA_STEP = {"int8": 64, "int4": 128}
"""Input features of one `quant_mma` K step (a quad's four 16-byte chunks): the group size (and so
the input features) must be a multiple."""
MMA_WARPS = 4
MMA_TILES_M = 2
"""m16 output tiles of a `quant_mma` warp: 32 outputs."""
MMA_ROW_TILES = (1, 2, 4, 8)
"""n8 tiles of x rows a `quant_mma` block takes (compiled variants): the fewest that cover the rows,
8 (64 rows) past 32 rows."""
MMA_BLOCKS_PER_SM = (4, 2)
"""Blocks an SM `mma_config` splits K to reach: up to 16 rows (streaming the weight bounds the
time), and past 16 rows (heavier blocks; each split adds a float32 partial sum to write and read)."""
MMA_PARTIAL_FRACTION = 0.25
"""Most bytes of float32 partial sums (written and read) a K split may add, over the weight's bytes."""
MMA_ENV = "SPECMESH_QUANT_MMA"
"""Set to `off` to run every int8 / int4 product through `quant_gemv` (up to MAX_ROWS rows) or
dequantize + cuBLAS (A/B timing)."""
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

/* out[n, k] = q[n, k] * scale[n, k / group_size], one 16-byte chunk per thread, written 8 values
   (16 bytes) a store */
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
    uint4* dst = reinterpret_cast<uint4*>(out + n * K + k);
#pragma unroll
    for (int i = 0; i < VALS / 8; ++i) {
        unsigned pairs[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
            pairs[j] = (unsigned)from_float(v[8 * i + 2 * j] * s) | ((unsigned)from_float(v[8 * i + 2 * j + 1] * s) << 16);
        dst[i] = make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
    }
}
"""
)

MMA_SOURCE = (
    _cuda.CONVERSIONS
    + r"""
/* quant_mma: y = x @ dequantize(w).T (+ bias) for int8 / int4 weights on bf16 / fp16 tensor cores
   (layout: the module docstring). The weight is the A operand of mma.sync m16n8k16 (16 outputs a
   tile), x the B operand (8 rows a tile). Lane (g = lane / 4, t = lane % 4) of a warp reads, each K
   step, the 16-byte chunk t of outputs g and g + 8 of its WM m16 tiles; each 8-value unit of a chunk
   feeds two mmas, and the lane's B fragments take x row g at the same 8 input features in the same
   order, so both operands sum matching products. Each step's products accumulate unscaled (integer
   weights times x are exact in float32) and are multiplied by the step's group scale in float32.
   A block's WARPS warps form WARPS / KW slices of 16 * WM outputs by the block's 8 * NT rows; the KW
   warps of a slice take turns (UNROLL steps each) over the block's K range (grid z) and add up in
   shared memory. KW = WARPS where the grid would hold too few blocks otherwise; KW = 1 lets the
   warps of a block read the same x tile at about the same time (from L1). */
#define SCH_INT8 1
#define SCH_INT4 2
#if SCHEME == SCH_INT4
#define VALS 32              /* weight values in a lane's 16-byte chunk */
#define UNITS 4              /* 8-value units of a chunk: one 32-bit word each */
#define ROW_BYTES(K) ((K) / 2)
#else
#define VALS 16
#define UNITS 2              /* two 32-bit words each */
#define ROW_BYTES(K) (K)
#endif
#define STEP (4 * VALS)      /* input features of one K step: chunks t = 0..3 of a quad */
"""
    + ptx.MMA_M16N8K16
    + ptx.PRMT
    + ptx.HALF_PAIRS
    + r"""

/* Unit u of a stored chunk -> pairs p[0..3] of x's dtype holding the weight values q (exact):
   int4 (word w = features 0..7 as nibbles): p[j] = (feature j, feature j + 4), the nibbles at bits
   0-3 and 16-19 of w >> 4j placed in the mantissa of MAGIC_X2 (2^7 + v in bf16, 2^10 + v in fp16),
   then OFFSET_X2 (-(magic + 8)) added; int8 (words w0, w1 = features 0..3, 4..7): p[j] = features
   (2j, 2j + 1), bf16 through float32 (2^23 + v, minus 2^23 + 128), fp16 as int4 with whole bytes. */
__device__ __forceinline__ void decode_unit(const uint4& raw, int u, unsigned* p) {
    const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#if SCHEME == SCH_INT4
    const unsigned w = words[u];
#pragma unroll
    for (int j = 0; j < 4; ++j)
        p[j] = fma_x2(((w >> (4 * j)) & 0x000F000Fu) | (unsigned)MAGIC_X2, (unsigned)ONE_X2, (unsigned)OFFSET_X2);
#else
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const unsigned w = words[2 * u + h];
#if DTYPE == DT_BF16
        float f[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
            f[i] = __uint_as_float(prmt(w, (unsigned)FLOAT_MAGIC, 0x7540 + i)) - __uint_as_float((unsigned)FLOAT_OFFSET);
        p[2 * h] = pack_x2(f[0], f[1]);
        p[2 * h + 1] = pack_x2(f[2], f[3]);
#else
        p[2 * h] = fma_x2(prmt(w, (unsigned)MAGIC_X2, 0x7150), (unsigned)ONE_X2, (unsigned)OFFSET_X2);
        p[2 * h + 1] = fma_x2(prmt(w, (unsigned)MAGIC_X2, 0x7352), (unsigned)ONE_X2, (unsigned)OFFSET_X2);
#endif
    }
#endif
}

/* 8 consecutive x values (one uint4) -> the B pairs matching decode_unit's order */
__device__ __forceinline__ void x_pairs(const uint4& v, unsigned* b) {
#if SCHEME == SCH_INT4
    b[0] = prmt(v.x, v.z, 0x5410);   /* (x0, x4) */
    b[1] = prmt(v.x, v.z, 0x7632);   /* (x1, x5) */
    b[2] = prmt(v.y, v.w, 0x5410);   /* (x2, x6) */
    b[3] = prmt(v.y, v.w, 0x7632);   /* (x3, x7) */
#else
    b[0] = v.x; b[1] = v.y; b[2] = v.z; b[3] = v.w;
#endif
}

/* the stored chunks (lane's chunk t of outputs g, g + 8 of each m16 tile) and group scales of steps
   s0 .. s0 + UNROLL - 1; zeros past step_end */
__device__ __forceinline__ void load_turn(
    uint4 (&raw)[UNROLL][WM][2], float (&sc)[UNROLL][WM][2], const uint4* const (&wr)[WM][2],
    const float* const (&sr)[WM][2], int s0, int step_end, int group_size)
{
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const bool live = s0 + u < step_end;
        const int group = live ? (s0 + u) * STEP / group_size : 0;
#pragma unroll
        for (int i = 0; i < WM; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                raw[u][i][h] = live ? __ldg(wr[i][h] + 4 * (s0 + u)) : make_uint4(0u, 0u, 0u, 0u);
                sc[u][i][h] = live ? __ldg(sr[i][h] + group) : 0.f;
            }
    }
}

extern "C" __global__ void __launch_bounds__(32 * WARPS) quant_mma(
    const scalar_t* __restrict__ x,        /* [num_rows, K], rows x_stride elements apart */
    const unsigned char* __restrict__ w,   /* [N, K * bits / 8] stored weight */
    const float* __restrict__ scale,       /* [N, K / group_size] */
    const scalar_t* __restrict__ bias,     /* [N]; unused without HAS_BIAS */
    scalar_t* __restrict__ y,              /* [num_rows, N]: written when gridDim.z == 1 */
    float* __restrict__ partial,           /* [gridDim.z, num_rows, N]: written when gridDim.z > 1 */
    int num_rows, int N, int K, int group_size, long long x_stride, int steps_per_split)
{
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int k_warp = warp % KW;   /* the KW warps of an output slice take turns over its K steps */
    const int n_warp = (blockIdx.x * (WARPS / KW) + warp / KW) * 16 * WM;
    const bool active = n_warp < N;
    const int m0 = blockIdx.y * 8 * NT;
    const int step_begin = blockIdx.z * steps_per_split;
    const int step_end = min(step_begin + steps_per_split, K / STEP);
    const int num_groups = K / group_size;
    const uint4* wr[WM][2];
    const float* sr[WM][2];
#pragma unroll
    for (int i = 0; i < WM; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int n = min(n_warp + 16 * i + 8 * h + g, N - 1);
            wr[i][h] = reinterpret_cast<const uint4*>(w + (long long)n * ROW_BYTES(K)) + t;
            sr[i][h] = scale + (long long)n * num_groups;
        }
    float acc[WM][NT][4];
#pragma unroll
    for (int i = 0; i < WM; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

    /* A warp's turn: UNROLL consecutive steps, every load issued before any math; the next turn's
       loads are issued before this turn's math (registers double-buffered). */
    uint4 next[UNROLL][WM][2];
    float next_scale[UNROLL][WM][2];
    const int my_end = active ? step_end : 0;
    load_turn(next, next_scale, wr, sr, step_begin + k_warp * UNROLL, my_end, group_size);
    for (int s0 = step_begin + k_warp * UNROLL; s0 < my_end; s0 += KW * UNROLL) {
        uint4 raw[UNROLL][WM][2];
        float sc[UNROLL][WM][2];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int i = 0; i < WM; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    raw[u][i][h] = next[u][i][h];
                    sc[u][i][h] = next_scale[u][i][h];
                }
        load_turn(next, next_scale, wr, sr, s0 + KW * UNROLL, my_end, group_size);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (s0 + u >= my_end) break;
            const int k = (s0 + u) * STEP + t * VALS;
            unsigned a[WM][2][UNITS][4];
#pragma unroll
            for (int i = 0; i < WM; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int q = 0; q < UNITS; ++q) decode_unit(raw[u][i][h], q, a[i][h][q]);
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                if (m0 + 8 * j >= num_rows) break;   /* the same for the whole warp */
                const int row = m0 + 8 * j + g;
                const scalar_t* xp = x + (long long)min(row, num_rows - 1) * x_stride + k;
                float part[WM][4];
#pragma unroll
                for (int i = 0; i < WM; ++i)
#pragma unroll
                    for (int c = 0; c < 4; ++c) part[i][c] = 0.f;
#pragma unroll
                for (int q = 0; q < UNITS; ++q) {
                    const uint4 v = row < num_rows ? __ldg(reinterpret_cast<const uint4*>(xp + 8 * q))
                                                   : make_uint4(0u, 0u, 0u, 0u);
                    unsigned b[4];
                    x_pairs(v, b);
#pragma unroll
                    for (int i = 0; i < WM; ++i) {
                        const unsigned a0[4] = {a[i][0][q][0], a[i][1][q][0], a[i][0][q][1], a[i][1][q][1]};
                        const unsigned a1[4] = {a[i][0][q][2], a[i][1][q][2], a[i][0][q][3], a[i][1][q][3]};
                        mma16816(part[i], a0, b[0], b[1]);
                        mma16816(part[i], a1, b[2], b[3]);
                    }
                }
#pragma unroll
                for (int i = 0; i < WM; ++i)
#pragma unroll
                    for (int c = 0; c < 4; ++c) acc[i][j][c] = fmaf(sc[u][i][c >> 1], part[i][c], acc[i][j][c]);
            }
        }
    }
#if KW > 1
    __shared__ float sums[WARPS][WM * NT * 4][32];   /* [warp][accumulator][lane]: no bank conflicts */
#pragma unroll
    for (int i = 0; i < WM; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) sums[warp][(i * NT + j) * 4 + c][lane] = acc[i][j][c];
    __syncthreads();
    if (k_warp != 0) return;
#pragma unroll
    for (int i = 0; i < WM; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c)
#pragma unroll
                for (int o = 1; o < KW; ++o) acc[i][j][c] += sums[warp + o][(i * NT + j) * 4 + c][lane];
#endif
    if (!active) return;
    /* c0, c1: output g of the tile, rows 2t and 2t + 1 of the n8 tile; c2, c3: output g + 8 */
#pragma unroll
    for (int i = 0; i < WM; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int n = n_warp + 16 * i + g + 8 * (c >> 1);
                const int m = m0 + 8 * j + 2 * t + (c & 1);
                if (m >= num_rows || n >= N) continue;
                if (gridDim.z == 1) {
                    float v = acc[i][j][c];
#if HAS_BIAS
                    v += to_float(bias[n]);
#endif
                    y[(long long)m * N + n] = from_float(v);
                } else {
                    partial[((long long)blockIdx.z * num_rows + m) * N + n] = acc[i][j][c];
                }
            }
}

/* y[m, n] = sum over splits of partial[z, m, n] (+ bias[n]), one element a thread */
extern "C" __global__ void quant_mma_reduce(
    const float* __restrict__ partial, const scalar_t* __restrict__ bias, scalar_t* __restrict__ y,
    int splits, int num_rows, int N)
{
    const long long total = (long long)num_rows * N;
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= total) return;
    float v = 0.f;
    for (int z = 0; z < splits; ++z) v += partial[z * total + e];
#if HAS_BIAS
    v += to_float(bias[e % N]);
#endif
    y[e] = from_float(v);
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


def mma_shape_fits(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, scheme: str) -> bool:
    """True when `quant_mma`'s layout takes this product (`_operands_fit`): int8 / int4, at least one
    row, groups (and so input features) a multiple of MMA_STEP[scheme]."""
    return (
        scheme in MMA_STEP and _operands_fit(x, qweight, scale, scheme, MMA_STEP[scheme]) and x.shape[0] > 0
    )


def mma_fits(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, scheme: str) -> bool:
    """True when `quant_mma` takes this product: `mma_shape_fits` on an sm_80+ card (bf16 mma), and
    SPECMESH_QUANT_MMA is not `off`."""
    return (
        os.environ.get(MMA_ENV, "").lower() != "off"
        and mma_shape_fits(x, qweight, scale, scheme)
        and x.is_cuda
        and torch.cuda.get_device_capability(x.device) >= MMA_MIN_CAPABILITY
    )


def choose_path(
    num_rows: int,
    *,
    gemv_ok: bool,
    mma_ok: bool,
    scaled_mm_ok: bool,
    tiled_ok: bool = False,
    wide: bool = False,
) -> str:
    """Which kernel `kernels.quant_linear` runs for `num_rows` rows, given which ones take the
    operands and whether the matrix is `wide` (TILED_MIN_WIDTH outputs or more per input feature):
    `tiled` (int8 / int4 in the tile layout, kernels/quant_tiled.py) for TILED_MIN_ROWS-TILED_MAX_ROWS
    rows of a wide enough matrix, `gemv` for int8 / int4 up to INT_GEMV_MAX_ROWS rows, `mma` (int8 /
    int4 up to MMA_MAX_ROWS rows), `gemv` (up to MAX_ROWS rows; fp8 up to FP8_GEMV_MAX_ROWS where
    `_scaled_mm` applies), `scaled_mm` (fp8), else `dequantize` + cuBLAS."""
    if tiled_ok and wide and TILED_MIN_ROWS <= num_rows <= TILED_MAX_ROWS:
        return "tiled"
    if mma_ok and gemv_ok and num_rows <= INT_GEMV_MAX_ROWS:
        return "gemv"
    if mma_ok and num_rows <= MMA_MAX_ROWS:
        return "mma"
    if gemv_ok and num_rows <= (FP8_GEMV_MAX_ROWS if scaled_mm_ok else MAX_ROWS):
        return "gemv"
    if scaled_mm_ok:
        return "scaled_mm"
    return "dequantize"


def _half_bits(value: float, dtype: torch.dtype) -> int:
    return int(torch.tensor(value, dtype=dtype).view(torch.int16).item()) & 0xFFFF


@functools.cache
def decode_constants(scheme: str, dtype: torch.dtype) -> dict[str, int]:
    """The bit patterns `quant_mma` decodes stored values with (-D macros; see decode_unit):
    MAGIC_X2, two halves of `dtype` whose mantissa's lowest bit is worth 1 (2^7 in bf16, 2^10 in fp16),
    so OR-ing a stored field v into them gives magic + v exactly; OFFSET_X2, -(magic + zero point),
    and ONE_X2, 1.0, for the fma that leaves v - zero point; FLOAT_MAGIC / FLOAT_OFFSET the same in
    float32 (2^23), for int8 in bf16 (8 bits do not fit bf16's 7-bit mantissa)."""
    zero_point = 1 << (BITS[scheme] - 1)
    magic = 2.0 ** (7 if dtype == torch.bfloat16 else 10)
    pair = 0x10001
    return dict(
        MAGIC_X2=_half_bits(magic, dtype) * pair,
        ONE_X2=_half_bits(1.0, dtype) * pair,
        OFFSET_X2=_half_bits(-(magic + zero_point), dtype) * pair,
        FLOAT_MAGIC=int(np.float32(2.0**23).view(np.uint32)),
        FLOAT_OFFSET=int(np.float32(2.0**23 + zero_point).view(np.uint32)),
    )


@dataclass(frozen=True)
class MmaConfig:
    """How `quant_mma` covers one product: a block of MMA_WARPS warps in slices of `k_warps` warps,
    each slice 16 * MMA_TILES_M outputs by the block's 8 * row_tiles rows, the warps of a slice taking
    turns over the K steps (MMA_STEP) of the block's range and adding up in shared memory; K is cut
    into `splits` ranges of `steps_per_split` steps (grid z) whose float32 partial sums
    `quant_mma_reduce` adds."""

    row_tiles: int
    k_warps: int
    unroll: int  # K steps whose weight loads a warp issues together (a turn)
    steps_per_split: int
    splits: int
    grid: tuple[int, int, int]


def mma_config(num_rows: int, out_features: int, in_features: int, scheme: str, num_sms: int) -> MmaConfig:
    """Up to MAX_ROWS rows the weight read bounds the time: 1 or 2 row tiles, turns of two steps, all
    of a block's warps on the same outputs. More rows: up to 64 a block, turns of one step (registers),
    each warp its own outputs (sharing x reads) unless that leaves fewer than MMA_BLOCKS_PER_SM blocks
    an SM. K is split over the grid until about MMA_BLOCKS_PER_SM blocks an SM, while the partial
    sums' traffic stays within MMA_PARTIAL_FRACTION of the weight's bytes, each split whole turns of
    every warp."""
    if num_rows <= 0 or out_features <= 0 or in_features <= 0 or in_features % MMA_STEP[scheme]:
        raise ValueError(
            f"quant_mma cannot take {num_rows} rows x {in_features} -> {out_features} ({scheme})"
        )
    few_rows = num_rows <= MAX_ROWS
    blocks_wanted = MMA_BLOCKS_PER_SM[0 if few_rows else 1] * num_sms
    row_tiles = next((v for v in MMA_ROW_TILES if 8 * v >= num_rows), MMA_ROW_TILES[-1])
    unroll = 2 if few_rows else 1
    grid_y = -(-num_rows // (8 * row_tiles))
    wide_blocks = -(-out_features // (16 * MMA_TILES_M * MMA_WARPS)) * grid_y
    k_warps = 1 if not few_rows and wide_blocks >= blocks_wanted else MMA_WARPS
    grid_x = -(-out_features // (16 * MMA_TILES_M * MMA_WARPS // k_warps))
    num_steps = in_features // MMA_STEP[scheme]
    weight_bytes = out_features * in_features * BITS[scheme] // 8
    partial_bytes = 8 * num_rows * out_features  # float32 written, then read, per split
    splits_wanted = min(
        blocks_wanted // (grid_x * grid_y), int(MMA_PARTIAL_FRACTION * weight_bytes) // partial_bytes
    )
    turns = -(-num_steps // max(1, splits_wanted) // (k_warps * unroll))  # every warp the same number
    steps_per_split = max(1, turns) * k_warps * unroll
    splits = -(-num_steps // steps_per_split)
    return MmaConfig(row_tiles, k_warps, unroll, steps_per_split, splits, (grid_x, grid_y, splits))


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
    qweight: torch.Tensor,  # packed int32 [N, K * bits / 32]
    scale: torch.Tensor,  # [N, num_groups] float32
    scheme: str,  # int8 or int4
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [num_rows, N] in x's dtype
    """Same result as `quant_linear_ref` up to rounding: the integer weights multiply x exactly on
    the tensor cores, each group's sum is scaled in float32 (the reference rounds q * scale to x's
    dtype first), one rounding to x's dtype."""
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
    config = mma_config(num_rows, n, k, scheme, _cuda.num_sms(device.index or 0))
    defines = dict(
        DTYPE=_cuda.DTYPE_IDS[x.dtype],
        SCHEME=SCHEME_IDS[scheme],
        WARPS=MMA_WARPS,
        WM=MMA_TILES_M,
        HAS_BIAS=int(bias is not None),
        **decode_constants(scheme, x.dtype),
    )
    variant = dict(NT=config.row_tiles, KW=config.k_warps, UNROLL=config.unroll)
    kernel = _cuda.function(MMA_SOURCE, "quant_mma", device, **variant, **defines)
    out = torch.empty(num_rows, n, dtype=x.dtype, device=device)
    partial = None
    if config.splits > 1:
        partial = torch.empty(config.splits, num_rows, n, dtype=torch.float32, device=device)
    args = (x, _weight_bytes(qweight), scale, bias if bias is not None else x, out, partial)
    sizes = (
        np.int32(num_rows),
        np.int32(n),
        np.int32(k),
        np.int32(k // scale.shape[1]),
        np.int64(x.stride(0)),
        np.int32(config.steps_per_split),
    )
    _cuda.launch(kernel, config.grid, (32 * MMA_WARPS,), args + sizes, device)
    if partial is not None:
        reduce = _cuda.function(MMA_SOURCE, "quant_mma_reduce", device, NT=1, KW=1, UNROLL=1, **defines)
        threads = 256
        reduce_args = (partial, bias if bias is not None else x, out)
        reduce_sizes = (np.int32(config.splits), np.int32(num_rows), np.int32(n))
        grid = (-(-num_rows * n // threads),)
        _cuda.launch(reduce, grid, (threads,), reduce_args + reduce_sizes, device)
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
