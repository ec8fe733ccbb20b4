"""CUDA paged append-attention and KV write (CuPy RawKernel, NVRTC); twins of `attention_ref`.

`append_attention`: each sequence's `1 + k` (or any short run of) query tokens attend causally to
the sequence's paged context, with GQA (one kv head serves `num_heads / num_kv_heads` query heads)
and an optional sliding window. One thread block takes one (sequence, query tile, kv head, context
split): the query rows of every head sharing the kv head are processed together, so each key and
value is read once per kv head, not once per query head — verification does not expand the batch.
Long contexts are split across blocks (flash-decoding, Dao et al. 2023): each split keeps an online
softmax (running max and sum) and writes an unnormalised partial output, and a second kernel merges
the splits. Keys and values stream through shared memory in tiles of 64 tokens, double-buffered with
`cp.async`, which zero-fills slots past the context so no stale value reaches the sum.

Two variants of the block's arithmetic. For bf16 / fp16 with head_dim <= 128 and GQA groups up to 16,
`append_attention_mma` (tensor cores): the block's query rows form one m16 tile and its four warps
split every key tile, computing Q K^T and P V with mma.sync and merging their softmax states at the
end — verify rows (1 + k tokens x the group) cost about what one decode row costs (kernels/NOTES.md).
Otherwise (float32, wider heads or groups) `append_attention` on CUDA cores: scores one thread per
key, softmax one warp per row, P V one thread per head_dim chunk.

A sequence's query of any length (a decode token, 1 + k verify tokens, a long prefill chunk) is cut
into query tiles numbered densely across the step (`AttentionMetadata.tile_starts`), each tile
attending to the context up to its own last token. A query that is a draft tree (`meta.tree_mask`)
further hides, per query row, the tokens of its own query whose bit is clear (attention_ref).
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from kernels import _cuda, ptx
from kernels.attention_ref import AttentionMetadata, check_tree_mask

BLOCK_N = 64
THREADS = 128
MAX_ROWS = 64
"""Query rows (tokens x heads per kv head) one thread block holds."""
TENSOR_CORES_ENV = "SPECMESH_TENSOR_CORE_ATTENTION"
"""Set to `off` to run the CUDA-core variant everywhere (A/B timing)."""
MMA_ROWS = 16
"""Query rows of the tensor-core variant's block: one m16 tile (tokens x GQA group)."""
MMA_MAX_HEAD_DIM = 128
"""Largest head_dim of the tensor-core variant (its output accumulators live in registers)."""
SMALL_GRID_ROWS = 16
"""Query rows per block when (sequences x kv heads) give fewer blocks than two per SM, as at
small batches: the verify rows (1 + k tokens x the GQA group) split over more blocks, each
re-reading its context tiles from L2, instead of running one long chain of tiles per kv head."""
MAX_SPLITS = 64
MIN_KEYS_PER_SPLIT = BLOCK_N
"""Fewest keys of a context split (the default of `min_split_keys`): one tile, so at small batches
even a short context is split, since one block walking its tiles one after another is
latency-bound (kernels/NOTES.md). The kernels apply it to each query tile's own context, so a CUDA
graph launched for the longest context splits a short one only as far as this allows."""
MIN_SPLIT_KEYS_ENV = "SPECMESH_ATTN_MIN_SPLIT_KEYS"
"""Overrides MIN_KEYS_PER_SPLIT (a multiple of BLOCK_N; larger: fewer splits and merges at short
contexts) for A/B timing and tuning on a GPU."""

