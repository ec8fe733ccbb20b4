"""CUDA batched n-gram match over token histories (one launch); twin of `ngram_match_ref`.

One thread block per request scans every end position `e` of the history in parallel and measures
how many tokens ending at `e` equal the history's suffix (capped at max_n); the block keeps the
largest (match length, e) pair, which is exactly "longest n first, then the most recent match".
The last block to finish (an atomic counter) grants drafts in request order under the step's token
budget, so the whole batch needs one launch.

`TokenHistory` keeps each running request's tokens in one device buffer, appending only the tokens
new since the last step (in the CUDA-graph step, the post-step kernel does the append), so the
proposer never re-sends a whole history.
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


class TokenHistory:
    """Each request's tokens (prompt + output) in a row of one device buffer; a step sends only the
    tokens new since the last one (token lists only grow while a request runs; a shorter list, as
    after a preemption that re-queued it, rewrites the row).

    `fixed`: the buffer never moves (a CUDA graph holds its address): rows are then a cache, a
    request that needs one when none is free takes the row of a request not in the current call
    (which is rewritten when that request comes back), and the last row is scratch for padding.
    The CUDA-graph step appends its kept tokens on the device (the post-step kernel: none past a
    stop) and leaves the next drafts in `precomputed`, so `propose` needs no launch for those
    requests.
    """

    def __init__(self, device: torch.device, num_rows: int = 64, capacity: int = 1024, fixed: bool = False):
        self.device = device
        self.fixed = fixed
        self.tokens = torch.zeros(num_rows, capacity, dtype=torch.int32, device=device)
        self.row_of: dict[str, int] = {}
        self.synced: list[int] = [0] * num_rows
        """Tokens of each row already on the device."""
        usable = num_rows - 1 if fixed else num_rows
        self.free = list(range(usable - 1, -1, -1))
        self.precomputed: dict[str, tuple[int, list[int]]] = {}
        """request id -> (its token count, drafts matched on the device for that many tokens)."""

    def forget(self, request_id: str) -> None:
        self.precomputed.pop(request_id, None)
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.synced[row] = 0
            self.free.append(row)

    def propose(self, requests: list[tuple[str, list[int], int]], min_n: int, max_n: int) -> list[list[int]]:
        """Drafts per request: those the graph step matched, cut to k, and the rest matched in one
        launch after syncing their rows."""
        drafts: list[list[int] | None] = []
        for request_id, token_ids, k in requests:
            ready = self.precomputed.pop(request_id, None)
            drafts.append(ready[1][: max(k, 0)] if ready is not None and ready[0] == len(token_ids) else None)
        missing = [i for i, d in enumerate(drafts) if d is None]
        if missing:
            for i, found in zip(missing, self._match([requests[i] for i in missing], min_n, max_n)):
                drafts[i] = found
        return [d or [] for d in drafts]

    def _match(self, requests: list[tuple[str, list[int], int]], min_n: int, max_n: int) -> list[list[int]]:
        rows = self.sync([(request_id, token_ids) for request_id, token_ids, _ in requests])
        lengths = [len(token_ids) for _, token_ids, _ in requests]
        ks = [max(k, 0) for _, _, k in requests]
        meta = torch.tensor(rows + lengths + ks, dtype=torch.int32).to(self.device, non_blocking=True)
        num = len(requests)
        row_ids, lengths_gpu, ks_gpu = meta[:num].long(), meta[num : 2 * num], meta[2 * num :]
        drafts, num_drafts = ngram_match_cuda(
            self.tokens, lengths_gpu, min_n, max_n, ks_gpu, max_k=max(ks), row_ids=row_ids
        )
        counts = num_drafts.cpu().tolist()
        drafts_cpu = drafts.cpu().tolist()
        return [row[:n] for row, n in zip(drafts_cpu, counts)]

    def sync(self, requests: list[tuple[str, list[int]]]) -> list[int]:
        """Appends what each request gained since the last sync; returns the requests' rows."""
        protected = {request_id for request_id, _ in requests}
        rows = [self._row(request_id, protected) for request_id, _ in requests]
        self._reserve(len(self.row_of), max(len(token_ids) for _, token_ids in requests))
        flat_rows: list[int] = []
        flat_cols: list[int] = []
        values: list[int] = []
        for row, (_, token_ids) in zip(rows, requests):
            have = self.synced[row] if self.synced[row] <= len(token_ids) else 0
            new = token_ids[have:]
            if new:
                flat_rows += [row] * len(new)
                flat_cols += range(have, len(token_ids))
                values += new
            self.synced[row] = len(token_ids)
        if values:
            index = torch.tensor([flat_rows, flat_cols], dtype=torch.long).to(self.device, non_blocking=True)
            self.tokens[index[0], index[1]] = torch.tensor(values, dtype=torch.int32).to(
                self.device, non_blocking=True
            )
        return rows

    def _row(self, request_id: str, protected: set[str]) -> int:
        row = self.row_of.get(request_id)
        if row is None:
            if not self.free:
                if self.fixed:
                    self.forget(next(r for r in self.row_of if r not in protected))
                else:
                    self._reserve(len(self.row_of) * 2, 0)
            row = self.free.pop()
            self.row_of[request_id] = row
            self.synced[row] = 0
        return row

    def _reserve(self, num_rows: int, capacity: int) -> None:
        """Grows the buffer (doubling) to at least `num_rows` rows of `capacity` tokens."""
        old_rows, old_capacity = self.tokens.shape
        rows = old_rows if num_rows <= old_rows else max(num_rows, 2 * old_rows)
        cols = old_capacity if capacity <= old_capacity else max(capacity, 2 * old_capacity)
        if (rows, cols) == (old_rows, old_capacity):
            return
        if self.fixed:
            raise ValueError(
                f"token history of {old_rows} rows x {old_capacity} tokens cannot grow to {rows} x {cols}"
            )
        grown = torch.zeros(rows, cols, dtype=torch.int32, device=self.device)
        grown[:old_rows, :old_capacity] = self.tokens
        self.tokens = grown
        self.synced += [0] * (rows - old_rows)
        self.free = list(range(rows - 1, old_rows - 1, -1)) + self.free
