"""`quant_tiled`: int8 / int4 weight-only GEMM on bf16 / fp16 tensor cores over the tile layout
(kernels/quant_tiled_ref.py, made once at load by `repack_tiles`), in the style of Marlin
(Frantar et al., "MARLIN: Mixed-Precision Auto-Regressive Parallel Inference on LLMs", 2024).

The weight is mma.sync m16n8k16's A operand (16 outputs a tile), x the B operand (8 rows a tile).
A block owns NW * TW output tiles by 8 * MT rows over a range of K (its *split*) and walks it in
*stages* of KW tiles of 64 input features: each stage's weight tiles (contiguous bytes in the
layout), their scales and x's matching [rows, 64 KW] slice are copied global -> shared memory by
cp.async, STAGES - 1 stages ahead of the one being multiplied. Warp (kw, nw) multiplies tile column
kw of a stage for output tiles nw * TW .. + TW: each lane reads its A fragments of a tile with one
16-byte shared load (two for int8), decodes them to exact bf16 / fp16 integers by bit placement
(`decode_constants` of kernels/quant_gemm.py), multiplies them by their group's scale, and takes
x's fragments by ldmatrix. The KW warps of a block add their sums in shared memory at the end.
Splits of K (grid z) write float32 partial sums to a workspace, added in split order either by the
last split to finish each output tile (one launch) or by `quant_tiled_reduce` (a second, small
launch): `split_reduce` chooses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from kernels import _cuda, ptx
from kernels.quant_gemm import SCHEME_IDS, decode_constants
from kernels.quant_ref import BITS
from kernels.quant_tiled_ref import CHUNKS, IN_FEATURES_MULTIPLE, TILE_K, TiledWeight

KERNEL_ENV = "SPECMESH_QUANT_KERNEL"
"""`mma` gives the products `quant_tiled` would take (kernels/quant_gemm.py `choose_path`:
TILED_MIN_ROWS-TILED_MAX_ROWS rows) to the older `quant_mma` even where a layer has its tile layout
(A/B timing); anything else, or unset, runs `quant_tiled` there."""
MAX_ROWS = 256
"""Most rows `quant_tiled` takes (`kernels.quant_linear` gives it at most quant_gemm.TILED_MAX_ROWS)."""
MIN_CAPABILITY = (8, 0)
STAGES = 4
"""Stages of the cp.async pipeline (shared-memory buffers a block cycles through)."""
MAX_SHARED_BYTES = 227 * 1024
"""Shared memory one block may use (sm_90; sm_80: 163 KB, where the variants used fit)."""
MAX_BLOCKS_PER_SM = 4
"""Blocks an SM is assumed to hold at most (registers), for the K split's target."""
WAVES = 2
"""Resident block sets the grid should fill (K split) so no SM idles through a short last wave."""
MIN_STAGES_PER_SPLIT = 2
PARTIAL_FRACTION = 0.25
"""Most bytes of float32 partial sums (written and read) a K split may add, over the weight's bytes..."""
PARTIAL_MIN_BYTES = 8 * 2**20
"""...or this many, whichever is more: a small matrix's partial sums stay in L2, and splitting is
what spreads its few output blocks over the SMs."""
LAST_BLOCK_MAX_SPLITS = 1
"""Most K splits the last block of each output tile adds (`split_reduce`); a product split more ways
leaves the sum to `quant_tiled_reduce`. 1: every split product takes the reduce kernel;
`benchmarks.gpu_kernels --only quant_linear` times both ways for each split product."""
REDUCE_THREADS = 256
MIN_COUNTERS = 1 << 16
"""Output-tile counters allocated at least (one per row block x output block of a split launch)."""

SplitReduce = Literal["none", "last_block", "reduce_kernel"]
"""How a product's K splits are added: `none` (one split: y written directly), `last_block` (the
split to finish an output tile last adds them, one launch) or `reduce_kernel` (`quant_tiled_reduce`,
a second launch over the whole output)."""