SOURCE = (
    _cuda.CONVERSIONS
    + r"""
#define ROW_STRIDE (HEAD_DIM + VEC)          /* padded shared-memory row, in elements */
#define CHUNKS (HEAD_DIM / VEC)              /* 16-byte chunks per row */
#define ROW_GROUPS (THREADS / CHUNKS)
#define KEY_PARALLEL (RMAX <= 8 && THREADS % CHUNKS == 0)
#define PV_ROWS (KEY_PARALLEL ? RMAX : (RMAX + ROW_GROUPS - 1) / ROW_GROUPS)
#define S_STRIDE (BLOCK_N + 1)
#define NEG_INF (-__int_as_float(0x7f800000))
"""
    + ptx.SHARED_ADDRESS
    + ptx.CP_ASYNC
    + r"""

/* Whether the query token with tree mask `mask` sees the key at `pos_k` (already causally visible):
   the cached context always; key j of its own query where bit j is set (past bit 63: CAUSAL, -1). */
__device__ __forceinline__ bool in_tree(long long mask, int pos_k, int context_len) {
    const int j = pos_k - context_len;
    if (j < 0) return true;
    return j < 64 ? ((mask >> j) & 1LL) != 0 : mask == -1LL;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Copies the keys and values of context positions [tile_start, tile_start + BLOCK_N) of one kv
   head into shared memory (positions >= limit are zero-filled). Block-table reads and address
   arithmetic come first, so the table loads are in flight together. */
#define CHUNKS_PER_THREAD (BLOCK_N * CHUNKS / THREADS)
__device__ __forceinline__ void load_tile(
    scalar_t* ks, scalar_t* vs, const scalar_t* __restrict__ key_cache,
    const scalar_t* __restrict__ value_cache, const int* __restrict__ table, int tile_start, int limit,
    int block_size, int num_kv_heads, int kv_head)
{
    long long offset[CHUNKS_PER_THREAD];
#pragma unroll
    for (int j = 0; j < CHUNKS_PER_THREAD; ++j) {
        const int id = threadIdx.x + j * THREADS;
        const int n = id / CHUNKS, c = id - n * CHUNKS;
        const int pos = tile_start + n;
        offset[j] = -1;
        if (pos < limit) {
            const long long block = __ldg(table + pos / block_size);
            offset[j] = ((block * block_size + pos % block_size) * num_kv_heads + kv_head) * HEAD_DIM + c * VEC;
        }
    }
#pragma unroll
    for (int j = 0; j < CHUNKS_PER_THREAD; ++j) {
        const int id = threadIdx.x + j * THREADS;
        const int n = id / CHUNKS, c = id - n * CHUNKS;
        const bool valid = offset[j] >= 0;
        const long long o = valid ? offset[j] : 0;
        cp_async16(ks + n * ROW_STRIDE + c * VEC, key_cache + o, valid);
        cp_async16(vs + n * ROW_STRIDE + c * VEC, value_cache + o, valid);
    }
}

/* What one thread block of the attention grid (query tile, kv head, context split) works on: its
   query tokens [t0, t0 + nt) of the sequence (rows = nt x group query rows), the context positions
   [s_begin, s_end) of its split (num_kv_tiles tiles of BLOCK_N), its block table. Query tiles are
   numbered one per sequence (tile_starts null) or, where a sequence may bring several, densely:
   sequence s owns tiles [tile_starts[s], tile_starts[s + 1]), so a step mixing a prefill chunk with
   one-token decodes launches the tiles it has, not max_tiles for every sequence.
   False: nothing to do (a sequence past max_query_len, or a tile past the step's queries). */
struct BlockWork {
    int q_begin, t0, group, rows, first_pos, context_len, s_begin, s_end, num_kv_tiles, splits;
    const int* table;
};

/* The splits a query tile's context span uses of the launched num_splits: each takes at least
   min_split_keys keys (whole BLOCK_N tiles), so a short context (a graph launched for the longest
   one) runs in fewer blocks and the rest return at once; one split writes the output itself and
   merge_splits skips it. Shared by the attention kernels and merge_splits. */
__device__ __forceinline__ int split_keys(int span, int num_splits, int min_split_keys, int& per_split)
{
    per_split = max((span + num_splits - 1) / num_splits, min_split_keys);
    per_split = (per_split + BLOCK_N - 1) / BLOCK_N * BLOCK_N;
    return max(1, min(num_splits, (span + per_split - 1) / per_split));
}
__device__ __forceinline__ bool block_work(
    BlockWork& w, const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
    const int* __restrict__ query_start_loc, const int* __restrict__ tile_starts, int num_seqs,
    int num_heads, int num_kv_heads, int max_blocks, int tile_tokens, int num_splits,
    int max_query_len, int sliding_window, int min_split_keys)
{
    int seq = blockIdx.x, tile = 0;
    if (tile_starts != nullptr) {
        const int x = blockIdx.x;
        if (x >= tile_starts[num_seqs]) return false;
        int lo = 0, hi = num_seqs;                /* the sequence owning tile x */
        while (hi - lo > 1) {
            const int mid = (lo + hi) >> 1;
            if (tile_starts[mid] <= x) lo = mid; else hi = mid;
        }
        seq = lo;
        tile = x - tile_starts[lo];
    }
    const int q_begin = query_start_loc[seq];
    const int q_len = query_start_loc[seq + 1] - q_begin;
    if (q_len > max_query_len) return false;
    const int t0 = tile * tile_tokens;
    if (t0 >= q_len) return false;
    const int nt = min(tile_tokens, q_len - t0);
    const int group = num_heads / num_kv_heads;
    const int first_pos = seq_lens[seq] - q_len + t0;
    const int kv_end = first_pos + nt;
    const int kv_begin = sliding_window > 0 ? max(0, first_pos - sliding_window + 1) : 0;
    const int span = kv_end - kv_begin;
    int per_split;
    const int splits = split_keys(span, num_splits, min_split_keys, per_split);
    if ((int)blockIdx.z >= splits) return false;
    const int s_begin = kv_begin + (int)blockIdx.z * per_split;
    const int s_end = min(kv_end, s_begin + per_split);
    w.q_begin = q_begin;
    w.t0 = t0;
    w.group = group;
    w.rows = nt * group;
    w.first_pos = first_pos;
    w.context_len = first_pos - t0;
    w.s_begin = s_begin;
    w.s_end = s_end;
    w.num_kv_tiles = s_end > s_begin ? (s_end - s_begin + BLOCK_N - 1) / BLOCK_N : 0;
    w.table = block_tables + (long long)seq * max_blocks;
    w.splits = splits;
    return true;
}

extern "C" __global__ void __launch_bounds__(THREADS) append_attention(
    const scalar_t* __restrict__ query,        /* [num_tokens, num_heads, HEAD_DIM] */
    const scalar_t* __restrict__ key_cache,    /* [num_blocks, block_size, num_kv_heads, HEAD_DIM] */
    const scalar_t* __restrict__ value_cache,
    const int* __restrict__ block_tables,      /* [num_seqs, max_blocks] */
    const int* __restrict__ seq_lens,          /* [num_seqs] */
    const int* __restrict__ query_start_loc,   /* [num_seqs + 1] */
    const int* __restrict__ tile_starts,       /* [num_seqs + 1] or null: one tile per sequence */
    const long long* __restrict__ tree_mask,   /* [num_tokens] (attention_ref), read where TREE is 1 */
    scalar_t* __restrict__ out,                /* [num_tokens, num_heads, HEAD_DIM] */
    float* __restrict__ part_out,              /* [num_splits, num_tokens, num_heads, HEAD_DIM] */
    float* __restrict__ part_ml,               /* [num_splits, num_tokens, num_heads, 2] */
    int num_seqs, int num_tokens, int num_heads, int num_kv_heads, int block_size, int max_blocks,
    int tile_tokens, int num_splits, int max_query_len, float scale_log2, int sliding_window,
    int min_split_keys)
{
    extern __shared__ __align__(16) unsigned char smem[];
    float* qs = reinterpret_cast<float*>(smem);                       /* [RMAX][HEAD_DIM] */
    float* ss = qs + RMAX * HEAD_DIM;                                 /* [RMAX][S_STRIDE] */
    float* m_s = ss + RMAX * S_STRIDE;
    float* l_s = m_s + RMAX;
    float* alpha_s = l_s + RMAX;
    scalar_t* kv = reinterpret_cast<scalar_t*>(alpha_s + RMAX + 4 - (RMAX % 4));
    /* kv: 2 stages x (K tile, V tile), each [BLOCK_N][ROW_STRIDE] */

    BlockWork w;
    if (!block_work(w, block_tables, seq_lens, query_start_loc, tile_starts, num_seqs, num_heads,
                    num_kv_heads, max_blocks, tile_tokens, num_splits, max_query_len, sliding_window,
                    min_split_keys))
        return;
    const int kv_head = blockIdx.y, split = blockIdx.z;
    const int q_begin = w.q_begin, t0 = w.t0, group = w.group, rows = w.rows, first_pos = w.first_pos;
    const int s_begin = w.s_begin, s_end = w.s_end, num_kv_tiles = w.num_kv_tiles;
    const int* table = w.table;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    if (num_kv_tiles > 0)
        load_tile(kv, kv + BLOCK_N * ROW_STRIDE, key_cache, value_cache, table, s_begin, s_end,
                  block_size, num_kv_heads, kv_head);
    cp_async_commit();

    for (int i = tid; i < RMAX * HEAD_DIM; i += THREADS) {
        const int r = i / HEAD_DIM, d = i - r * HEAD_DIM;
        float v = 0.f;
        if (r < rows) {
            const long long token = q_begin + t0 + r / group;
            const int head = kv_head * group + r % group;
            v = to_float(query[(token * num_heads + head) * HEAD_DIM + d]) * scale_log2;
        }
        qs[i] = v;
    }
    for (int r = tid; r < RMAX; r += THREADS) { m_s[r] = NEG_INF; l_s[r] = 0.f; alpha_s[r] = 1.f; }
    __syncthreads();  /* an empty split has no loop barrier before the epilogue reads m_s / l_s */

    /* P V mapping. KEY_PARALLEL (few rows, as in decode): thread -> (16-byte chunk of head_dim, key
       group) accumulating every row; the key groups are summed at the end. Otherwise thread ->
       (chunk, row group) over all keys. */
    const int pv_chunk = tid % CHUNKS, pv_group = tid / CHUNKS;
    float acc[PV_ROWS][VEC];
#pragma unroll
    for (int i = 0; i < PV_ROWS; ++i)
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[i][v] = 0.f;

    for (int it = 0; it < num_kv_tiles; ++it) {
        const int stage = it & 1;
        scalar_t* ks = kv + stage * 2 * BLOCK_N * ROW_STRIDE;
        scalar_t* vs = ks + BLOCK_N * ROW_STRIDE;
        const int tile_start = s_begin + it * BLOCK_N;
        if (it + 1 < num_kv_tiles) {
            scalar_t* next = kv + (stage ^ 1) * 2 * BLOCK_N * ROW_STRIDE;
            load_tile(next, next + BLOCK_N * ROW_STRIDE, key_cache, value_cache, table,
                      tile_start + BLOCK_N, s_end, block_size, num_kv_heads, kv_head);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();

        /* scores: thread -> key n, rows rg, rg + 2, ... (a warp shares its rows: Q reads broadcast) */
        {
            const int n = tid & (BLOCK_N - 1), rg = tid / BLOCK_N;
            float s[RMAX / 2];
#pragma unroll
            for (int i = 0; i < RMAX / 2; ++i) s[i] = 0.f;
#pragma unroll 4
            for (int c = 0; c < CHUNKS; ++c) {
                float k[VEC];
                load_vec(ks + n * ROW_STRIDE + c * VEC, k);
#pragma unroll
                for (int i = 0; i < RMAX / 2; ++i) {
                    const int r = rg + 2 * i;
                    if (r < rows) {
                        const float* q = qs + r * HEAD_DIM + c * VEC;
#pragma unroll
                        for (int v = 0; v < VEC; v += 4) {
                            const float4 q4 = *reinterpret_cast<const float4*>(q + v);
                            s[i] += q4.x * k[v] + q4.y * k[v + 1] + q4.z * k[v + 2] + q4.w * k[v + 3];
                        }
                    }
                }
            }
            const int pos_k = tile_start + n;
#pragma unroll
            for (int i = 0; i < RMAX / 2; ++i) {
                const int r = rg + 2 * i;
                if (r < rows) {
                    const int pos_q = first_pos + r / group;
                    bool visible = pos_k < s_end && pos_k <= pos_q &&
                                   (sliding_window <= 0 || pos_q - pos_k < sliding_window);
#if TREE
                    visible = visible && in_tree(__ldg(tree_mask + q_begin + t0 + r / group), pos_k, w.context_len);
#endif
                    ss[r * S_STRIDE + n] = visible ? s[i] : NEG_INF;
                }
            }
        }
        __syncthreads();

        /* online softmax, one warp per row */
        for (int r = warp; r < rows; r += THREADS / 32) {
            float* srow = ss + r * S_STRIDE;
            const float s0 = srow[lane], s1 = srow[lane + 32];
            const float m_old = m_s[r];
            const float m_new = fmaxf(m_old, warp_max(fmaxf(s0, s1)));
            float p0 = 0.f, p1 = 0.f, alpha = 1.f;
            if (m_new != NEG_INF) {
                p0 = exp2f(s0 - m_new);
                p1 = exp2f(s1 - m_new);
                alpha = exp2f(m_old - m_new);
            }
            srow[lane] = p0;
            srow[lane + 32] = p1;
            const float sum = warp_sum(p0 + p1);
            if (lane == 0) { m_s[r] = m_new; l_s[r] = l_s[r] * alpha + sum; alpha_s[r] = alpha; }
        }
        __syncthreads();

        /* acc = acc * alpha + P V (slots past the context hold zero values and zero weights) */
        if (pv_group < ROW_GROUPS) {
#pragma unroll
            for (int i = 0; i < PV_ROWS; ++i) {
                const int r = KEY_PARALLEL ? i : pv_group + i * ROW_GROUPS;
                if (r < rows) {
                    const float a = alpha_s[r];
#pragma unroll
                    for (int v = 0; v < VEC; ++v) acc[i][v] *= a;
                }
            }
            const int n_first = KEY_PARALLEL ? pv_group : 0, n_step = KEY_PARALLEL ? ROW_GROUPS : 1;
#pragma unroll 4
            for (int n = n_first; n < BLOCK_N; n += n_step) {
                float vv[VEC];
                load_vec(vs + n * ROW_STRIDE + pv_chunk * VEC, vv);
#pragma unroll
                for (int i = 0; i < PV_ROWS; ++i) {
                    const int r = KEY_PARALLEL ? i : pv_group + i * ROW_GROUPS;
                    if (r < rows) {
                        const float p = ss[r * S_STRIDE + n];
#pragma unroll
                        for (int v = 0; v < VEC; ++v) acc[i][v] += p * vv[v];
                    }
                }
            }
        }
        __syncthreads();
    }

#if KEY_PARALLEL
    /* sum the key groups' partial outputs through shared memory (the KV tiles are free now) */
    float* red = reinterpret_cast<float*>(kv);   /* [ROW_GROUPS][RMAX][HEAD_DIM] */
    if (pv_group < ROW_GROUPS) {
#pragma unroll
        for (int i = 0; i < PV_ROWS; ++i)
#pragma unroll
            for (int v = 0; v < VEC; ++v) red[(pv_group * RMAX + i) * HEAD_DIM + pv_chunk * VEC + v] = acc[i][v];
    }
    __syncthreads();
    for (int e = tid; e < rows * HEAD_DIM; e += THREADS) {
        const int r = e / HEAD_DIM, d = e - r * HEAD_DIM;
        float o = 0.f;
        for (int g = 0; g < ROW_GROUPS; ++g) o += red[(g * RMAX + r) * HEAD_DIM + d];
        const long long token = q_begin + t0 + r / group;
        const int head = kv_head * group + r % group;
        const long long row = token * num_heads + head;
        if (w.splits == 1) {
            const float l = l_s[r];
            out[row * HEAD_DIM + d] = from_float(l > 0.f ? o / l : 0.f);
        } else {
            const long long base = (long long)split * num_tokens * num_heads + row;
            part_out[base * HEAD_DIM + d] = o;
            if (d == 0) { part_ml[base * 2] = m_s[r]; part_ml[base * 2 + 1] = l_s[r]; }
        }
    }
    return;
#endif
    if (pv_group >= ROW_GROUPS) return;
#pragma unroll
    for (int i = 0; i < PV_ROWS; ++i) {
        const int r = pv_group + i * ROW_GROUPS;
        if (r >= rows) continue;
        const long long token = q_begin + t0 + r / group;
        const int head = kv_head * group + r % group;
        const long long row = token * num_heads + head;
        if (w.splits == 1) {
            const float l = l_s[r];
            const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
            for (int v = 0; v < VEC; ++v) out[row * HEAD_DIM + pv_chunk * VEC + v] = from_float(acc[i][v] * inv);
        } else {
            const long long base = (long long)split * num_tokens * num_heads + row;
            float* dst = part_out + base * HEAD_DIM + pv_chunk * VEC;
#pragma unroll
            for (int v = 0; v < VEC; ++v) dst[v] = acc[i][v];
            if (pv_chunk == 0) { part_ml[base * 2] = m_s[r]; part_ml[base * 2 + 1] = l_s[r]; }
        }
    }
}

/* ---- tensor-core variant (bf16 / fp16, HEAD_DIM % 16 == 0, HEAD_DIM <= 128, at most 16 rows) ----
   The block's query rows (tokens x GQA group, <= 16) form one m16 tile; each of the 4 warps takes 16
   of every 64-key tile: S = Q K^T and O += P V with mma.sync m16n8k16 (float32 accumulation, P
   rounded to the operand type as FlashAttention-2 does), an online softmax per warp, and the four
   warps' (max, sum, O) merged through shared memory at the end. Two barriers per tile. */
#if DTYPE != DT_F32
"""
    + ptx.MMA_M16N8K16
    + ptx.LDMATRIX
    + r"""
/* two floats -> the operand type, packed low (first) / high (second) */
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    return (unsigned)from_float(lo) | ((unsigned)from_float(hi) << 16);
}

extern "C" __global__ void __launch_bounds__(128) append_attention_mma(
    const scalar_t* __restrict__ query, const scalar_t* __restrict__ key_cache,
    const scalar_t* __restrict__ value_cache, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc,
    const int* __restrict__ tile_starts, const long long* __restrict__ tree_mask,
    scalar_t* __restrict__ out, float* __restrict__ part_out,
    float* __restrict__ part_ml, int num_seqs, int num_tokens, int num_heads, int num_kv_heads,
    int block_size, int max_blocks, int tile_tokens, int num_splits, int max_query_len,
    float scale_log2, int sliding_window, int min_split_keys)
{
    extern __shared__ __align__(16) unsigned char smem[];
    scalar_t* kv = reinterpret_cast<scalar_t*>(smem);   /* 2 stages x (K, V) x [BLOCK_N][ROW_STRIDE] */

    BlockWork w;
    if (!block_work(w, block_tables, seq_lens, query_start_loc, tile_starts, num_seqs, num_heads,
                    num_kv_heads, max_blocks, tile_tokens, num_splits, max_query_len, sliding_window,
                    min_split_keys))
        return;
    const int kv_head = blockIdx.y, split = blockIdx.z;
    const int q_begin = w.q_begin, t0 = w.t0, group = w.group, rows = w.rows, first_pos = w.first_pos;
    const int s_begin = w.s_begin, s_end = w.s_end, num_kv_tiles = w.num_kv_tiles;
    const int* table = w.table;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;     /* mma fragment row group / column pair */

    if (num_kv_tiles > 0)
        load_tile(kv, kv + BLOCK_N * ROW_STRIDE, key_cache, value_cache, table, s_begin, s_end,
                  block_size, num_kv_heads, kv_head);
    cp_async_commit();

    /* Q fragments (A operand, rows g and g + 8, unscaled), straight from global memory */
    unsigned qf[HEAD_DIM / 16][4];
    int pos_q[2];
#if TREE
    long long tmask[2];
#endif
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = g + 8 * h;
        pos_q[h] = r < rows ? first_pos + r / group : -1;
#if TREE
        tmask[h] = r < rows ? tree_mask[q_begin + t0 + r / group] : -1LL;
#endif
        const long long base = r < rows
            ? ((long long)(q_begin + t0 + r / group) * num_heads + kv_head * group + r % group) * HEAD_DIM : -1;
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                unsigned v = 0u;
                if (base >= 0) v = *reinterpret_cast<const unsigned*>(query + base + kk * 16 + half * 8 + 2 * t);
                qf[kk][h + 2 * half] = v;   /* a0: (g, 2t) a1: (g+8, 2t) a2: (g, 2t+8) a3: (g+8, 2t+8) */
            }
        }
    }

    float o[HEAD_DIM / 8][4];
#pragma unroll
    for (int j = 0; j < HEAD_DIM / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};
    const int kw = warp * 16;                  /* this warp's keys within a tile */

    for (int it = 0; it < num_kv_tiles; ++it) {
        const int stage = it & 1;
        const scalar_t* ks = kv + stage * 2 * BLOCK_N * ROW_STRIDE;
        const scalar_t* vs = ks + BLOCK_N * ROW_STRIDE;
        const int tile_start = s_begin + it * BLOCK_N;
        if (it + 1 < num_kv_tiles) {
            scalar_t* next = kv + (stage ^ 1) * 2 * BLOCK_N * ROW_STRIDE;
            load_tile(next, next + BLOCK_N * ROW_STRIDE, key_cache, value_cache, table,
                      tile_start + BLOCK_N, s_end, block_size, num_kv_heads, kv_head);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();

        /* S (16 rows x this warp's 16 keys: two n8 tiles) */
        float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        {
            const int mi = lane >> 3, ri = lane & 7;
            const scalar_t* krow = ks + (kw + ri + (mi >> 1) * 8) * ROW_STRIDE + (mi & 1) * 8;
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
                unsigned b[4];
                ldmatrix_x4(b, krow + kk * 16);
                mma16816(sc[0], qf[kk], b[0], b[1]);
                mma16816(sc[1], qf[kk], b[2], b[3]);
            }
        }
        /* mask, scale, online softmax (rows g and g + 8 of this warp's keys) */
        float p[2][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = NEG_INF;
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int pos_k = tile_start + kw + j * 8 + 2 * t + c;
                    bool visible = pos_q[h] >= 0 && pos_k < s_end && pos_k <= pos_q[h] &&
                                   (sliding_window <= 0 || pos_q[h] - pos_k < sliding_window);
#if TREE
                    visible = visible && in_tree(tmask[h], pos_k, w.context_len);
#endif
                    const float v = visible ? sc[j][2 * h + c] * scale_log2 : NEG_INF;
                    p[j][2 * h + c] = v;
                    mx = fmaxf(mx, v);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m_run[h], mx);
            float alpha = 1.f, sum = 0.f;
            if (m_new != NEG_INF) {
                alpha = exp2f(m_run[h] - m_new);
#pragma unroll
                for (int j = 0; j < 2; ++j)
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const float e = exp2f(p[j][2 * h + c] - m_new);
                        p[j][2 * h + c] = e;
                        sum += e;
                    }
            } else {
#pragma unroll
                for (int j = 0; j < 2; ++j) p[j][2 * h] = p[j][2 * h + 1] = 0.f;
            }
            m_run[h] = m_new;
            l_run[h] = l_run[h] * alpha + sum;
#pragma unroll
            for (int j = 0; j < HEAD_DIM / 8; ++j) { o[j][2 * h] *= alpha; o[j][2 * h + 1] *= alpha; }
        }
        /* O += P V: P's accumulator layout is the A operand of a k16 step over the warp's keys */
        {
            unsigned pa[4] = {pack2(p[0][0], p[0][1]), pack2(p[0][2], p[0][3]),
                              pack2(p[1][0], p[1][1]), pack2(p[1][2], p[1][3])};
            const int mi = lane >> 3, ri = lane & 7;
            const scalar_t* vrow = vs + (kw + ri + (mi & 1) * 8) * ROW_STRIDE + (mi >> 1) * 8;
#pragma unroll
            for (int d = 0; d < HEAD_DIM / 16; ++d) {
                unsigned b[4];
                ldmatrix_x4_trans(b, vrow + d * 16);
                mma16816(o[2 * d], pa, b[0], b[1]);
                mma16816(o[2 * d + 1], pa, b[2], b[3]);
            }
        }
        __syncthreads();
    }

    /* merge the four warps: (max, sum, O) per row through shared memory (the KV tiles are free) */
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
        l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
    }
    float* o_w = reinterpret_cast<float*>(smem);          /* [4][16][HEAD_DIM] */
    float* m_w = o_w + 4 * 16 * HEAD_DIM;                  /* [4][16] */
    float* l_w = m_w + 4 * 16;                             /* [4][16] */
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = g + 8 * h;
        if (t == 0) { m_w[warp * 16 + r] = m_run[h]; l_w[warp * 16 + r] = l_run[h]; }
#pragma unroll
        for (int j = 0; j < HEAD_DIM / 8; ++j) {
            o_w[(warp * 16 + r) * HEAD_DIM + j * 8 + 2 * t] = o[j][2 * h];
            o_w[(warp * 16 + r) * HEAD_DIM + j * 8 + 2 * t + 1] = o[j][2 * h + 1];
        }
    }
    __syncthreads();
    for (int e = tid; e < rows * HEAD_DIM; e += 128) {
        const int r = e / HEAD_DIM, d = e - r * HEAD_DIM;
        float m = NEG_INF;
#pragma unroll
        for (int w = 0; w < 4; ++w) m = fmaxf(m, m_w[w * 16 + r]);
        float l = 0.f, acc = 0.f;
        if (m != NEG_INF) {
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                const float f = exp2f(m_w[w * 16 + r] - m);
                l += l_w[w * 16 + r] * f;
                acc += o_w[(w * 16 + r) * HEAD_DIM + d] * f;
            }
        }
        const long long token = q_begin + t0 + r / group;
        const long long row = token * num_heads + kv_head * group + r % group;
        if (w.splits == 1) {
            out[row * HEAD_DIM + d] = from_float(l > 0.f ? acc / l : 0.f);
        } else {
            const long long base = (long long)split * num_tokens * num_heads + row;
            part_out[base * HEAD_DIM + d] = acc;
            if (d == 0) { part_ml[base * 2] = m; part_ml[base * 2 + 1] = l; }
        }
    }
}
#endif

/* Merges the splits of one (token, head): out = sum_j 2^(m_j - m) O_j / sum_j 2^(m_j - m) l_j over
   the splits its query tile used (split_keys); a tile that used one has its output written. */
extern "C" __global__ void merge_splits(
    const float* __restrict__ part_out, const float* __restrict__ part_ml,
    const int* __restrict__ query_start_loc, const int* __restrict__ seq_lens, scalar_t* __restrict__ out,
    int num_seqs, int num_tokens, int num_heads, int num_splits, int max_query_len, int tile_tokens,
    int sliding_window, int min_split_keys)
{
    const long long row = blockIdx.x;                 /* token * num_heads + head */
    const int token = (int)(row / num_heads);
    int lo = 0, hi = num_seqs;                        /* the sequence holding `token` */
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (query_start_loc[mid] <= token) lo = mid; else hi = mid;
    }
    const int q_begin = query_start_loc[lo], q_len = query_start_loc[lo + 1] - q_begin;
    if (q_len > max_query_len || token >= query_start_loc[num_seqs]) return;
    const int t0 = (token - q_begin) / tile_tokens * tile_tokens;   /* as block_work's tile */
    const int first_pos = seq_lens[lo] - q_len + t0;
    const int kv_end = first_pos + min(tile_tokens, q_len - t0);
    const int kv_begin = sliding_window > 0 ? max(0, first_pos - sliding_window + 1) : 0;
    int per_split;
    const int splits = split_keys(kv_end - kv_begin, num_splits, min_split_keys, per_split);
    if (splits == 1) return;
    const long long stride = (long long)num_tokens * num_heads;
    float m = NEG_INF;
    for (int j = 0; j < splits; ++j) m = fmaxf(m, part_ml[(j * stride + row) * 2]);
    float total = 0.f;
    for (int j = 0; j < splits; ++j) {
        const float l = part_ml[(j * stride + row) * 2 + 1];
        if (l > 0.f) total += exp2f(part_ml[(j * stride + row) * 2] - m) * l;
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
        float o = 0.f;
        for (int j = 0; j < splits; ++j) {
            const float l = part_ml[(j * stride + row) * 2 + 1];
            if (l > 0.f) o += exp2f(part_ml[(j * stride + row) * 2] - m) * part_out[(j * stride + row) * HEAD_DIM + d];
        }
        out[row * HEAD_DIM + d] = from_float(o * inv);
    }
}

/* One thread per 16-byte chunk of a token's keys (and values); slot < 0 skips the token. */
extern "C" __global__ void write_kv(
    const scalar_t* __restrict__ key, const scalar_t* __restrict__ value,
    scalar_t* __restrict__ key_cache, scalar_t* __restrict__ value_cache,
    const long long* __restrict__ slot_mapping, int num_tokens, int row_chunks,
    long long key_stride, long long value_stride)
{
    const long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= (long long)num_tokens * row_chunks) return;
    const long long t = id / row_chunks;
    const int c = (int)(id - t * row_chunks);
    const long long slot = slot_mapping[t];
    if (slot < 0) return;
    const long long dst = slot * row_chunks * VEC + c * VEC;
    *reinterpret_cast<uint4*>(key_cache + dst) =
        *reinterpret_cast<const uint4*>(key + t * key_stride + c * VEC);
    *reinterpret_cast<uint4*>(value_cache + dst) =
        *reinterpret_cast<const uint4*>(value + t * value_stride + c * VEC);
}
"""
)

