"""CUDA fused verify + accept + sample for a whole batch in one launch; twin of `verify_sample_ref`.

One thread block per logit row reads the row a few times from L2 and computes: the argmax (greedy
id); for sampling rows the temperature softmax, the min_p / top_k / top_p cut (radix selection on
the probabilities' bit patterns: the k-th largest, and the smallest top set whose mass reaches
top_p), and the sample argmax(probs / e) with e ~ Exp(1) from the counter-based generator of
`sampling_noise_ref` computed in registers (float64 log, then float32: the same numbers as the
reference); and whether the row's draft passes. When few rows leave SMs idle, each row is split over
several blocks (`split_chunks`). A greedy row's blocks each take the argmax of their chunk, and the
last block to finish (an atomic counter per row) merges them and carries on as the row's block. A
sampled row's blocks run every pass over their chunk and meet after each pass (a barrier on the
row's counter) to merge the parts through global memory (max, sums, radix histograms, the sample's
argmax), so each holds the whole row's values; the row's first block then carries on. The barrier
needs every block of the launch resident at once: the grid is at most one block per SM.
The last block of a request to finish (an atomic
counter per request) walks the request's rows, accepts the leading passing drafts and writes the
emitted tokens, so acceptance needs no second launch and no host round trip.

A row marked in `masked_rows` reads its grammar's bitmask as it reads its logits: a token whose
bit is clear counts as a logit of -inf in every pass, so the mask costs one 4-byte word per 32
logits and no pass of its own; unmarked rows read no mask.

Covered: one-hot drafts (model-free methods, greedy model drafts) with every strategy and accept
policy. Rows whose drafts carry a draft distribution (rejection sampling against a draft model's
probabilities) and requests that want logprobs stay on the torch path (RejectionSampler).
Ties at a top_k / top_p boundary keep every tied token (the reference's sort keeps an arbitrary
subset of them).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from kernels import _cuda
from kernels.verify_ref import NORMAL, num_mask_words

THREADS = 512
SPLIT_ENV = "SPECMESH_VERIFY_SPLIT"
"""`off`: every row in one block again; `greedy`: greedy rows split, sampled rows in one block (A/B
timing of the split rows)."""
MIN_CHUNK_ENV = "SPECMESH_VERIFY_MIN_CHUNK"
"""Overrides MIN_CHUNK (tuning on a GPU)."""
MIN_CHUNK = 4096
"""Fewest logits a block of a split row scans (32 KB): at batch 1 a 128k vocabulary takes 15
blocks. `benchmarks.gpu_kernels --only decode_paths --decode-parts verify` times the others."""

SOURCE = r"""
#define NEG_INF (-__int_as_float(0x7f800000))
#define GOLDEN 0x9E3779B97F4A7C15ull
#define MIX1 0xBF58476D1CE4E5B9ull
#define MIX2 0x94D049BB133111EBull
#define STREAM_TARGET 0
#define S_GREEDY 0
#define S_TOPP 2
#define P_ACCEPT_ALL 1
#define P_REJECT_ALL 2

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long x) {
    unsigned long long z = x + GOLDEN;
    z = (z ^ (z >> 30)) * MIX1;
    z = (z ^ (z >> 27)) * MIX2;
    return z ^ (z >> 31);
}

/* The logit of token i under the row's grammar mask (null: no mask): -inf where its bit is clear. */
__device__ __forceinline__ float masked(float x, const unsigned* __restrict__ mask, int i) {
    return mask == nullptr || ((__ldg(mask + (i >> 5)) >> (i & 31)) & 1u) ? x : NEG_INF;
}