@dataclass(frozen=True)
class TiledConfig:
    """A block's shape (see the module docstring) and the K split of one product."""

    row_tiles: int  # MT: n8 tiles of x rows a block takes
    k_warps: int  # KW: tile columns of a stage, one a warp
    n_warps: int  # NW: warps side by side over the block's outputs
    warp_tiles: int  # TW: output tiles a warp multiplies
    tiles_per_split: int  # K tiles of one split: whole stages
    splits: int
    grid: tuple[int, int, int]  # (row blocks, output blocks, splits)
    shared_bytes: int
    reduce: SplitReduce

    @property
    def threads(self) -> int:
        return 32 * self.k_warps * self.n_warps


BlockShape = tuple[int, int, int, int]
"""(MT, KW, NW, TW) of a block (module docstring)."""


def block_shape(num_rows: int) -> BlockShape:
    """Up to 16 rows, four warps each on one tile column of four output tiles (the weight stream
    bounds the time); more rows, 2 x 2 warps on two tile columns and two output tiles each, so x's
    shared tile (8 * MT rows) stays within a few stages."""
    if num_rows <= 8:
        return 1, 4, 1, 4
    if num_rows <= 16:
        return 2, 4, 1, 4
    if num_rows <= 32:
        return 4, 2, 2, 2
    return 8, 2, 2, 2


def candidate_shapes(num_rows: int) -> list[BlockShape]:
    """`block_shape`'s choice first, then the alternatives `benchmarks.gpu_kernels` times beside it
    (eight warps by outputs or by tile columns; wider warps; past 32 rows up to 256 outputs a block,
    fewer re-reads of x), all assembled for sm_90 without spills."""
    row_tiles = block_shape(num_rows)[0]
    if num_rows <= 16:
        return [block_shape(num_rows), (row_tiles, 4, 2, 4), (row_tiles, 8, 1, 4)]
    if num_rows <= 32:
        return [block_shape(num_rows), (4, 4, 1, 4), (4, 2, 4, 2)]
    return [block_shape(num_rows), (8, 2, 4, 2), (8, 2, 2, 4), (8, 2, 4, 4)]


def shared_bytes(scheme: str, row_tiles: int, k_warps: int, n_warps: int, warp_tiles: int) -> int:
    """Shared memory of one block: STAGES stages of weight tiles, scales and x rows, or the warps'
    sums at the end if that is more."""
    block_tiles = k_warps * n_warps * warp_tiles
    x_bytes = 8 * row_tiles * (k_warps * TILE_K + 8) * 2
    stage = block_tiles * CHUNKS[scheme] * 512 + block_tiles * 64 + x_bytes
    sums = 32 * k_warps * n_warps * warp_tiles * row_tiles * 4 * 4
    return max(STAGES * stage, sums)


def split_reduce(splits: int) -> SplitReduce:
    """The rule for adding a product's K splits. A product is split where its output tiles alone
    leave the SMs short (`tiled_config`), so the fewer its tiles, the more splits; the last block of
    a tile then adds them all in turn at the end of the launch, while `quant_tiled_reduce` adds every
    output in parallel for the cost of a second launch: the last block up to LAST_BLOCK_MAX_SPLITS
    splits, the reduce kernel past them."""
    if splits == 1:
        return "none"
    return "last_block" if splits <= LAST_BLOCK_MAX_SPLITS else "reduce_kernel"


