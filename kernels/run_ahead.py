"""CUDA completion of a step launched ahead (one launch); twin of `fill_ahead_ref`.

One thread per token reads its request's slot (token row, length, output count, drafts) and writes
the token's input id, position, KV slot, row position and checked draft; the request's first token
also writes its context length. Where the step verifies draft trees the thread also walks its node's
ancestors through the slot's draft parents (at most MAX_TREE_NODES of them) for its depth, its tree
mask and its entry of the request's parent array. How many tokens to complete can be read on the device
(`num_filled`), so a CUDA graph captured over a padded bucket completes whatever step is copied in,
and a step the host described whole (0) is left as it is.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels import _cuda
from kernels.attention_ref import MAX_TREE_NODES
from kernels.run_ahead_ref import NO_DRAFT, PLACEHOLDER_TOKEN_ID, SlotState, capacity

THREADS = 128

SOURCE = r"""
extern "C" __global__ void fill_ahead(
    const int* __restrict__ num_filled,         /* [1] tokens to complete; null: num_tokens */
    int num_tokens,
    const long long* __restrict__ token_slots,  /* [num_tokens] */
    const int* __restrict__ request_of_token,   /* [num_tokens] */
    const int* __restrict__ query_start_loc,    /* [num_seqs + 1] */
    const int* __restrict__ block_tables, long long table_stride, int max_blocks, int block_size,
    const int* __restrict__ token_rows, long long row_stride,
    const int* __restrict__ row_lengths, const int* __restrict__ num_output,
    const int* __restrict__ drafts, long long drafts_stride, const int* __restrict__ num_drafts,
    const int* __restrict__ draft_parents, long long parents_stride,  /* read where tree_mask */
    long long* __restrict__ input_ids, long long* __restrict__ positions,
    long long* __restrict__ slot_mapping, int* __restrict__ seq_lens,
    long long* __restrict__ row_positions, int* __restrict__ draft_ids,
    long long* __restrict__ tree_mask,     /* [num_tokens]; null: no trees */
    long long* __restrict__ tree_parents,  /* [num_seqs, tree_width]; null: not written */
    long long tree_parents_stride, int tree_width)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int n = num_filled ? min(num_filled[0], num_tokens) : num_tokens;
    if (i >= n) return;
    const long long slot = token_slots[i];
    const int request = request_of_token[i];
    const int first = query_start_loc[request];
    const int query_len = query_start_loc[request + 1] - first;
    const int offset = i - first;
    const long long newest = (long long)row_lengths[slot] - 1;
    const long long position = newest + offset;  /* of the token's KV */
    const int found = min(num_drafts[slot], query_len - 1);
    const int* slot_drafts = drafts + slot * drafts_stride;
    long long depth = offset;
    if (tree_mask) {
        const int* slot_parents = draft_parents + slot * parents_stride;
        long long mask = 1;  /* the root */
        int node = offset;
        depth = 0;
        while (node > 0) {
            if (node < MAX_TREE_NODES) mask |= (long long)(1ULL << node);
            const int parent = node <= found ? slot_parents[node - 1] : node - 1;
            node = min(max(parent, 0), node - 1);
            ++depth;
        }
        tree_mask[i] = mask;
        if (tree_parents && offset < tree_width) {
            const int parent = offset <= found ? slot_parents[offset > 0 ? offset - 1 : 0] : offset - 1;
            tree_parents[request * tree_parents_stride + offset] = offset == 0 ? -1 : min(max(parent, 0), offset - 1);
        }
    }
    long long id = PLACEHOLDER_TOKEN_ID;
    if (offset == 0) id = token_rows[slot * row_stride + (newest > 0 ? newest : 0)];
    else if (offset <= found) id = slot_drafts[offset - 1];
    input_ids[i] = id;
    positions[i] = newest + depth;
    const long long block = position / block_size;
    slot_mapping[i] = position >= 0 && block < max_blocks
        ? (long long)block_tables[request * table_stride + block] * block_size + position % block_size
        : -1;
    row_positions[i] = (long long)num_output[slot] + depth;
    draft_ids[i] = offset < found ? slot_drafts[offset] : NO_DRAFT;
    if (offset == 0) seq_lens[request] = (int)(position + query_len);
}
"""


DEFINES = {
    "PLACEHOLDER_TOKEN_ID": PLACEHOLDER_TOKEN_ID,
    "NO_DRAFT": NO_DRAFT,
    "MAX_TREE_NODES": MAX_TREE_NODES,
}
"""The -D macros the kernel is compiled with."""


def fill_ahead_cuda(
    num_filled: torch.Tensor | None,
    token_slots: torch.Tensor,
    request_of_token: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_tables: torch.Tensor,
    slots: SlotState,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    row_positions: torch.Tensor,
    draft_ids: torch.Tensor,
    block_size: int,
    tree_mask: torch.Tensor | None = None,
    tree_parents: torch.Tensor | None = None,
) -> None:
    """Same contract as `fill_ahead_ref`; no host read, so it can be captured in a CUDA graph."""
    device = input_ids.device
    num_tokens = capacity(input_ids, request_of_token, row_positions, draft_ids)
    _check_step(num_filled, token_slots, request_of_token, query_start_loc, block_tables, device, num_tokens)
    _check_slots(slots, device)
    for name, t, dtype in (
        ("input_ids", input_ids, torch.int64),
        ("positions", positions, torch.int64),
        ("slot_mapping", slot_mapping, torch.int64),
        ("row_positions", row_positions, torch.int64),
        ("draft_ids", draft_ids, torch.int32),
    ):
        _cuda.check_cuda_tensor(name, t, [dtype], 1, device)
        _cuda.check(
            t.is_contiguous() and t.shape[0] >= num_tokens, f"{name} must be contiguous [>= num_tokens]"
        )
    _cuda.check_cuda_tensor("seq_lens", seq_lens, [torch.int32], 1, device)
    _cuda.check(
        seq_lens.is_contiguous() and seq_lens.shape[0] == block_tables.shape[0],
        "seq_lens must be contiguous [num_seqs]",
    )
    _check_trees(tree_mask, tree_parents, slots, device, num_tokens)
    if num_tokens == 0:
        return
    grid, args = launch_arguments(
        num_filled,
        token_slots,
        request_of_token,
        query_start_loc,
        block_tables,
        slots,
        input_ids,
        positions,
        slot_mapping,
        seq_lens,
        row_positions,
        draft_ids,
        block_size,
        tree_mask,
        tree_parents,
    )
    kernel = _cuda.function(SOURCE, "fill_ahead", device, **DEFINES)
    _cuda.launch(kernel, grid, (THREADS,), args, device)


def launch_arguments(
    num_filled: torch.Tensor | None,
    token_slots: torch.Tensor,
    request_of_token: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_tables: torch.Tensor,
    slots: SlotState,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    row_positions: torch.Tensor,
    draft_ids: torch.Tensor,
    block_size: int,
    tree_mask: torch.Tensor | None = None,
    tree_parents: torch.Tensor | None = None,
) -> tuple[tuple[int], tuple]:
    """(grid, the kernel's arguments) of checked inputs: one thread per token the step can hold."""
    num_tokens = capacity(input_ids, request_of_token, row_positions, draft_ids)
    i32, i64 = np.int32, np.int64
    args = (
        num_filled,
        i32(num_tokens),
        token_slots,
        request_of_token,
        query_start_loc,
        block_tables,
        i64(block_tables.stride(0)),
        i32(block_tables.shape[1]),
        i32(block_size),
        slots.token_rows,
        i64(slots.token_rows.stride(0)),
        slots.num_tokens,
        slots.num_output,
        slots.drafts,
        i64(slots.drafts.stride(0)),
        slots.num_drafts,
        slots.draft_parents if tree_mask is not None else None,
        i64(slots.draft_parents.stride(0) if tree_mask is not None else 0),
        input_ids,
        positions,
        slot_mapping,
        seq_lens,
        row_positions,
        draft_ids,
        tree_mask,
        tree_parents,
        i64(tree_parents.stride(0) if tree_parents is not None else 0),
        i32(tree_parents.shape[1] if tree_parents is not None else 0),
    )
    return (-(-num_tokens // THREADS),), args


def _check_step(
    num_filled: torch.Tensor | None,
    token_slots: torch.Tensor,
    request_of_token: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_tables: torch.Tensor,
    device: torch.device,
    num_tokens: int,
) -> None:
    """The step's tensors the kernel reads."""
    if num_filled is not None:
        _cuda.check_cuda_tensor("num_filled", num_filled, [torch.int32], 1, device)
        _cuda.check(num_filled.shape[0] >= 1, "num_filled must hold one count")
    _cuda.check_cuda_tensor("token_slots", token_slots, [torch.int64], 1, device)
    _cuda.check(
        token_slots.is_contiguous() and token_slots.shape[0] >= num_tokens,
        "token_slots must be contiguous [>= num_tokens]",
    )
    _cuda.check_cuda_tensor("request_of_token", request_of_token, [torch.int32], 1, device)
    _cuda.check(request_of_token.is_contiguous(), "request_of_token must be contiguous")
    _cuda.check_cuda_tensor("block_tables", block_tables, [torch.int32], 2, device)
    _cuda.check(block_tables.stride(1) == 1, "block_tables rows must be contiguous")
    _cuda.check_cuda_tensor("query_start_loc", query_start_loc, [torch.int32], 1, device)
    _cuda.check(
        query_start_loc.is_contiguous() and query_start_loc.shape[0] >= block_tables.shape[0] + 1,
        "query_start_loc must be contiguous [num_seqs + 1]",
    )


def _check_slots(slots: SlotState, device: torch.device) -> None:
    """The slot state the kernel reads: int32 throughout, rows contiguous."""
    for name in ("num_tokens", "num_output", "num_drafts"):
        t = getattr(slots, name)
        _cuda.check_cuda_tensor(name, t, [torch.int32], 1, device)
        _cuda.check(t.is_contiguous(), f"{name} must be contiguous")
    for name in ("token_rows", "drafts"):
        t = getattr(slots, name)
        _cuda.check_cuda_tensor(name, t, [torch.int32], 2, device)
        _cuda.check(t.stride(1) == 1, f"{name} rows must be contiguous")


def _check_trees(
    tree_mask: torch.Tensor | None,
    tree_parents: torch.Tensor | None,
    slots: SlotState,
    device: torch.device,
    num_tokens: int,
) -> None:
    """The tree layout's outputs and the parents it reads, where the step verifies trees."""
    if tree_mask is None:
        _cuda.check(tree_parents is None, "tree_parents needs tree_mask")
        return
    _cuda.check_cuda_tensor("tree_mask", tree_mask, [torch.int64], 1, device)
    _cuda.check(
        tree_mask.is_contiguous() and tree_mask.shape[0] >= num_tokens,
        "tree_mask must be contiguous [>= num_tokens]",
    )
    _cuda.check_cuda_tensor("draft_parents", slots.draft_parents, [torch.int32], 2, device)
    _cuda.check(slots.draft_parents.stride(1) == 1, "draft_parents rows must be contiguous")
    if tree_parents is not None:
        _cuda.check_cuda_tensor("tree_parents", tree_parents, [torch.int64], 2, device)
        _cuda.check(tree_parents.stride(1) == 1, "tree_parents rows must be contiguous")