/* Calls f(value, index) for every logit of a row (masked), 16-byte loads when the row allows. */
template <class F>
__device__ __forceinline__ void scan_row(const float* __restrict__ row, const unsigned* __restrict__ mask,
                                         int vocab, F f) {
    if ((vocab & 3) == 0 && (reinterpret_cast<unsigned long long>(row) & 15) == 0) {
        const float4* row4 = reinterpret_cast<const float4*>(row);
        const int n4 = vocab >> 2;
#pragma unroll 4
        for (int j = threadIdx.x; j < n4; j += THREADS) {
            float4 v = __ldg(row4 + j);
            if (mask != nullptr) {  /* 4 | 32: the four tokens share one word */
                const unsigned bits = __ldg(mask + (j >> 3)) >> ((4 * j) & 31);
                if (!(bits & 1u)) v.x = NEG_INF;
                if (!(bits & 2u)) v.y = NEG_INF;
                if (!(bits & 4u)) v.z = NEG_INF;
                if (!(bits & 8u)) v.w = NEG_INF;
            }
            f(v.x, 4 * j); f(v.y, 4 * j + 1); f(v.z, 4 * j + 2); f(v.w, 4 * j + 3);
        }
    } else {
        for (int i = threadIdx.x; i < vocab; i += THREADS) f(masked(__ldg(row + i), mask, i), i);
    }
}

/* Block-wide reductions over THREADS threads; `scratch` holds 32 entries per array. */
__device__ float block_sum(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < THREADS / 32 ? scratch[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* argmax with the lowest index among equal values (torch.argmax's rule) */
__device__ __forceinline__ void better(float& v, int& i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i) || (v != v && ov == ov)) { v = ov; i = oi; }
}
__device__ void block_argmax(float& v, int& i, float* sv, int* si) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        better(v, i, ov, oi);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) { sv[warp] = v; si[warp] = i; }
    __syncthreads();
    if (lane < THREADS / 32) { v = sv[lane]; i = si[lane]; } else { v = NEG_INF; i = 0x7fffffff; }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        better(v, i, ov, oi);
    }
}

/* A row scanned by several blocks (`chunks` > 1; the block's copy lives in shared memory): block `c` of the row scans its chunk, and after each
   pass the row's blocks publish their partial result in the row's scratch, meet at a barrier (the
   row's counter) and merge every chunk's part in chunk order, so that each block holds the same
   merged value. The scratch is double-buffered by pass parity: a block writes pass p + 2's parts only
   after every block has passed barrier p + 1, so after it read pass p's. */
struct RowSplit {
    int chunks, c, phase;
    int* counter;        /* the row's arrival counter: zero before the launch, left zero */
    float* vals;         /* [2][chunks][256]: histograms, sums (entry 0), argmax values (entry 0) */
    int* idx;            /* [2][chunks]: argmax indices */
};

/* Waits until every block of the row has reached this barrier (the blocks are co-resident: see
   split_chunks). The fences make each block's parts, written before, visible to the others. */
__device__ __forceinline__ void row_barrier(RowSplit& s) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(s.counter, 1);
        const int target = s.chunks * (s.phase + 1);
        while (*(volatile int*)s.counter < target) __nanosleep(64);
        __threadfence();
        ++s.phase;
    }
    __syncthreads();
}

/* The end of a split row's passes: the last block to leave resets the row's counter. */
__device__ __forceinline__ void row_leave(RowSplit& s) {
    if (s.chunks > 1 && threadIdx.x == 0 && atomicAdd(s.counter, 1) == s.chunks * (s.phase + 1) - 1)
        *s.counter = 0;
}

/* The sum of every chunk's (block-uniform) `v`, added in chunk order: the same float in every block. */
__device__ __forceinline__ float merge_sum(RowSplit& s, float v, float* scratch) {
    if (s.chunks == 1) return v;
    float* parts = s.vals + (s.phase & 1) * s.chunks * 256;
    if (threadIdx.x == 0) parts[s.c * 256] = v;
    row_barrier(s);
    if (threadIdx.x == 0) {
        float total = 0.f;
        for (int c = 0; c < s.chunks; ++c) total += __ldcg(parts + c * 256);
        scratch[0] = total;
    }
    __syncthreads();
    v = scratch[0];
    __syncthreads();
    return v;
}