def tiled_config(
    num_rows: int,
    tiled: TiledWeight,
    num_sms: int,
    shape: BlockShape | None = None,
    reduce: SplitReduce | None = None,
) -> TiledConfig:
    """The block shape for `num_rows` rows (`shape`, or `block_shape`'s), a K split that gives
    about WAVES sets of resident blocks, keeping at least MIN_STAGES_PER_SPLIT stages a split and
    the partial sums' traffic within PARTIAL_FRACTION of the weight's bytes (or PARTIAL_MIN_BYTES),
    and how the splits are added (`reduce` where the product splits, or `split_reduce`'s rule)."""
    if num_rows <= 0:
        raise ValueError(f"quant_tiled needs at least one row, not {num_rows}")
    if reduce == "none":
        raise ValueError("quant_tiled: `none` is what an unsplit product gets, not a way to add splits")
    row_tiles, k_warps, n_warps, warp_tiles = shape or block_shape(num_rows)
    smem = shared_bytes(tiled.scheme, row_tiles, k_warps, n_warps, warp_tiles)
    row_blocks = -(-num_rows // (8 * row_tiles))
    out_blocks = -(-tiled.n_tiles // (n_warps * warp_tiles))
    resident = min(MAX_BLOCKS_PER_SM, MAX_SHARED_BYTES // smem) * num_sms
    num_stages = -(-tiled.k_tiles // k_warps)
    weight_bytes = tiled.out_features * tiled.in_features * BITS[tiled.scheme] // 8
    partial_budget = max(int(PARTIAL_FRACTION * weight_bytes), PARTIAL_MIN_BYTES)
    by_partials = partial_budget // (8 * num_rows * tiled.out_features)
    wanted = -(-WAVES * resident // (row_blocks * out_blocks))
    splits = max(1, min(wanted, num_stages // MIN_STAGES_PER_SPLIT, by_partials))
    tiles_per_split = -(-num_stages // splits) * k_warps
    splits = -(-tiled.k_tiles // tiles_per_split)
    grid = (row_blocks, out_blocks, splits)
    how = "none" if splits == 1 else reduce or split_reduce(splits)
    return TiledConfig(row_tiles, k_warps, n_warps, warp_tiles, tiles_per_split, splits, grid, smem, how)


def kernel_enabled() -> bool:
    """False when SPECMESH_QUANT_KERNEL=mma asks for the older quant_mma."""
    return os.environ.get(KERNEL_ENV, "").lower() != "mma"


def tiled_fits(x: torch.Tensor, tiled: TiledWeight) -> bool:
    """True when `quant_tiled` takes x @ tiled.T: 1..MAX_ROWS bf16 / fp16 rows of the weight's input
    features, 16-byte aligned, on the weight's sm_80+ device."""
    return (
        x.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16)
        and 0 < x.shape[0] <= MAX_ROWS
        and x.shape[1] == tiled.in_features
        and x.stride(1) == 1
        and x.stride(0) % IN_FEATURES_MULTIPLE == 0
        and x.data_ptr() % 16 == 0
        and x.is_cuda
        and x.device == tiled.tiles.device
        and torch.cuda.get_device_capability(x.device) >= MIN_CAPABILITY
    )


TILED_MACROS = r"""
#define SCH_INT8 1
#define SCH_INT4 2
#if SCHEME == SCH_INT4
#define CHUNKS 1             /* 16-byte loads a lane makes for one tile */
#else
#define CHUNKS 2
#endif
#define TILE_K 64
#define LANE_CHUNKS (CHUNKS * 32)              /* uint4 of one tile */
#define WARPS (KW * NW)
#define THREADS (32 * WARPS)
#define BLOCK_TILES_N (NW * TW)                /* output tiles of a block */
#define STAGE_TILES (KW * BLOCK_TILES_N)
#define STAGE_K (KW * TILE_K)                  /* input features of a stage */
#define X_PITCH (STAGE_K + 8)                  /* x row pitch in shared memory: +16 bytes, no ldmatrix bank conflicts */
#define ROWS (8 * MT)
#define W_STAGE_BYTES (STAGE_TILES * LANE_CHUNKS * 16)
#define S_STAGE_BYTES (STAGE_TILES * 64)
#define X_STAGE_BYTES (ROWS * X_PITCH * 2)
#define STAGE_BYTES (W_STAGE_BYTES + S_STAGE_BYTES + X_STAGE_BYTES)
#define NEG_ZERO_X2 0x80008000u

"""

PTX_HELPERS = ptx.SHARED_ADDRESS + ptx.CP_ASYNC + ptx.LDMATRIX + ptx.MMA_M16N8K16 + ptx.PRMT + ptx.HALF_PAIRS
"""The inline-PTX primitives the kernel uses (kernels/ptx.py: tensor-core mma, ldmatrix, cp.async,
byte permute, paired half-precision fma and conversion): a host test swaps in C++ twins of these alone."""

TILED_KERNELS = r"""
__device__ __forceinline__ unsigned word_of(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

/* Step s (k16) of a lane's tile -> its 4 A registers times the scales: registers 0, 2 hold output
   g (scale lo), 1, 3 output g + 8 (scale hi); *_x2: the scale in both halves of x's dtype. */
__device__ __forceinline__ void decode_step(
    const uint4 (&raw)[CHUNKS], int s, float lo, float hi, unsigned lo_x2, unsigned hi_x2, unsigned* a)
{
#if SCHEME == SCH_INT4
    const unsigned w = word_of(raw[0], s);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const unsigned q = fma_x2(((w >> (4 * r)) & 0x000F000Fu) | (unsigned)MAGIC_X2, (unsigned)ONE_X2,
                                  (unsigned)OFFSET_X2);
        a[r] = fma_x2(q, (r & 1) ? hi_x2 : lo_x2, NEG_ZERO_X2);
    }
#else
    const uint4& v = raw[s >> 1];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const unsigned w = word_of(v, 2 * (s & 1) + h);
#if DTYPE == DT_BF16
        float f[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
            f[i] = __uint_as_float(prmt(w, (unsigned)FLOAT_MAGIC, 0x7540 + i)) - __uint_as_float((unsigned)FLOAT_OFFSET);
        a[2 * h] = pack_x2(f[0] * lo, f[1] * lo);
        a[2 * h + 1] = pack_x2(f[2] * hi, f[3] * hi);
#else
        const unsigned q0 = fma_x2(prmt(w, (unsigned)MAGIC_X2, 0x7150), (unsigned)ONE_X2, (unsigned)OFFSET_X2);
        const unsigned q1 = fma_x2(prmt(w, (unsigned)MAGIC_X2, 0x7352), (unsigned)ONE_X2, (unsigned)OFFSET_X2);
        a[2 * h] = fma_x2(q0, lo_x2, NEG_ZERO_X2);
        a[2 * h + 1] = fma_x2(q1, hi_x2, NEG_ZERO_X2);
#endif
    }
#endif
}

/* y = x @ dequantize(w).T (+ bias) from the tile layout (module docstring of kernels/quant_tiled.py) */
extern "C" __global__ void __launch_bounds__(THREADS) quant_tiled(
    const scalar_t* __restrict__ x,     /* [num_rows, K], rows x_stride elements apart */
    const uint4* __restrict__ tiles,    /* [k_tiles, n_tiles, LANE_CHUNKS] */
    const float* __restrict__ scales,   /* [num_groups, n_tiles, 8, 2] */
    const scalar_t* __restrict__ bias,  /* [N]; unused without HAS_BIAS */
    scalar_t* __restrict__ y,           /* [num_rows, N]: written unless quant_tiled_reduce adds the splits */
    float* __restrict__ partial,        /* [gridDim.z, num_rows, N]: written when gridDim.z > 1 */
    int* __restrict__ counters,         /* [gridDim.y, gridDim.x] with LAST_BLOCK: zero, left zero */
    int num_rows, int N, int K, int n_tiles, int k_tiles, int group_tiles, long long x_stride,
    int tiles_per_split)
{
    extern __shared__ __align__(16) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int kw = warp % KW, nw = warp / KW;
    const int m0 = blockIdx.x * ROWS;
    const int nt0 = blockIdx.y * BLOCK_TILES_N;
    const int kt_begin = blockIdx.z * tiles_per_split;
    const int kt_end = min(kt_begin + tiles_per_split, k_tiles);
    const int num_stages = (kt_end - kt_begin + KW - 1) / KW;

    /* a stage's weight tiles [KW][BLOCK_TILES_N][LANE_CHUNKS], scales [KW][BLOCK_TILES_N][8][2]
       and x rows [ROWS][X_PITCH] into buffer `buf` */
    auto load_stage = [&](int stage, int buf) {
        unsigned char* base = smem + buf * STAGE_BYTES;
        uint4* w_s = reinterpret_cast<uint4*>(base);
        uint4* s_s = reinterpret_cast<uint4*>(base + W_STAGE_BYTES);
        scalar_t* x_s = reinterpret_cast<scalar_t*>(base + W_STAGE_BYTES + S_STAGE_BYTES);
        const int kt0 = kt_begin + stage * KW;
        for (int i = threadIdx.x; i < STAGE_TILES * LANE_CHUNKS; i += THREADS) {
            const int tile = i / LANE_CHUNKS, kt = kt0 + tile / BLOCK_TILES_N, nt = nt0 + tile % BLOCK_TILES_N;
            const bool valid = kt < kt_end && nt < n_tiles;
            const long long at = valid ? ((long long)kt * n_tiles + nt) * LANE_CHUNKS + i % LANE_CHUNKS : 0;
            cp_async16(w_s + i, tiles + at, valid);
        }
        for (int i = threadIdx.x; i < STAGE_TILES * 4; i += THREADS) {
            const int tile = i / 4, kt = kt0 + tile / BLOCK_TILES_N, nt = nt0 + tile % BLOCK_TILES_N;
            const bool valid = kt < kt_end && nt < n_tiles;
            const long long at = valid ? ((long long)(kt / group_tiles) * n_tiles + nt) * 16 + 4 * (i % 4) : 0;
            cp_async16(s_s + i, scales + at, valid);
        }
        for (int i = threadIdx.x; i < ROWS * (STAGE_K / 8); i += THREADS) {
            const int r = i / (STAGE_K / 8), c = i % (STAGE_K / 8);
            const int row = m0 + r, k = kt0 * TILE_K + 8 * c;
            const bool valid = row < num_rows && k < K;
            cp_async16(x_s + r * X_PITCH + 8 * c, x + (valid ? row * x_stride + k : 0), valid);
        }
    };

    float acc[TW][MT][4];
#pragma unroll
    for (int i = 0; i < TW; ++i)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

    /* warp (kw, nw): tile column kw of the stage, output tiles nw * TW .. + TW, every row */
    auto multiply_stage = [&](int stage, int buf) {
        if (kt_begin + stage * KW + kw >= kt_end) return;
        const unsigned char* base = smem + buf * STAGE_BYTES;
        const uint4* w_s = reinterpret_cast<const uint4*>(base);
        const float2* s_s = reinterpret_cast<const float2*>(base + W_STAGE_BYTES);
        const scalar_t* x_s = reinterpret_cast<const scalar_t*>(base + W_STAGE_BYTES + S_STAGE_BYTES);
        uint4 raw[TW][CHUNKS];
        float lo[TW], hi[TW];
        unsigned lo_x2[TW], hi_x2[TW];
#pragma unroll
        for (int i = 0; i < TW; ++i) {
            const int tile = kw * BLOCK_TILES_N + nw * TW + i;
#pragma unroll
            for (int c = 0; c < CHUNKS; ++c) raw[i][c] = w_s[tile * LANE_CHUNKS + 32 * c + lane];
            const float2 sc = s_s[tile * 8 + g];
            lo[i] = sc.x;
            hi[i] = sc.y;
            lo_x2[i] = pack_x2(sc.x, sc.x);
            hi_x2[i] = pack_x2(sc.y, sc.y);
        }
#pragma unroll
        for (int pair = 0; pair < 2; ++pair) {   /* k16 steps 2 pair, 2 pair + 1 */
            unsigned b[MT][4];
#pragma unroll
            for (int j = 0; j < MT; ++j)
                ldmatrix_x4(b[j], x_s + (8 * j + (lane & 7)) * X_PITCH + kw * TILE_K + 32 * pair + 8 * (lane >> 3));
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int i = 0; i < TW; ++i) {
                    if (nt0 + nw * TW + i >= n_tiles) break;   /* the same for the whole warp */
                    unsigned a[4];
                    decode_step(raw[i], 2 * pair + h, lo[i], hi[i], lo_x2[i], hi_x2[i], a);
#pragma unroll
                    for (int j = 0; j < MT; ++j) mma16816(acc[i][j], a, b[j][2 * h], b[j][2 * h + 1]);
                }
            }
        }
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < num_stages) load_stage(s, s);
        cp_async_commit();
    }
    for (int s = 0; s < num_stages; ++s) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();   /* stage s landed for every thread; every warp is done with stage s - 1 */
        if (s + STAGES - 1 < num_stages) load_stage(s + STAGES - 1, (s + STAGES - 1) % STAGES);
        cp_async_commit();
        multiply_stage(s, s % STAGES);
    }
#if KW > 1
    cp_async_wait<0>();
    __syncthreads();
    float* sums = reinterpret_cast<float*>(smem);   /* [WARPS][TW * MT * 4][32]: no bank conflicts */
#pragma unroll
    for (int i = 0; i < TW; ++i)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) sums[(warp * TW * MT * 4 + (i * MT + j) * 4 + c) * 32 + lane] = acc[i][j][c];
    __syncthreads();
    if (kw == 0) {
#pragma unroll
        for (int o = 1; o < KW; ++o)
#pragma unroll
            for (int i = 0; i < TW; ++i)
#pragma unroll
                for (int j = 0; j < MT; ++j)
#pragma unroll
                    for (int c = 0; c < 4; ++c)
                        acc[i][j][c] += sums[((warp + o) * TW * MT * 4 + (i * MT + j) * 4 + c) * 32 + lane];
    }
#endif
    /* The kw = 0 warps hold the block's sums. Accumulator c of tile (i, j): output g (c0, c1) or
       g + 8 (c2, c3) of output tile i, rows 2t and 2t + 1 of row tile j. */
    auto each_output = [&](auto&& visit) {
        if (kw != 0) return;
#pragma unroll
        for (int i = 0; i < TW; ++i)
#pragma unroll
            for (int j = 0; j < MT; ++j)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int n = (nt0 + nw * TW + i) * 16 + g + 8 * (c >> 1);
                    const int m = m0 + 8 * j + 2 * t + (c & 1);
                    if (m < num_rows && n < N) visit(acc[i][j][c], (long long)m * N + n, n);
                }
    };
    auto write_output = [&](float v, long long at, int n) {
#if HAS_BIAS
        v += to_float(bias[n]);
#endif
        y[at] = from_float(v);
    };
    if (gridDim.z == 1) {
        each_output(write_output);
        return;
    }
    /* K split: each split writes its partial sums; quant_tiled_reduce adds them, or with LAST_BLOCK
       the block of the output tile to finish last (a counter per tile: zero before, left zero) adds
       them in split order and writes y. Only LAST_BLOCK variants hold that tail: compiled in, it
       changes how the whole kernel is compiled (sm_90: a third fewer registers). */
    const long long split_stride = (long long)num_rows * N;
    each_output([&](float v, long long at, int) { partial[blockIdx.z * split_stride + at] = v; });
#if LAST_BLOCK
    __threadfence();
    __syncthreads();
    __shared__ int last_split;
    int* counter = counters + blockIdx.y * gridDim.x + blockIdx.x;
    if (threadIdx.x == 0) last_split = atomicAdd(counter, 1) == (int)gridDim.z - 1;
    __syncthreads();
    if (!last_split) return;
    __threadfence();
    each_output([&](float, long long at, int n) {
        float v = 0.f;
        for (int z = 0; z < (int)gridDim.z; ++z) v += __ldcg(partial + z * split_stride + at);
        write_output(v, at, n);
    });
    if (threadIdx.x == 0) *counter = 0;
#endif
}

"""

TILED_SOURCE = _cuda.CONVERSIONS + TILED_MACROS + PTX_HELPERS + TILED_KERNELS

REDUCE_KERNEL = r"""
/* y[m, n] = sum over splits of partial[z, m, n] in split order (+ bias[n]), one element a thread:
   the same sum, in the same order, as quant_tiled's last block */
extern "C" __global__ void __launch_bounds__(REDUCE_THREADS) quant_tiled_reduce(
    const float* __restrict__ partial,  /* [splits, num_rows, N] */
    const scalar_t* __restrict__ bias,  /* [N]; unused without HAS_BIAS */
    scalar_t* __restrict__ y,           /* [num_rows, N] */
    int splits, int num_rows, int N)
{
    const long long total = (long long)num_rows * N;
    const long long at = (long long)blockIdx.x * REDUCE_THREADS + threadIdx.x;
    if (at >= total) return;
    float v = 0.f;
    for (int z = 0; z < splits; ++z) v += partial[z * total + at];
#if HAS_BIAS
    v += to_float(bias[at % N]);
#endif
    y[at] = from_float(v);
}
"""

REDUCE_SOURCE = _cuda.CONVERSIONS + REDUCE_KERNEL
"""`quant_tiled_reduce` alone: compiled per dtype and bias, not per block shape."""


def kernel_defines(
    tiled: TiledWeight, dtype: torch.dtype, config: TiledConfig, has_bias: bool
) -> dict[str, int]:
    """The -D macros of one compiled variant."""
    return dict(
        DTYPE=_cuda.DTYPE_IDS[dtype],
        SCHEME=SCHEME_IDS[tiled.scheme],
        MT=config.row_tiles,
        KW=config.k_warps,
        NW=config.n_warps,
        TW=config.warp_tiles,
        STAGES=STAGES,
        HAS_BIAS=int(has_bias),
        LAST_BLOCK=int(config.reduce == "last_block"),
        **decode_constants(tiled.scheme, dtype),
    )


_WORKSPACES: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}


def _workspace(num_elements: int, dtype: torch.dtype, device: torch.device, minimum: int) -> torch.Tensor:
    """A zeroed buffer of at least `num_elements` of `dtype` on `device`, shared by every launch
    (they run one after another on torch's stream). Made once and replaced only when a launch needs
    more, by one at least twice as large; the buffers it replaces stay allocated, so a CUDA graph
    captured on one keeps reading valid memory."""
    buffers = _WORKSPACES.setdefault((device, dtype), [])
    if not buffers or buffers[-1].numel() < num_elements:
        size = max(num_elements, minimum, 2 * buffers[-1].numel() if buffers else 0)
        buffers.append(torch.zeros(size, dtype=dtype, device=device))
    return buffers[-1]


def split_counters(num_tiles: int, device: torch.device) -> torch.Tensor:
    """The arrival counters of a `last_block` launch over `num_tiles` output tiles (row block x
    output block) on `device`: zero between launches (the kernel leaves them zero)."""
    return _workspace(num_tiles, torch.int32, device, MIN_COUNTERS)


def split_partials(splits: int, num_rows: int, out_features: int, device: torch.device) -> torch.Tensor:
    """The float32 partial sums of a split launch, [splits, num_rows, out_features]: a view of the
    device's workspace."""
    num_floats = splits * num_rows * out_features
    workspace = _workspace(num_floats, torch.float32, device, 0)
    return workspace[:num_floats].view(splits, num_rows, out_features)


def quant_tiled_cuda(
    x: torch.Tensor,  # [num_rows, in_features] bf16 / fp16
    tiled: TiledWeight,
    bias: torch.Tensor | None = None,  # [out_features]
    shape: BlockShape | None = None,  # None: block_shape(num_rows)
    reduce: SplitReduce | None = None,  # how K splits are added; None: split_reduce's rule
) -> torch.Tensor:  # [num_rows, out_features] in x's dtype
    """Same result as `tiled_linear_ref` up to rounding: each weight times its group's scale is
    rounded to x's dtype (as the reference's dequantized weight; int8 in bf16 through float32),
    the products summed in float32, one rounding to x's dtype. Either way of adding K splits gives
    the same bits."""
    device = x.device
    _cuda.check(
        tiled_fits(x, tiled),
        f"quant_tiled takes 1..{MAX_ROWS} bf16 / fp16 rows of {tiled.in_features} 16-byte aligned features "
        f"on the weight's device, not {tuple(x.shape)} {x.dtype} on {x.device}: see tiled_fits()",
    )
    num_rows, n = x.shape[0], tiled.out_features
    if bias is not None:
        _cuda.check_cuda_tensor("bias", bias, [x.dtype], 1, device)
        _cuda.check(bias.shape[0] == n and bias.is_contiguous(), f"bias has shape {tuple(bias.shape)}")
    config = tiled_config(num_rows, tiled, _cuda.num_sms(device.index or 0), shape, reduce)
    defines = kernel_defines(tiled, x.dtype, config, bias is not None)
    kernel = _cuda.function(TILED_SOURCE, "quant_tiled", device, **defines)
    _cuda.set_max_dynamic_shared(kernel, config.shared_bytes)
    out = torch.empty(num_rows, n, dtype=x.dtype, device=device)
    partial = split_partials(config.splits, num_rows, n, device) if config.reduce != "none" else None
    counters = (
        split_counters(config.grid[0] * config.grid[1], device) if config.reduce == "last_block" else None
    )
    bias_arg = bias if bias is not None else x
    args = (x, tiled.tiles, tiled.scales, bias_arg, out, partial, counters)
    sizes = (
        np.int32(num_rows),
        np.int32(n),
        np.int32(tiled.in_features),
        np.int32(tiled.n_tiles),
        np.int32(tiled.k_tiles),
        np.int32(tiled.group_tiles),
        np.int64(x.stride(0)),
        np.int32(config.tiles_per_split),
    )
    _cuda.launch(kernel, config.grid, (config.threads,), args + sizes, device, config.shared_bytes)
    if config.reduce == "reduce_kernel":
        assert partial is not None
        _reduce_splits(partial, bias_arg, out, bias is not None)
    return out


def _reduce_splits(
    partial: torch.Tensor,  # [splits, num_rows, out_features] float32
    bias: torch.Tensor,  # [out_features], or any tensor without has_bias
    out: torch.Tensor,  # [num_rows, out_features]
    has_bias: bool,
) -> None:
    """out = the sum of the splits' partial sums (+ bias), by `quant_tiled_reduce`."""
    splits, num_rows, n = partial.shape
    defines = dict(DTYPE=_cuda.DTYPE_IDS[out.dtype], HAS_BIAS=int(has_bias), REDUCE_THREADS=REDUCE_THREADS)
    kernel = _cuda.function(REDUCE_SOURCE, "quant_tiled_reduce", out.device, **defines)
    grid = (-(-num_rows * n // REDUCE_THREADS),)
    sizes = (np.int32(splits), np.int32(num_rows), np.int32(n))
    _cuda.launch(kernel, grid, (REDUCE_THREADS,), (partial, bias, out) + sizes, out.device)
