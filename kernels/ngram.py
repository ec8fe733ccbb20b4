"""CUDA batched n-gram match over token histories (one launch); twin of `ngram_match_ref`.

One thread block per request scans every end position `e` of the history in parallel and measures
how many tokens ending at `e` equal the history's suffix (capped at max_n); the block keeps the
largest (match length, e) pair, which is exactly "longest n first, then the most recent match".
The last block to finish (an atomic counter) grants drafts in request order under the step's token
budget, so the whole batch needs one launch. The histories are the engine's token rows
(services/engine/input_batch.py), which the post-step kernel appends to on the device.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels import _cuda

THREADS = 512
MAX_NGRAM = 32

SOURCE = r"""
extern "C" __global__ void __launch_bounds__(THREADS) ngram_match(
    const int* __restrict__ history,   /* [num_rows, row_stride] */
    long long row_stride,
    const long long* __restrict__ row_ids,  /* [num_reqs] history row of each request; null: row b */
    const int* __restrict__ lengths,   /* [num_reqs] */
    const int* __restrict__ ks,        /* [num_reqs] */
    int num_reqs, int min_n, int max_n, int max_k, int budget,
    int* __restrict__ drafts,          /* [num_reqs, max_k] */
    int* __restrict__ num_drafts,      /* [num_reqs] */
    int* __restrict__ counter)         /* [1], zero; left zero */
{
    __shared__ int suffix[MAX_NGRAM];
    __shared__ unsigned long long warp_best[THREADS / 32];
    __shared__ int is_last;
    const int b = blockIdx.x;
    const int len = lengths[b];
    const int k = min(ks[b], max_k);
    const int* tokens = history + (row_ids ? row_ids[b] : (long long)b) * row_stride;
    const bool active = k > 0 && len >= min_n + 1;
    if (active && threadIdx.x < max_n && threadIdx.x < len) suffix[threadIdx.x] = tokens[len - 1 - threadIdx.x];
    __syncthreads();
    unsigned long long best = 0ull;   /* (match length << 32) | (end + 1) */
    if (active) {
        for (int e = threadIdx.x; e <= len - 2; e += THREADS) {
            int ml = 0;
            while (ml < max_n && ml <= e && tokens[e - ml] == suffix[ml]) ++ml;
            if (ml >= min_n) {
                const unsigned long long key = ((unsigned long long)ml << 32) | (unsigned)(e + 1);
                best = key > best ? key : best;
            }
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, o);
        best = other > best ? other : best;
    }
    if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x >> 5] = best;
    __syncthreads();
    if (threadIdx.x < 32) {
        best = threadIdx.x < THREADS / 32 ? warp_best[threadIdx.x] : 0ull;
        for (int o = 16; o > 0; o >>= 1) {
            const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, o);
            best = other > best ? other : best;
        }
        if (threadIdx.x == 0) warp_best[0] = best;
    }
    __syncthreads();
    best = warp_best[0];
    int count = 0, follow = 0;
    if (best != 0ull) {
        follow = (int)(best & 0xffffffffull);   /* end + 1 */
        count = min(k, len - follow);
    }
    for (int j = threadIdx.x; j < max_k; j += THREADS)
        drafts[(long long)b * max_k + j] = j < count ? tokens[follow + j] : -1;
    if (threadIdx.x == 0) num_drafts[b] = count;
    if (budget < 0) return;

    /* the last block grants drafts in request order under the budget */
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        is_last = atomicAdd(counter, 1) == num_reqs - 1;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    volatile int* vnum = num_drafts;
    for (int base = 0; base < num_reqs; base += THREADS) {
        const int r = base + threadIdx.x;
        int allowed = 0, mine = 0;
        if (r < num_reqs) {
            int before = 0;
            for (int j = 0; j < r; ++j) before += vnum[j];
            mine = vnum[r];
            allowed = max(0, min(mine, budget - before));
        }
        __syncthreads();
        if (r < num_reqs && allowed < mine) {
            vnum[r] = allowed;
            for (int j = allowed; j < mine; ++j) drafts[(long long)r * max_k + j] = -1;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) *counter = 0;
}
"""

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def scratch_counter(device: torch.device) -> torch.Tensor:
    """The one-element counter every launch on `device` uses to find the last block (zero between
    launches: the kernel leaves it zero). A CUDA graph that captured a launch points at it and must
    hold it for as long as it lives."""
    counter = _COUNTERS.get(device)
    if counter is None:
        counter = _COUNTERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


def ngram_match_cuda(
    history: torch.Tensor,  # [num_rows, max_len] int32 (rows may be longer than their length)
    lengths: torch.Tensor,  # [num_reqs] int32
    min_n: int,
    max_n: int,
    k: int | torch.Tensor,  # one k for all, or [num_reqs] int32
    budget: int | None = None,
    max_k: int | None = None,
    row_ids: torch.Tensor | None = None,  # [num_reqs] int64; None: request b is row b
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `ngram_match_ref`; `max_k` (the largest k) skips a host read of `k`."""
    device = history.device
    _cuda.check_cuda_tensor("history", history, [torch.int32], 2, device)
    _cuda.check(history.stride(1) == 1, "history rows must be contiguous")
    _cuda.check_cuda_tensor("lengths", lengths, [torch.int32], 1, device)
    num_reqs = history.shape[0]
    if row_ids is not None:
        _cuda.check_cuda_tensor("row_ids", row_ids, [torch.int64], 1, device)
        _cuda.check(row_ids.is_contiguous(), "row_ids must be contiguous")
        num_reqs = row_ids.shape[0]
    _cuda.check(lengths.shape[0] == num_reqs and lengths.is_contiguous(), "lengths must be [num_reqs]")
    _cuda.check(1 <= min_n <= max_n <= MAX_NGRAM, f"need 1 <= min_n <= max_n <= {MAX_NGRAM}")
    if isinstance(k, int):
        ks = torch.full((num_reqs,), k, dtype=torch.int32, device=device)
        max_k = k
    else:
        _cuda.check_cuda_tensor("k", k, [torch.int32], 1, device)
        ks = k
        max_k = int(k.max()) if max_k is None and num_reqs else (max_k or 0)
    width = max(max_k, 1)
    drafts = torch.empty(num_reqs, width, dtype=torch.int32, device=device)
    num_drafts = torch.empty(num_reqs, dtype=torch.int32, device=device)
    if num_reqs == 0:
        return drafts, num_drafts
    kernel = _cuda.function(SOURCE, "ngram_match", device, THREADS=THREADS, MAX_NGRAM=MAX_NGRAM)
    i32 = np.int32
    _cuda.launch(
        kernel,
        (num_reqs,),
        (THREADS,),
        (
            history,
            np.int64(history.stride(0)),
            np.uint64(0) if row_ids is None else row_ids,
            lengths,
            ks,
            i32(num_reqs),
            i32(min_n),
            i32(max_n),
            i32(width),
            i32(-1 if budget is None else budget),
            drafts,
            num_drafts,
            scratch_counter(device),
        ),
        device,
    )
    return drafts, num_drafts
