"""CUDA post-step update for the whole batch in one launch; twin of `post_step_update_ref`.

One thread per request walks its emitted tokens, appends them to its token row (a row of the
CUDA-graph step's token history, read by index as the n-gram kernel does) and stops at the first
EOS / stop id / max_tokens, so no token past a stop reaches the row. Requests that share a scratch
row (padding, requests without a history row) race on it harmlessly: nothing reads it.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels import _cuda

THREADS = 128

SOURCE = r"""
extern "C" __global__ void post_step_update(
    int* __restrict__ token_ids, long long row_stride, int capacity,
    const long long* __restrict__ row_ids,  /* [num_reqs] row of each request; null: row b */
    int* __restrict__ lengths, int* __restrict__ num_output,
    const int* __restrict__ new_tokens, int width, const int* __restrict__ num_new,
    const int* __restrict__ max_tokens, const int* __restrict__ min_tokens,
    const int* __restrict__ ignore_eos, const int* __restrict__ eos_ids, int max_eos,
    const int* __restrict__ stop_ids, int max_stop,
    int* __restrict__ num_kept, int* __restrict__ finish, int* __restrict__ stop_token, int num_reqs)
{
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= num_reqs) return;
    int* row = token_ids + (row_ids ? row_ids[b] : (long long)b) * row_stride;
    int length = lengths[b], produced = num_output[b], kept = 0, reason = 0, stopped_by = -1;
    const int n = min(num_new[b], width);
    for (int j = 0; j < n && length < capacity; ++j) {
        const int token = new_tokens[(long long)b * width + j];
        row[length++] = token;
        ++produced;
        ++kept;
        if (produced >= min_tokens[b]) {
            bool is_eos = false;
            if (!ignore_eos[b])
                for (int e = 0; e < max_eos; ++e) is_eos |= eos_ids[(long long)b * max_eos + e] == token;
            if (is_eos) { reason = 1; break; }
            bool is_stop = false;
            for (int s = 0; s < max_stop; ++s) is_stop |= stop_ids[(long long)b * max_stop + s] == token;
            if (is_stop) { reason = 1; stopped_by = token; break; }
        }
        if (produced >= max_tokens[b]) { reason = 2; break; }
    }
    lengths[b] = length;
    num_output[b] = produced;
    num_kept[b] = kept;
    finish[b] = reason;
    stop_token[b] = stopped_by;
}
"""


def post_step_update_cuda(
    token_ids: torch.Tensor,
    row_ids: torch.Tensor | None,
    lengths: torch.Tensor,
    num_output: torch.Tensor,
    new_tokens: torch.Tensor,
    num_new: torch.Tensor,
    max_tokens: torch.Tensor,
    min_tokens: torch.Tensor,
    ignore_eos: torch.Tensor,
    eos_ids: torch.Tensor,
    stop_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `post_step_update_ref`; no host read, so it can be captured in a CUDA graph."""
    device = token_ids.device
    _cuda.check_cuda_tensor("token_ids", token_ids, [torch.int32], 2, device)
    _cuda.check(token_ids.stride(1) == 1, "token_ids rows must be contiguous")
    num_reqs = lengths.shape[0]
    if row_ids is not None:
        _cuda.check_cuda_tensor("row_ids", row_ids, [torch.int64], 1, device)
        _cuda.check(row_ids.shape[0] == num_reqs and row_ids.is_contiguous(), "row_ids must be [num_reqs]")
    else:
        _cuda.check(token_ids.shape[0] >= num_reqs, "token_ids needs a row per request when row_ids is None")
    for name, t in (
        ("lengths", lengths),
        ("num_output", num_output),
        ("num_new", num_new),
        ("max_tokens", max_tokens),
        ("min_tokens", min_tokens),
        ("ignore_eos", ignore_eos),
    ):
        _cuda.check_cuda_tensor(name, t, [torch.int32], 1, device)
        _cuda.check(t.shape[0] == num_reqs and t.is_contiguous(), f"{name} must be contiguous [num_reqs]")
    for name, t in (("new_tokens", new_tokens), ("eos_ids", eos_ids), ("stop_ids", stop_ids)):
        _cuda.check_cuda_tensor(name, t, [torch.int32], 2, device)
        _cuda.check(t.shape[0] == num_reqs and t.is_contiguous(), f"{name} must be contiguous [num_reqs, n]")
    num_kept = torch.empty(num_reqs, dtype=torch.int32, device=device)
    finish = torch.empty_like(num_kept)
    stop_token = torch.empty_like(num_kept)
    if num_reqs == 0:
        return num_kept, finish, stop_token
    kernel = _cuda.function(SOURCE, "post_step_update", device)
    i32 = np.int32
    _cuda.launch(
        kernel,
        (-(-num_reqs // THREADS),),
        (THREADS,),
        (
            token_ids,
            np.int64(token_ids.stride(0)),
            i32(token_ids.shape[1]),
            np.uint64(0) if row_ids is None else row_ids,
            lengths,
            num_output,
            new_tokens,
            i32(new_tokens.shape[1]),
            num_new,
            max_tokens,
            min_tokens,
            ignore_eos,
            eos_ids,
            i32(eos_ids.shape[1]),
            stop_ids,
            i32(stop_ids.shape[1]),
            num_kept,
            finish,
            stop_token,
            i32(num_reqs),
        ),
        device,
    )
    return num_kept, finish, stop_token
