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
/* Appends one request's emitted tokens to its row until one ends it (the reference's rules);
   eos / stop ids are read `id_stride` elements apart. */
__device__ __forceinline__ void append_until_stop(
    int* row, int capacity, int& length, int& produced, const int* tokens, int n, int max_tokens,
    int min_tokens, int ignore_eos, const int* eos_ids, int max_eos, long long eos_stride,
    const int* stop_ids, int max_stop, long long stop_stride, int& kept, int& reason, int& stopped_by)
{
    kept = 0; reason = 0; stopped_by = -1;
    for (int j = 0; j < n && length < capacity; ++j) {
        const int token = tokens[j];
        row[length++] = token;
        ++produced;
        ++kept;
        if (produced >= min_tokens) {
            bool is_eos = false;
            if (!ignore_eos)
                for (int e = 0; e < max_eos; ++e) is_eos |= eos_ids[e * eos_stride] == token;
            if (is_eos) { reason = 1; break; }
            bool is_stop = false;
            for (int s = 0; s < max_stop; ++s) is_stop |= stop_ids[s * stop_stride] == token;
            if (is_stop) { reason = 1; stopped_by = token; break; }
        }
        if (produced >= max_tokens) { reason = 2; break; }
    }
}

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
    int length = lengths[b], produced = num_output[b], kept, reason, stopped_by;
    append_until_stop(row, capacity, length, produced, new_tokens + (long long)b * width, min(num_new[b], width),
                      max_tokens[b], min_tokens[b], ignore_eos[b], eos_ids + (long long)b * max_eos, max_eos, 1,
                      stop_ids + (long long)b * max_stop, max_stop, 1, kept, reason, stopped_by);
    lengths[b] = length;
    num_output[b] = produced;
    num_kept[b] = kept;
    finish[b] = reason;
    stop_token[b] = stopped_by;
}

/* The same with every per-request input read at the request's slot of the per-slot tensors and
   the lengths written back there (post_step_update_slots_ref); num_new = num_accepted + 1. */
extern "C" __global__ void post_step_update_slots(
    int* __restrict__ token_rows, long long row_stride, int capacity,
    const long long* __restrict__ slots,    /* [num_reqs] */
    int* __restrict__ num_tokens, int* __restrict__ slot_output,   /* [num_slots], updated */
    const int* __restrict__ new_tokens, int width, const int* __restrict__ num_accepted,
    const int* __restrict__ max_tokens, const int* __restrict__ min_tokens,
    const int* __restrict__ ignore_eos,     /* [num_slots] each */
    const int* __restrict__ eos_ids, int max_eos, long long eos_slot_stride, long long eos_stride,
    const int* __restrict__ stop_ids, int max_stop, long long stop_slot_stride, long long stop_stride,
    int* __restrict__ num_kept, int* __restrict__ finish, int* __restrict__ stop_token,
    int* __restrict__ num_output, int num_reqs)
{
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= num_reqs) return;
    const long long slot = slots[b];
    int length = num_tokens[slot], produced = slot_output[slot], kept, reason, stopped_by;
    append_until_stop(token_rows + slot * row_stride, capacity, length, produced, new_tokens + (long long)b * width,
                      min(num_accepted[b] + 1, width), max_tokens[slot], min_tokens[slot], ignore_eos[slot],
                      eos_ids + slot * eos_slot_stride, max_eos, eos_stride,
                      stop_ids + slot * stop_slot_stride, max_stop, stop_stride, kept, reason, stopped_by);
    num_tokens[slot] = length;
    slot_output[slot] = produced;
    num_kept[b] = kept;
    finish[b] = reason;
    stop_token[b] = stopped_by;
    num_output[b] = produced;
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


def post_step_update_slots_cuda(
    token_rows: torch.Tensor,
    slots: torch.Tensor,
    num_tokens: torch.Tensor,
    num_output: torch.Tensor,
    new_tokens: torch.Tensor,
    num_accepted: torch.Tensor,
    max_tokens: torch.Tensor,
    min_tokens: torch.Tensor,
    ignore_eos: torch.Tensor,
    eos_ids: torch.Tensor,
    stop_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `post_step_update_slots_ref`: one launch where the tail gathered, added and
    scattered around `post_step_update`; no host read, so it can be captured in a CUDA graph."""
    device = token_rows.device
    _cuda.check_cuda_tensor("token_rows", token_rows, [torch.int32], 2, device)
    _cuda.check(token_rows.stride(1) == 1, "token_rows rows must be contiguous")
    num_slots, num_reqs = token_rows.shape[0], slots.shape[0]
    new_tokens, num_accepted = new_tokens.int().contiguous(), num_accepted.int().contiguous()
    _cuda.check_cuda_tensor("slots", slots, [torch.int64], 1, device)
    _cuda.check(slots.is_contiguous(), "slots must be contiguous")
    for name, t in (
        ("num_tokens", num_tokens),
        ("num_output", num_output),
        ("max_tokens", max_tokens),
        ("min_tokens", min_tokens),
        ("ignore_eos", ignore_eos),
    ):
        _cuda.check_cuda_tensor(name, t, [torch.int32], 1, device)
        _cuda.check(t.shape[0] >= num_slots and t.stride(0) == 1, f"{name} must be contiguous [num_slots]")
    for name, t in (("eos_ids", eos_ids), ("stop_ids", stop_ids)):
        _cuda.check_cuda_tensor(name, t, [torch.int32], 2, device)
        _cuda.check(t.shape[0] >= num_slots, f"{name} must be [num_slots, n]")
    _cuda.check_cuda_tensor("new_tokens", new_tokens, [torch.int32], 2, device)
    _cuda.check(
        new_tokens.shape[0] == num_reqs and new_tokens.is_contiguous(), "new_tokens: [num_reqs, width]"
    )
    _cuda.check_cuda_tensor("num_accepted", num_accepted, [torch.int32], 1, device)
    _cuda.check(
        num_accepted.shape[0] == num_reqs and num_accepted.is_contiguous(), "num_accepted: [num_reqs]"
    )
    outputs = torch.empty(4, num_reqs, dtype=torch.int32, device=device)
    num_kept, finish, stop_token, produced = outputs.unbind(0)
    if num_reqs == 0:
        return num_kept, finish, stop_token, produced
    kernel = _cuda.function(SOURCE, "post_step_update_slots", device)
    i32, i64 = np.int32, np.int64
    _cuda.launch(
        kernel,
        (-(-num_reqs // THREADS),),
        (THREADS,),
        (
            token_rows,
            i64(token_rows.stride(0)),
            i32(token_rows.shape[1]),
            slots,
            num_tokens,
            num_output,
            new_tokens,
            i32(new_tokens.shape[1]),
            num_accepted,
            max_tokens,
            min_tokens,
            ignore_eos,
            eos_ids,
            i32(eos_ids.shape[1]),
            i64(eos_ids.stride(0)),
            i64(eos_ids.stride(1)),
            stop_ids,
            i32(stop_ids.shape[1]),
            i64(stop_ids.stride(0)),
            i64(stop_ids.stride(1)),
            num_kept,
            finish,
            stop_token,
            produced,
            i32(num_reqs),
        ),
        device,
    )
    return num_kept, finish, stop_token, produced