/* The row's argmax from every chunk's (block-uniform) argmax, lowest index among equal values. */
__device__ __forceinline__ void merge_argmax(RowSplit& s, float& v, int& i, float* sv, int* si) {
    if (s.chunks == 1) return;
    float* parts = s.vals + (s.phase & 1) * s.chunks * 256;
    int* parts_i = s.idx + (s.phase & 1) * s.chunks;
    if (threadIdx.x == 0) { parts[s.c * 256] = v; parts_i[s.c] = i; }
    row_barrier(s);
    v = NEG_INF; i = 0x7fffffff;
    for (int c = threadIdx.x; c < s.chunks; c += THREADS) better(v, i, __ldcg(parts + c * 256), __ldcg(parts_i + c));
    block_argmax(v, i, sv, si);
}

/* A 256-bin histogram summed over the row's chunks, bin by bin in chunk order. */
__device__ __forceinline__ void merge_hist(RowSplit& s, float* hist) {
    if (s.chunks == 1) return;
    float* parts = s.vals + (s.phase & 1) * s.chunks * 256;
    for (int b = threadIdx.x; b < 256; b += THREADS) parts[s.c * 256 + b] = hist[b];
    row_barrier(s);
    for (int b = threadIdx.x; b < 256; b += THREADS) {
        float total = 0.f;
        for (int c = 0; c < s.chunks; ++c) total += __ldcg(parts + c * 256 + b);
        hist[b] = total;
    }
    __syncthreads();
}

/* The target probability of token i, computed as the reference does: exp(l / t - max) / sum. */
__device__ __forceinline__ float prob(const float* __restrict__ row, const unsigned* __restrict__ mask, int i,
                                      float t, float m, float z) {
    return expf(masked(row[i], mask, i) / t - m) / z;
}

/* Radix step: given candidates (bits >= lower and bits matching prefix under digits), returns the
   digit at `shift` where the running count (COUNT) or mass (!COUNT) from the top reaches `target`;
   `above` accumulates what lies in higher digits. Returns -1 if the target is never reached. */
template <bool COUNT>
__device__ int radix_digit(const float* __restrict__ row, const unsigned* __restrict__ mask, int vocab,
                           float t, float m, float z,
                           unsigned lower, unsigned prefix, unsigned digits, int shift, float target,
                           float* above, float* hist, RowSplit& split)
{
    for (int b = threadIdx.x; b < 256; b += THREADS) hist[b] = 0.f;
    __syncthreads();
    scan_row(row, mask, vocab, [&](float x, int) {
        const float q = expf(x / t - m) / z;
        const unsigned bits = __float_as_uint(q);
        if (bits >= lower && (bits & digits) == prefix)
            atomicAdd(&hist[(bits >> shift) & 255], COUNT ? 1.f : q);
    });
    __syncthreads();
    merge_hist(split, hist);
    __shared__ int digit;
    if (threadIdx.x == 0) {
        float acc = *above;
        digit = -1;
        for (int b = 255; b >= 0; --b) {
            if (acc + hist[b] >= target) { digit = b; break; }
            acc += hist[b];
        }
        if (digit >= 0) *above = acc;
    }
    __syncthreads();
    const int d = digit;
    __syncthreads();
    return d;
}

/* Smallest bit pattern kept: the k-th largest (COUNT, target = k) or the last element of the
   shortest top set whose mass reaches target (!COUNT); `lower` if the target is never reached. */
template <bool COUNT>
__device__ unsigned radix_select(const float* __restrict__ row, const unsigned* __restrict__ mask, int vocab,
                                 float t, float m, float z,
                                 unsigned lower, float target, float* hist, float* above_s, RowSplit& split)
{
    if (threadIdx.x == 0) *above_s = 0.f;
    __syncthreads();
    unsigned prefix = 0, digits = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        const int d = radix_digit<COUNT>(row, mask, vocab, t, m, z, lower, prefix, digits, shift, target,
                                         above_s, hist, split);
        if (d < 0) return lower;
        prefix |= ((unsigned)d) << shift;
        digits |= 255u << shift;
    }
    return prefix > lower ? prefix : lower;
}