LOG2E = 1.4426950408889634


def _rmax(rows: int) -> int:
    return max(8, 1 << math.ceil(math.log2(rows)))


def tensor_cores_apply(dtype: torch.dtype, head_dim: int, group: int, device: torch.device) -> bool:
    """Whether the mma.sync variant runs by default: where supported, unless TENSOR_CORES_ENV is `off`."""
    off = os.environ.get(TENSOR_CORES_ENV, "").lower() == "off"
    return not off and mma_supported(dtype, head_dim, group, device)


def mma_supported(dtype: torch.dtype, head_dim: int, group: int, device: torch.device) -> bool:
    """Whether the mma.sync variant can take these heads on this device."""
    return (
        dtype in (torch.bfloat16, torch.float16)
        and head_dim % 16 == 0
        and head_dim <= MMA_MAX_HEAD_DIM
        and group <= MMA_ROWS
        and torch.cuda.get_device_capability(device) >= (8, 0)
    )


def mma_smem_bytes(head_dim: int, elem_size: int) -> int:
    vec = 16 // elem_size
    tiles = 2 * 2 * BLOCK_N * (head_dim + vec) * elem_size
    merge = (4 * 16 * head_dim + 2 * 4 * 16) * 4
    return max(tiles, merge)


def smem_bytes(rmax: int, head_dim: int, elem_size: int) -> int:
    vec = 16 // elem_size
    chunks = head_dim // vec
    floats = rmax * head_dim + rmax * (BLOCK_N + 1) + 3 * rmax
    floats += 4 - rmax % 4
    tiles = 2 * 2 * BLOCK_N * (head_dim + vec) * elem_size
    key_parallel = rmax <= 8 and THREADS % chunks == 0
    reduction = (THREADS // chunks) * rmax * head_dim * 4 if key_parallel else 0
    return floats * 4 + max(tiles, reduction)


def _check_cache(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    device = query.device
    dtypes = list(_cuda.DTYPE_IDS)
    _cuda.check_cuda_tensor("query", query, dtypes, 3, device)
    _cuda.check_cuda_tensor("key_cache", key_cache, [query.dtype], 4, device)
    _cuda.check_cuda_tensor("value_cache", value_cache, [query.dtype], 4, device)
    _cuda.check(key_cache.shape == value_cache.shape, "key_cache and value_cache shapes differ")
    _cuda.check(key_cache.is_contiguous() and value_cache.is_contiguous(), "KV caches must be contiguous")
    head_dim = key_cache.shape[-1]
    vec = 16 // query.element_size()
    _cuda.check(
        head_dim % (2 * vec) == 0 and head_dim <= 256,
        f"head_dim {head_dim} must be a multiple of {2 * vec} and at most 256",
    )


def append_attention_cuda(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    tensor_cores: bool | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Same contract as `append_attention_ref`. `num_splits` overrides the context split count
    (None: enough thread blocks to fill the GPU); `tensor_cores` forces the mma.sync variant on or
    off (None: wherever `tensor_cores_apply`)."""
    _check_cache(query, key_cache, value_cache)
    device = query.device
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    _cuda.check(cache_head_dim == head_dim, f"query head_dim {head_dim} != cache head_dim {cache_head_dim}")
    _cuda.check(num_heads % num_kv_heads == 0, f"{num_heads} heads not a multiple of {num_kv_heads} kv heads")
    group = num_heads // num_kv_heads
    _cuda.check(group <= MAX_ROWS, f"{group} query heads per kv head; at most {MAX_ROWS} supported")
    _cuda.check(query.is_contiguous(), "query must be contiguous")
    for name, t in (
        ("block_tables", meta.block_tables),
        ("seq_lens", meta.seq_lens),
        ("query_start_loc", meta.query_start_loc),
    ):
        _cuda.check(
            t.dtype == torch.int32 and t.is_contiguous() and t.device == device,
            f"{name} must be a contiguous int32 tensor on {device}",
        )
    check_tree_mask(meta, sliding_window)
    if meta.tree_mask is not None:
        _cuda.check(
            meta.tree_mask.dtype == torch.int64
            and meta.tree_mask.shape == (num_tokens,)
            and meta.tree_mask.is_contiguous()
            and meta.tree_mask.device == device,
            f"tree_mask must be a contiguous int64 tensor of one mask per token on {device}",
        )
    out = torch.empty_like(query)
    num_seqs = meta.num_seqs
    if num_seqs == 0 or num_tokens == 0:
        return out
    # a CUDA graph's launch bound, or the step's own longest query
    max_query_len = meta.max_query_len if meta.max_query_len is not None else max(meta.query_lens_cpu)
    _launch_attention(
        query,
        key_cache,
        value_cache,
        meta,
        scale,
        sliding_window,
        out,
        max_query_len,
        group,
        num_splits,
        tensor_cores,
    )
    return out


def _launch_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    max_query_len: int,
    group: int,
    num_splits: int | None,
    tensor_cores: bool | None,
) -> None:
    device = query.device
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = meta.num_seqs
    if tensor_cores is None:
        tensor_cores = tensor_cores_apply(query.dtype, head_dim, group, device)
    _cuda.check(
        not tensor_cores or mma_supported(query.dtype, head_dim, group, device),
        f"the tensor-core variant takes bf16 / fp16, head_dim % 16 == 0 up to {MMA_MAX_HEAD_DIM}, "
        f"at most {MMA_ROWS} query heads per kv head, sm_80+",
    )
    few_blocks = num_seqs * num_kv_heads < 2 * _cuda.num_sms(device.index or 0)
    tile_rows = MMA_ROWS if tensor_cores else SMALL_GRID_ROWS if few_blocks else MAX_ROWS
    tile_tokens = max(1, min(max_query_len, tile_rows // group))
    max_tiles = -(-max_query_len // tile_tokens)
    rmax = _rmax(tile_tokens * group)
    tile_starts = None
    num_tiles = num_seqs
    if max_tiles > 1:
        tile_starts = meta.tile_starts(tile_tokens, max_query_len)
        if meta.max_query_len is None:  # eager: the step's own tiles
            num_tiles = sum(-(-n // tile_tokens) for n in meta.query_lens_cpu if n <= max_query_len)
        else:  # a graph's bound: a tile holds at least one token
            num_tiles = min(num_tokens, num_seqs * max_tiles)
    min_keys = min_split_keys()
    if num_splits is None:
        max_seq_len = meta.max_seq_len if meta.max_seq_len is not None else max(meta.seq_lens_cpu)
        num_splits = choose_splits(num_tiles * num_kv_heads, max_seq_len, device, min_keys)
    dtype_id = _cuda.DTYPE_IDS[query.dtype]
    if tensor_cores:
        smem = mma_smem_bytes(head_dim, query.element_size())
    else:
        smem = smem_bytes(rmax, head_dim, query.element_size())
    # a tree-masked variant of its own: causal queries run the kernel without the mask's reads
    tree = {"TREE": 1} if meta.tree_mask is not None else {}
    kernel = _cuda.function(
        SOURCE,
        "append_attention_mma" if tensor_cores else "append_attention",
        device,
        DTYPE=dtype_id,
        HEAD_DIM=head_dim,
        RMAX=rmax,
        BLOCK_N=BLOCK_N,
        THREADS=THREADS,
        **tree,
    )
    _cuda.set_max_dynamic_shared(kernel, smem)
    if num_splits > 1:
        part_out = torch.empty(
            num_splits, num_tokens, num_heads, head_dim, dtype=torch.float32, device=device
        )
        part_ml = torch.empty(num_splits, num_tokens, num_heads, 2, dtype=torch.float32, device=device)
    else:
        part_out = part_ml = out  # unused
    i32 = np.int32
    _cuda.launch(
        kernel,
        (num_tiles, num_kv_heads, num_splits),
        (THREADS,),
        (
            query,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            tile_starts,
            meta.tree_mask,
            out,
            part_out,
            part_ml,
            i32(num_seqs),
            i32(num_tokens),
            i32(num_heads),
            i32(num_kv_heads),
            i32(block_size),
            i32(meta.block_tables.shape[1]),
            i32(tile_tokens),
            i32(num_splits),
            i32(max_query_len),
            np.float32(scale * LOG2E),
            i32(sliding_window or 0),
            i32(min_keys),
        ),
        device,
        shared_mem=smem,
    )
    if num_splits > 1:
        merge = _cuda.function(
            SOURCE,
            "merge_splits",
            device,
            DTYPE=dtype_id,
            HEAD_DIM=head_dim,
            RMAX=rmax,
            BLOCK_N=BLOCK_N,
            THREADS=THREADS,
        )
        _cuda.launch(
            merge,
            (num_tokens * num_heads,),
            (min(head_dim, 128),),
            (
                part_out,
                part_ml,
                meta.query_start_loc,
                meta.seq_lens,
                out,
                i32(num_seqs),
                i32(num_tokens),
                i32(num_heads),
                i32(num_splits),
                i32(max_query_len),
                i32(tile_tokens),
                i32(sliding_window or 0),
                i32(min_keys),
            ),
            device,
        )


def min_split_keys() -> int:
    """Fewest keys of a context split: SPECMESH_ATTN_MIN_SPLIT_KEYS, else MIN_KEYS_PER_SPLIT,
    rounded up to whole tiles."""
    keys = int(os.environ.get(MIN_SPLIT_KEYS_ENV, MIN_KEYS_PER_SPLIT))
    return max(BLOCK_N, -(-keys // BLOCK_N) * BLOCK_N)


def choose_splits(
    num_blocks: int, max_seq_len: int, device: torch.device, min_keys: int = MIN_KEYS_PER_SPLIT
) -> int:
    """Context splits launched per query tile: none when the unsplit blocks already cover every SM
    (a split then only adds the merge) or the longest context fits one split of `min_keys`, else
    enough for about two blocks per SM. Each tile then uses only the splits of at least `min_keys`
    keys its own context fills (`split_keys` in the kernels), the others return at once."""
    num_sms = _cuda.num_sms(device.index or 0)
    if num_blocks >= num_sms:
        return 1
    by_occupancy = -(-2 * num_sms // num_blocks)
    by_length = max(1, max_seq_len // min_keys)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def write_kv_cuda(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; negative: skip the token
) -> None:
    """Same contract as `write_kv_ref` (keys and values may be row-strided views, e.g. of a fused
    QKV projection, as long as each token's heads are contiguous)."""
    device = key.device
    dtypes = list(_cuda.DTYPE_IDS)
    _cuda.check_cuda_tensor("key", key, dtypes, 3, device)
    _cuda.check_cuda_tensor("value", value, [key.dtype], 3, device)
    _cuda.check_cuda_tensor("key_cache", key_cache, [key.dtype], 4, device)
    _cuda.check_cuda_tensor("value_cache", value_cache, [key.dtype], 4, device)
    _cuda.check_cuda_tensor("slot_mapping", slot_mapping, [torch.int64], 1, device)
    num_tokens, num_kv_heads, head_dim = key.shape
    _cuda.check(value.shape == key.shape, f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    _cuda.check(key_cache.shape[2:] == key.shape[1:], "cache [.., num_kv_heads, head_dim] must match key")
    _cuda.check(key_cache.is_contiguous() and value_cache.is_contiguous(), "KV caches must be contiguous")
    _cuda.check(
        slot_mapping.shape[0] == num_tokens and slot_mapping.is_contiguous(),
        "slot_mapping must be contiguous with one slot per token",
    )
    vec = 16 // key.element_size()
    _cuda.check(head_dim % vec == 0, f"head_dim {head_dim} must be a multiple of {vec}")
    if num_tokens == 0:
        return
    key, value = _rows_aligned(key), _rows_aligned(value)
    row_chunks = num_kv_heads * head_dim // vec
    kernel = _cuda.function(
        SOURCE,
        "write_kv",
        device,
        DTYPE=_cuda.DTYPE_IDS[key.dtype],
        HEAD_DIM=head_dim,
        RMAX=8,
        BLOCK_N=BLOCK_N,
        THREADS=THREADS,
    )
    total = num_tokens * row_chunks
    _cuda.launch(
        kernel,
        (-(-total // 256),),
        (256,),
        (
            key,
            value,
            key_cache,
            value_cache,
            slot_mapping,
            np.int32(num_tokens),
            np.int32(row_chunks),
            np.int64(key.stride(0)),
            np.int64(value.stride(0)),
        ),
        device,
    )


def _rows_aligned(x: torch.Tensor) -> torch.Tensor:
    """x itself when each token's heads are contiguous and 16-byte aligned, else a contiguous copy."""
    es = x.element_size()
    ok = (
        x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and x.data_ptr() % 16 == 0
        and (x.stride(0) * es) % 16 == 0
    )
    return x if ok else x.contiguous()