__device__ float kept_sum(const float* __restrict__ row, const unsigned* __restrict__ mask, int vocab, float t,
                          float m, float z, unsigned lower, float* scratch, RowSplit& split)
{
    float s = 0.f;
    scan_row(row, mask, vocab, [&](float x, int) {
        const float q = expf(x / t - m) / z;
        if (__float_as_uint(q) >= lower) s += q;
    });
    return merge_sum(split, block_sum(s, scratch), scratch);
}

extern "C" __global__ void __launch_bounds__(THREADS) verify_sample(
    const float* __restrict__ logits,          /* [num_rows, vocab] */
    const float* __restrict__ temperature,     /* [num_rows] */
    const int* __restrict__ top_k,
    const float* __restrict__ top_p,
    const float* __restrict__ min_p,
    const long long* __restrict__ seeds,
    const long long* __restrict__ positions,
    const int* __restrict__ draft_ids,         /* [num_rows], -1 on bonus rows */
    const int* __restrict__ request_of_row,    /* [num_rows] */
    const int* __restrict__ cu_num_rows,       /* [num_reqs + 1] */
    int* __restrict__ row_greedy, int* __restrict__ row_sampled, int* __restrict__ row_pass,
    int* __restrict__ counters,                /* [num_reqs], zero; left zero */
    int* __restrict__ token_ids,               /* [num_reqs, max_rows] */
    int* __restrict__ num_accepted,            /* [num_reqs] */
    const unsigned* __restrict__ bitmask,      /* [num_rows, num_words] grammar masks, or null */
    const int* __restrict__ masked_rows,       /* [num_rows] nonzero: the row's mask applies; or null */
    float* __restrict__ chunk_vals,            /* [num_rows, 2, gridDim.y, 256] with several chunks */
    int* __restrict__ chunk_idx,               /* [num_rows, 2, gridDim.y] */
    int* __restrict__ row_counters,            /* [num_rows], zero; left zero */
    int vocab, int num_words, int max_rows, int strategy, int policy, int chunk_len, int split_sampled)
{
    __shared__ float hist[256];
    __shared__ float scratch[32];
    __shared__ int scratch_i[32];
    __shared__ float above_s;
    __shared__ int is_last;
    const int r = blockIdx.x;
    const float* row = logits + (long long)r * vocab;
    const float t = temperature[r];
    const int draft = draft_ids[r];
    const unsigned* mask = masked_rows != nullptr && masked_rows[r] ? bitmask + (long long)r * num_words : nullptr;
    /* the row's chunks: each block takes chunk_len logits (a multiple of 128: whole mask words) */
    const int chunks = t > 0.f && !split_sampled ? 1 : gridDim.y;
    if ((int)blockIdx.y >= chunks) return;
    const int begin = chunks == 1 ? 0 : blockIdx.y * chunk_len;
    const int len = chunks == 1 ? vocab : max(0, min(vocab - begin, chunk_len));
    const float* part = row + begin;
    const unsigned* part_mask = mask != nullptr ? mask + begin / 32 : nullptr;
    __shared__ RowSplit split;  /* in shared memory: the passes' helpers take it by reference */
    if (threadIdx.x == 0)
        split = RowSplit{chunks, (int)blockIdx.y, 0, row_counters + r,
                         chunk_vals + (long long)r * 2 * gridDim.y * 256, chunk_idx + (long long)r * 2 * gridDim.y};
    __syncthreads();

    /* pass 1: argmax of the logits (greedy id). A split greedy row: the last block to finish merges
       the chunks' argmaxes and carries on alone; a split sampled row: every block merges them. */
    float best = NEG_INF; int best_i = 0x7fffffff;
    scan_row(part, part_mask, len, [&](float x, int i) { better(best, best_i, x, begin + i); });
    block_argmax(best, best_i, scratch, scratch_i);
    if (t > 0.f) {
        merge_argmax(split, best, best_i, scratch, scratch_i);
    } else if (chunks > 1) {
        if (threadIdx.x == 0) {
            split.vals[blockIdx.y * 256] = best;
            split.idx[blockIdx.y] = best_i;
            __threadfence();
            is_last = atomicAdd(&row_counters[r], 1) == chunks - 1;
        }
        __syncthreads();
        if (!is_last) return;
        __threadfence();
        best = NEG_INF; best_i = 0x7fffffff;
        for (int c = threadIdx.x; c < chunks; c += THREADS)
            better(best, best_i, __ldcg(split.vals + c * 256), __ldcg(split.idx + c));
        block_argmax(best, best_i, scratch, scratch_i);
        if (threadIdx.x == 0) row_counters[r] = 0;
    }
    const int greedy_id = best_i;
    int sampled_id = greedy_id;
    bool pass = draft >= 0 && draft == greedy_id;

    if (t > 0.f) {
        /* max(l / t) = max(l) / t exactly: division by t > 0 is monotone */
        const float m = best / t;
        float z = 0.f;
        scan_row(part, part_mask, len, [&](float x, int) { z += expf(x / t - m); });
        z = merge_sum(split, block_sum(z, scratch), scratch);
        /* candidates: bits(q) >= lower */
        unsigned lower = 1u;  /* q > 0 */
        const float mp = min_p[r];
        if (mp > 0.f) lower = max(lower, __float_as_uint(mp * (1.f / z)));
        const int k = top_k[r];
        if (k > 0 && k < vocab)
            lower = radix_select<true>(part, part_mask, len, t, m, z, lower, (float)k, hist, &above_s, split);
        const float tp = top_p[r];
        if (tp < 1.f) {
            const float s2 = kept_sum(part, part_mask, len, t, m, z, lower, scratch, split);
            lower = radix_select<false>(part, part_mask, len, t, m, z, lower, tp * s2, hist, &above_s, split);
        }
        const float total = kept_sum(part, part_mask, len, t, m, z, lower, scratch, split);
        /* sample: argmax over kept tokens of (q / total) / e, e = -log(u) keyed by (seed, position, column) */
        const unsigned long long key = splitmix64((unsigned long long)seeds[r] ^
            splitmix64((unsigned long long)positions[r] * 4ull + STREAM_TARGET));
        float sbest = NEG_INF; int sbest_i = 0x7fffffff;
        scan_row(part, part_mask, len, [&](float x, int j) {
            const int i = begin + j;
            const float q = expf(x / t - m) / z;
            if (__float_as_uint(q) < lower) return;
            const float p = q / total;
            const unsigned long long bits = splitmix64(key + (unsigned long long)i * GOLDEN);
            const unsigned long long mant = bits >> 11;
            /* cheap estimate first: -log(u) = -log1p(-(1 - u)), 1 - u exact from the integer */
            const float one_minus_u = ((float)((1ull << 53) - 1ull - mant) + 0.5f) * 1.1102230246251565e-16f;
            const float e_est = -log1pf(-one_minus_u);
            const float est = p / e_est;
            if (!(est >= sbest * 0.9999f) && sbest != NEG_INF) return;
            const double u = ((double)mant + 0.5) * 1.1102230246251565e-16;
            const float e = (float)(-log(u));
            better(sbest, sbest_i, p / e, i);
        });
        block_argmax(sbest, sbest_i, scratch, scratch_i);
        merge_argmax(split, sbest, sbest_i, scratch, scratch_i);
        row_leave(split);
        if (blockIdx.y > 0) return;   /* the row's first block carries on alone */
        sampled_id = sbest_i;
        if (strategy == S_TOPP) {
            bool kept = false;
            if (draft >= 0) {
                const float q = prob(row, mask, draft, t, m, z);
                kept = __float_as_uint(q) >= lower && q / total > 0.f;
            }
            pass = kept;
        } else if (strategy != S_GREEDY) {
            pass = draft >= 0 && draft == sampled_id;
        }
    }
    if (policy == P_ACCEPT_ALL) pass = draft >= 0;
    if (policy == P_REJECT_ALL) pass = false;

    if (threadIdx.x == 0) {
        row_greedy[r] = greedy_id;
        row_sampled[r] = sampled_id;
        row_pass[r] = pass ? 1 : 0;
        __threadfence();
        const int req = request_of_row[r];
        const int n = cu_num_rows[req + 1] - cu_num_rows[req];
        is_last = atomicAdd(&counters[req], 1) == n - 1;
    }
    __syncthreads();
    if (!is_last || threadIdx.x != 0) return;
    __threadfence();
    const int req = request_of_row[r];
    const int start = cu_num_rows[req], end = cu_num_rows[req + 1];
    const bool greedy_req = temperature[start] == 0.f;
    const volatile int* vpass = row_pass;
    const volatile int* vgreedy = row_greedy;
    const volatile int* vsampled = row_sampled;
    int n = 0;
    while (start + n < end - 1 && vpass[start + n]) ++n;
    int* out = token_ids + (long long)req * max_rows;
    for (int j = 0; j < n; ++j) out[j] = draft_ids[start + j];
    out[n] = greedy_req ? vgreedy[start + n] : vsampled[start + n];
    for (int j = n + 1; j < max_rows; ++j) out[j] = -1;
    num_accepted[req] = n;
    counters[req] = 0;
}
"""

NOISE_SOURCE = (
    SOURCE.split("/* Block-wide")[0]
    + r"""
/* The noise the sampler uses, materialised (for tests): uniforms [num_rows] and Exp(1) [num_rows, vocab]. */
extern "C" __global__ void sampling_noise(const long long* __restrict__ seeds, const long long* __restrict__ positions,
                                          int stream, int vocab, float* __restrict__ uniforms,
                                          float* __restrict__ exponentials)
{
    const int r = blockIdx.y;
    const unsigned long long key = splitmix64((unsigned long long)seeds[r] ^
        splitmix64((unsigned long long)positions[r] * 4ull + (unsigned long long)stream));
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i == 0) uniforms[r] = (float)(((double)(splitmix64(key) >> 11) + 0.5) * 1.1102230246251565e-16);
    if (i >= vocab) return;
    const unsigned long long bits = splitmix64(key + (unsigned long long)i * GOLDEN);
    exponentials[(long long)r * vocab + i] = (float)(-log(((double)(bits >> 11) + 0.5) * 1.1102230246251565e-16));
}
"""
)


def sampling_noise_cuda(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, stream: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(uniforms [num_rows], exponentials [num_rows, vocab_size]) as computed inside the kernel;
    the twins of `uniform_ref` and `exponential_noise_ref`."""
    device = seeds.device
    _cuda.check_cuda_tensor("seeds", seeds, [torch.int64], 1, device)
    _cuda.check_cuda_tensor("positions", positions, [torch.int64], 1, device)
    num_rows = seeds.shape[0]
    uniforms = torch.empty(num_rows, dtype=torch.float32, device=device)
    exponentials = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device)
    if num_rows:
        kernel = _cuda.function(NOISE_SOURCE, "sampling_noise", device)
        _cuda.launch(
            kernel,
            (-(-vocab_size // 256), num_rows),
            (256,),
            (
                seeds.contiguous(),
                positions.contiguous(),
                np.int32(stream),
                np.int32(vocab_size),
                uniforms,
                exponentials,
            ),
            device,
        )
    return uniforms, exponentials


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def scratch_counters(num_reqs: int, device: torch.device) -> torch.Tensor:
    """The per-request counters a launch for `num_reqs` requests on `device` uses (zero between
    launches: the kernel leaves them zero). A launch for more requests than they hold replaces them
    with a larger tensor, so a CUDA graph that captured a launch must hold this one, which its
    replays point at, for as long as it lives."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < num_reqs:
        counters = torch.zeros(max(num_reqs, 1024), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


def split_chunks(num_rows: int, vocab: int, num_sms: int) -> tuple[int, int]:
    """(blocks per row, logits per block) of a launch: a row split over about num_sms / num_rows
    blocks of at least MIN_CHUNK logits (a multiple of 128: whole mask words, 16-byte loads); one
    block per row when SPECMESH_VERIFY_SPLIT is `off`. The grid never exceeds num_sms blocks: one
    512-thread block fits any SM, so every block of the launch is resident at once, which the
    barriers among a sampled row's blocks need (a process limited to fewer SMs than the device has,
    as under MPS with an active thread percentage, would break that: set SPECMESH_VERIFY_SPLIT=greedy)."""
    if os.environ.get(SPLIT_ENV, "").lower() == "off":
        return 1, vocab
    min_chunk = int(os.environ.get(MIN_CHUNK_ENV, MIN_CHUNK))
    chunks = max(1, min(num_sms // max(num_rows, 1), vocab // max(min_chunk, 1)))
    per_chunk = -(-vocab // chunks)
    chunk_len = -(-per_chunk // 128) * 128 if chunks > 1 else vocab
    return -(-vocab // chunk_len), chunk_len


def split_sampled_rows() -> bool:
    """Whether sampled rows split like greedy ones (SPECMESH_VERIFY_SPLIT neither `off` nor `greedy`)."""
    return os.environ.get(SPLIT_ENV, "").lower() not in ("off", "greedy")


class _ChunkScratch:
    """Per-device parts of split rows ([num_rows, 2, chunks, 256] floats, [num_rows, 2, chunks]
    indices) and the rows' arrival counters (zero between launches: the kernel leaves them zero).
    Grows outside a CUDA graph capture only, keeping the buffers a captured graph points at alive."""

    def __init__(self) -> None:
        self.tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.retired: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def get(
        self, entries: int, num_rows: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        if (
            self.tensors is not None
            and self.tensors[1].numel() >= 2 * entries
            and self.tensors[2].numel() >= num_rows
        ):
            return self.tensors
        if torch.cuda.is_current_stream_capturing():
            return None
        if self.tensors is not None:
            self.retired.append(self.tensors)
        size, rows = max(entries, 256), max(num_rows, 1024)
        self.tensors = (
            torch.empty(size * 2 * 256, dtype=torch.float32, device=device),
            torch.empty(size * 2, dtype=torch.int32, device=device),
            torch.zeros(rows, dtype=torch.int32, device=device),
        )
        return self.tensors


_CHUNK_SCRATCH: dict[torch.device, _ChunkScratch] = {}


def verify_sample_cuda(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32
    temperature: torch.Tensor,  # [num_rows] float32
    top_k: torch.Tensor,  # [num_rows] int32
    top_p: torch.Tensor,  # [num_rows] float32
    min_p: torch.Tensor,  # [num_rows] float32
    seeds: torch.Tensor,  # [num_rows] int64
    positions: torch.Tensor,  # [num_rows] int64
    draft_ids: torch.Tensor,  # [num_rows] int32
    cu_num_rows: torch.Tensor,  # [num_reqs + 1] int32
    strategy: int,
    policy: int = NORMAL,
    max_rows: int | None = None,
    request_of_row: torch.Tensor | None = None,  # [num_rows] int32
    bitmask: torch.Tensor | None = None,  # [num_rows, num_words] int32
    masked_rows: torch.Tensor | None = None,  # [num_rows] int32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `verify_sample_ref`. `max_rows` (the most rows of one request) and
    `request_of_row` may be given to skip a host read of `cu_num_rows`."""
    device = logits.device
    _cuda.check_cuda_tensor("logits", logits, [torch.float32], 2, device)
    _cuda.check(logits.is_contiguous(), "logits must be contiguous")
    num_rows, vocab = logits.shape
    for name, t, dtype in (
        ("temperature", temperature, torch.float32),
        ("top_k", top_k, torch.int32),
        ("top_p", top_p, torch.float32),
        ("min_p", min_p, torch.float32),
        ("seeds", seeds, torch.int64),
        ("positions", positions, torch.int64),
        ("draft_ids", draft_ids, torch.int32),
    ):
        _cuda.check_cuda_tensor(name, t, [dtype], 1, device)
        _cuda.check(t.shape[0] == num_rows and t.is_contiguous(), f"{name} must be contiguous [num_rows]")
    _check_masks(bitmask, masked_rows, num_rows, vocab, device)
    _cuda.check_cuda_tensor("cu_num_rows", cu_num_rows, [torch.int32], 1, device)
    num_reqs = cu_num_rows.shape[0] - 1
    if max_rows is None or request_of_row is None:
        counts = cu_num_rows.diff().cpu()
        max_rows = int(counts.max()) if num_reqs else 1
        request_of_row = torch.repeat_interleave(torch.arange(num_reqs, dtype=torch.int32), counts.long()).to(
            device
        )
    _cuda.check(
        request_of_row.dtype == torch.int32 and request_of_row.shape == (num_rows,),
        "request_of_row must be int32 [num_rows]",
    )
    row_greedy = torch.empty(num_rows, dtype=torch.int32, device=device)
    row_sampled = torch.empty_like(row_greedy)
    row_pass = torch.empty_like(row_greedy)
    token_ids = torch.empty(num_reqs, max_rows, dtype=torch.int32, device=device)
    num_accepted = torch.empty(num_reqs, dtype=torch.int32, device=device)
    if num_rows == 0:
        return token_ids, num_accepted, row_greedy, row_sampled, row_pass
    kernel = _cuda.function(SOURCE, "verify_sample", device, THREADS=THREADS)
    chunks, chunk_len = split_chunks(num_rows, vocab, _cuda.num_sms(device.index or 0))
    scratch = _CHUNK_SCRATCH.setdefault(device, _ChunkScratch()).get(num_rows * chunks, num_rows, device)
    if scratch is None or chunks == 1:  # a capture that would need larger buffers: unsplit
        chunks, chunk_len = 1, vocab
    chunk_vals, chunk_idx, row_counters = scratch if scratch is not None else (None, None, None)
    i32 = np.int32
    _cuda.launch(
        kernel,
        (num_rows, chunks),
        (THREADS,),
        (
            logits,
            temperature,
            top_k,
            top_p,
            min_p,
            seeds,
            positions,
            draft_ids,
            request_of_row,
            cu_num_rows,
            row_greedy,
            row_sampled,
            row_pass,
            scratch_counters(num_reqs, device),
            token_ids,
            num_accepted,
            bitmask,
            masked_rows,
            chunk_vals,
            chunk_idx,
            row_counters,
            i32(vocab),
            i32(num_mask_words(vocab)),
            i32(max_rows),
            i32(strategy),
            i32(policy),
            i32(chunk_len),
            i32(split_sampled_rows()),
        ),
        device,
    )
    return token_ids, num_accepted, row_greedy, row_sampled, row_pass


def _check_masks(
    bitmask: torch.Tensor | None,
    masked_rows: torch.Tensor | None,
    num_rows: int,
    vocab: int,
    device: torch.device,
) -> None:
    _cuda.check(
        (bitmask is None) == (masked_rows is None), "bitmask and masked_rows go together: both or neither"
    )
    if bitmask is None or masked_rows is None:
        return
    num_words = num_mask_words(vocab)
    _cuda.check_cuda_tensor("bitmask", bitmask, [torch.int32], 2, device)
    _cuda.check(
        bitmask.shape == (num_rows, num_words) and bitmask.is_contiguous(),
        f"bitmask must be contiguous int32 [{num_rows}, {num_words}] (num_rows, ceil(vocab_size / 32))",
    )
    _cuda.check_cuda_tensor("masked_rows", masked_rows, [torch.int32], 1, device)
    _cuda.check(
        masked_rows.shape == (num_rows,) and masked_rows.is_contiguous(),
        "masked_rows must be contiguous [num_rows]",
    )
