"""CUDA twins of kernels/tree_ref.py: a draft tree's verification walk, the compaction of its
accepted path's KV, the graft of an n-gram branch onto a head's tree, the top-k of each row that
drafts a tree's level, and the inputs of a head's forward over a tree's nodes; each one launch
where the references run tens of small torch ops.

- `verify_tree`: one thread per request walks down its tree (at most max_rows nodes), taking at
  each node its first child whose token equals the node's target token.
- `compact_path_kv`: one thread block per (request, cache plane), one thread per 16 bytes of a
  cache row; each thread reads its chunk of every entry the path moves before writing any, so the
  moves of one request (whose sources and destinations may overlap) never read a moved entry. The
  planes (key and value of every layer) are one launch where they lie at a fixed stride, as the
  engine allocates them (one tensor [num_layers, 2, ...]), else one launch per plane.
- `graft_trees`: one thread per request follows the head's nodes with its n-gram branch and
  lays out the grafted tree.
- `top_k_ids`: one thread block per row; each thread keeps the K best of its columns in
  registers, then K rounds of a block-wide arg-max take the best of the threads' heads.
- `tree_forward_inputs`: one thread block per request, its threads over the request's nodes and
  its padded block table's columns.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels import _cuda
from kernels.tree_ref import TreeForwardInputs

VERIFY_THREADS = 128
TOP_K_THREADS = 256
TREE_INPUT_THREADS = 128
MAX_TOP_K = 16
"""Largest k of `top_k_ids` (each thread keeps k candidates in registers)."""
MAX_PATH_DEPTH = 32
"""Deepest accepted path `compact_path_kv` moves (each thread holds a chunk per depth)."""

VERIFY_SOURCE = r"""
extern "C" __global__ void verify_tree(
    const long long* __restrict__ target_ids, int total_rows, const int* __restrict__ draft_ids,
    const int* __restrict__ cu_num_rows, const long long* __restrict__ parents, int num_nodes, int num_seqs,
    int* __restrict__ token_ids, int* __restrict__ num_accepted, long long* __restrict__ path)
{
    const int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= num_seqs) return;
    const int start = cu_num_rows[s];
    const int n = min(cu_num_rows[s + 1] - start, num_nodes);
    const long long* par = parents + (long long)s * num_nodes;
    long long* steps = path + (long long)s * num_nodes;
    int* out = token_ids + (long long)s * num_nodes;
    int current = 0, accepted = 0;
    bool walking = true;
    steps[0] = 0;
    for (int d = 1; d < num_nodes; ++d) {
        if (walking) {
            const long long target = target_ids[min(start + current, total_rows - 1)];
            int found = -1;
            for (int j = 1; j < n && found < 0; ++j)
                if (par[j] == current && (long long)draft_ids[max(min(start + j, total_rows - 1) - 1, 0)] == target)
                    found = j;
            if (found >= 0) {
                out[accepted++] = (int)target;
                current = found;
            } else {
                walking = false;
            }
        }
        steps[d] = current;
    }
    out[accepted] = (int)target_ids[min(start + current, total_rows - 1)];
    for (int c = accepted + 1; c < num_nodes; ++c) out[c] = -1;
    num_accepted[s] = accepted;
}
"""

COMPACT_SOURCE = r"""
/* The cache slot of `position` under request s's block table (past the table: its last entry). */
__device__ __forceinline__ long long slot_of(
    long long position, const int* table, int max_blocks, int block_size)
{
    const long long block = table[min(position / block_size, (long long)max_blocks - 1)];
    return block * block_size + position % block_size;
}

extern "C" __global__ void compact_path_kv(
    char* __restrict__ planes, long long plane_stride, const long long* __restrict__ path, int path_width,
    const int* __restrict__ num_accepted, const long long* __restrict__ roots, const int* __restrict__ tables,
    int max_blocks, int block_size, long long row_bytes, int row_chunks, int num_seqs)
{
    const int s = blockIdx.x % num_seqs;  /* blocks: request-major within each plane */
    const int accepted = min(num_accepted[s], DEPTH);
    if (accepted <= 0) return;
    char* cache = planes + (long long)(blockIdx.x / num_seqs) * plane_stride;
    const long long* nodes = path + (long long)s * path_width;
    const int* table = tables + (long long)s * max_blocks;
    const long long root = roots[s];
    for (int chunk = threadIdx.x; chunk < row_chunks; chunk += blockDim.x) {
        uint4 held[DEPTH];
#pragma unroll
        for (int d = 1; d <= DEPTH; ++d) {
            const long long node = d <= accepted ? nodes[d] : d;
            if (node != d) {
                const long long slot = slot_of(root + node, table, max_blocks, block_size);
                held[d - 1] = *reinterpret_cast<const uint4*>(cache + slot * row_bytes + chunk * 16LL);
            }
        }
#pragma unroll
        for (int d = 1; d <= DEPTH; ++d) {
            const long long node = d <= accepted ? nodes[d] : d;
            if (node != d) {
                const long long slot = slot_of(root + d, table, max_blocks, block_size);
                *reinterpret_cast<uint4*>(cache + slot * row_bytes + chunk * 16LL) = held[d - 1];
            }
        }
    }
}
"""

GRAFT_SOURCE = r"""
extern "C" __global__ void graft_trees(
    const long long* __restrict__ head_parents, const int* __restrict__ drafts, long long row_stride, int width,
    int num_branch, const int* __restrict__ num_drafts, int num_seqs, int* __restrict__ token_ids,
    int* __restrict__ parents, int* __restrict__ num_nodes)
{
    const int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= num_seqs) return;
    const int* branch = drafts + (long long)s * row_stride;
    const int* head = branch + num_branch;
    const int num_head_nodes = width - num_branch;
    const int drafted = num_drafts[s];
    int* out = token_ids + (long long)s * width;
    int* out_parents = parents + (long long)s * width;
    if (num_branch == 0) {
        for (int c = 0; c < width; ++c) {
            out[c] = c < drafted ? head[c] : -1;
            out_parents[c] = c < num_head_nodes ? (int)head_parents[c] : c;
        }
        num_nodes[s] = drafted;
        return;
    }
    const int num_head = max(drafted - num_branch, 0);
    int num_valid = 0;  /* the branch up to its first -1, within the row's drafts */
    while (num_valid < num_branch && num_valid < drafted && branch[num_valid] >= 0) ++num_valid;
    int node = 0, num_shared = 0;
    for (; num_shared < num_valid; ++num_shared) {  /* follow the head's nodes while they hold the branch */
        int last = -1;
        for (int m = 0; m < num_head; ++m)
            if (head_parents[m] == node && head[m] == branch[num_shared]) last = m;
        if (last < 0) break;
        node = last + 1;
    }
    const int total = num_head + num_valid - num_shared;
    for (int c = 0; c < width; ++c) {
        const int grafted = c - num_head;  /* index into the grafted chain */
        const bool is_head = c < num_head;
        const int from_branch = branch[min(max(num_shared + grafted, 0), num_branch - 1)];
        out[c] = is_head ? (c < num_head_nodes ? head[c] : -1) : (c < total ? from_branch : -1);
        out_parents[c] = is_head ? (c < num_head_nodes ? (int)head_parents[c] : 0) : (grafted == 0 ? node : c);
    }
    num_nodes[s] = total;
}
"""

TOP_K_SOURCE = r"""
/* a before b: a larger value, or an equal one at a lower column; NaN above every number (as
   torch's sort puts it) */
__device__ __forceinline__ bool before(float av, int ac, float bv, int bc)
{
    const bool a_nan = av != av, b_nan = bv != bv;
    if (a_nan || b_nan) return a_nan && (!b_nan || ac < bc);
    return av > bv || (av == bv && ac < bc);
}

extern "C" __global__ void top_k_ids(
    const float* __restrict__ logits, long long row_stride, int vocab, long long* __restrict__ out)
{
    __shared__ float warp_value[32];
    __shared__ int warp_column[32];
    __shared__ int winner;
    const float* row = logits + blockIdx.x * row_stride;
    float value[K];
    int column[K];
#pragma unroll
    for (int i = 0; i < K; ++i) { value[i] = -__int_as_float(0x7f800000); column[i] = 0x7fffffff; }
    for (int c = threadIdx.x; c < vocab; c += blockDim.x) {
        float v = row[c];
        int cc = c;
        if (!before(v, cc, value[K - 1], column[K - 1])) continue;
#pragma unroll
        for (int i = 0; i < K; ++i) {  /* insertion: carry the displaced entry down */
            if (before(v, cc, value[i], column[i])) {
                const float tv = value[i]; const int tc = column[i];
                value[i] = v; column[i] = cc; v = tv; cc = tc;
            }
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    for (int round = 0; round < K; ++round) {
        float v = value[0];
        int c = column[0];
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float ov = __shfl_down_sync(0xffffffff, v, offset);
            const int oc = __shfl_down_sync(0xffffffff, c, offset);
            if (before(ov, oc, v, c)) { v = ov; c = oc; }
        }
        if (lane == 0) { warp_value[warp] = v; warp_column[warp] = c; }
        __syncthreads();
        if (threadIdx.x == 0) {
            float bv = warp_value[0];
            int bc = warp_column[0];
            for (int w = 1; w < num_warps; ++w)
                if (before(warp_value[w], warp_column[w], bv, bc)) { bv = warp_value[w]; bc = warp_column[w]; }
            winner = bc;
            out[(long long)blockIdx.x * K + round] = bc;
        }
        __syncthreads();
        if (column[0] == winner) {  /* the owner of the winning column moves on to its next best */
#pragma unroll
            for (int i = 0; i + 1 < K; ++i) { value[i] = value[i + 1]; column[i] = column[i + 1]; }
            value[K - 1] = -__int_as_float(0x7f800000);
            column[K - 1] = 0x7fffffff;
        }
        __syncthreads();
    }
}
"""

TREE_INPUT_SOURCE = r"""
extern "C" __global__ void tree_forward_inputs(
    const long long* __restrict__ positions, const long long* __restrict__ newest_rows,
    const int* __restrict__ num_wanted, const int* __restrict__ block_tables, long long table_stride,
    int max_blocks, const long long* __restrict__ seq_rows, const long long* __restrict__ node_depths,
    const long long* __restrict__ node_masks, int num_nodes, int block_size, int num_seqs, int width,
    long long* __restrict__ node_positions, long long* __restrict__ slot_mapping, int* __restrict__ seq_lens,
    int* __restrict__ query_start_loc, int* __restrict__ tables, long long* __restrict__ tree_mask)
{
    const int s = blockIdx.x;
    const bool drafting = num_wanted[s] > 0;
    const long long base = drafting ? positions[newest_rows[s]] : 0;  /* the root's position */
    const int* table = block_tables + seq_rows[s] * table_stride;
    int* padded = tables + (long long)s * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) padded[c] = c < max_blocks ? table[c] : 0;
    for (int m = threadIdx.x; m < num_nodes; m += blockDim.x) {
        const long long i = (long long)s * num_nodes + m;
        const long long kv = base + m + 1;
        const long long column = min(kv / block_size, (long long)width - 1);
        const long long block = column < max_blocks ? table[column] : 0;
        node_positions[i] = base + node_depths[m];
        slot_mapping[i] = drafting ? block * block_size + kv % block_size : -1;
        tree_mask[i] = node_masks[m];
    }
    if (threadIdx.x == 0) {
        seq_lens[s] = (int)(base + 1 + num_nodes);
        query_start_loc[s] = s * num_nodes;
        if (s == num_seqs - 1) query_start_loc[num_seqs] = num_seqs * num_nodes;
    }
}
"""


def verify_tree_cuda(
    target_ids: torch.Tensor, draft_ids: torch.Tensor, cu_num_rows: torch.Tensor, parents: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `verify_tree_ref`."""
    device = target_ids.device
    target_ids = target_ids.long().contiguous()
    draft_ids = draft_ids.int().contiguous()
    cu_num_rows = cu_num_rows.int().contiguous()
    parents = parents.long().contiguous()
    _cuda.check_cuda_tensor("target_ids", target_ids, [torch.int64], 1, device)
    _cuda.check_cuda_tensor("draft_ids", draft_ids, [torch.int32], 1, device)
    _cuda.check_cuda_tensor("cu_num_rows", cu_num_rows, [torch.int32], 1, device)
    _cuda.check_cuda_tensor("parents", parents, [torch.int64], 2, device)
    num_seqs, num_nodes = parents.shape
    _cuda.check(cu_num_rows.shape[0] == num_seqs + 1, "cu_num_rows must hold num_seqs + 1 offsets")
    _cuda.check(draft_ids.shape == target_ids.shape, "draft_ids and target_ids must have one entry a row")
    token_ids = torch.empty(num_seqs, num_nodes, dtype=torch.int32, device=device)
    num_accepted = torch.empty(num_seqs, dtype=torch.int32, device=device)
    path = torch.empty(num_seqs, num_nodes, dtype=torch.int64, device=device)
    if num_seqs == 0 or num_nodes == 0 or target_ids.shape[0] == 0:
        return token_ids.fill_(-1), num_accepted.zero_(), path.zero_()
    kernel = _cuda.function(VERIFY_SOURCE, "verify_tree", device)
    i32 = np.int32
    _cuda.launch(
        kernel,
        (-(-num_seqs // VERIFY_THREADS),),
        (VERIFY_THREADS,),
        (
            target_ids,
            i32(target_ids.shape[0]),
            draft_ids,
            cu_num_rows,
            parents,
            i32(num_nodes),
            i32(num_seqs),
            token_ids,
            num_accepted,
            path,
        ),
        device,
    )
    return token_ids, num_accepted, path


def compact_path_kv_cuda(
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    path: torch.Tensor,
    num_accepted: torch.Tensor,
    root_positions: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
) -> None:
    """Same contract as `compact_path_kv_ref`."""
    if path.shape[1] < 2 or not caches:
        return
    planes = [cache for pair in caches for cache in pair]
    first = planes[0]
    device = first.device
    for plane in planes:
        _cuda.check_cuda_tensor("cache", plane, list(_cuda.DTYPE_IDS), first.dim(), device)
        _cuda.check(
            plane.shape == first.shape and plane.dtype == first.dtype and plane.is_contiguous(),
            "every KV cache must be contiguous, of one shape and dtype",
        )
    row_bytes = first[0, 0].numel() * first.element_size()
    _cuda.check(row_bytes % 16 == 0, f"a cache row of {row_bytes} bytes is not whole 16-byte chunks")
    depth = path.shape[1] - 1
    _cuda.check(depth <= MAX_PATH_DEPTH, f"paths deeper than {MAX_PATH_DEPTH} are not supported")
    path = path.long().contiguous()
    num_accepted = num_accepted.int().contiguous()
    roots = root_positions.long().contiguous()
    tables = block_tables.int().contiguous()
    num_seqs = path.shape[0]
    if num_seqs == 0:
        return
    stride = planes[1].data_ptr() - first.data_ptr()
    uniform = stride > 0 and all(p.data_ptr() == first.data_ptr() + i * stride for i, p in enumerate(planes))
    launches = [(first, len(planes), stride)] if uniform else [(p, 1, 0) for p in planes]
    row_chunks = row_bytes // 16
    kernel = _cuda.function(COMPACT_SOURCE, "compact_path_kv", device, DEPTH=depth)
    i32, i64 = np.int32, np.int64
    for base, num_planes, plane_stride in launches:
        _cuda.launch(
            kernel,
            (num_seqs * num_planes,),
            (min(row_chunks, 256),),
            (
                base,
                i64(plane_stride),
                path,
                i32(path.shape[1]),
                num_accepted,
                roots,
                tables,
                i32(tables.shape[1]),
                i32(block_size),
                i64(row_bytes),
                i32(row_chunks),
                i32(num_seqs),
            ),
            device,
        )


def graft_trees_cuda(
    head_parents: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, num_branch: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `graft_trees_ref`."""
    device = drafts.device
    drafts = drafts.int()
    _cuda.check_cuda_tensor("drafts", drafts, [torch.int32], 2, device)
    _cuda.check(drafts.stride(1) == 1, "drafts rows must be contiguous")
    num_seqs, width = drafts.shape
    _cuda.check(0 <= num_branch <= width, f"num_branch {num_branch} must be within the rows' {width} columns")
    _cuda.check(head_parents.shape[0] >= width - num_branch, "head_parents must cover the head's nodes")
    head_parents = head_parents.to(device=device, dtype=torch.int64).contiguous()
    num_drafts = num_drafts.int().contiguous()
    token_ids = torch.empty(num_seqs, width, dtype=torch.int32, device=device)
    parents = torch.empty(num_seqs, width, dtype=torch.int32, device=device)
    num_nodes = torch.empty(num_seqs, dtype=torch.int32, device=device)
    if num_seqs == 0:
        return token_ids, parents, num_nodes
    kernel = _cuda.function(GRAFT_SOURCE, "graft_trees", device)
    i32 = np.int32
    _cuda.launch(
        kernel,
        (-(-num_seqs // VERIFY_THREADS),),
        (VERIFY_THREADS,),
        (
            head_parents,
            drafts,
            np.int64(drafts.stride(0)),
            i32(width),
            i32(num_branch),
            num_drafts,
            i32(num_seqs),
            token_ids,
            parents,
            num_nodes,
        ),
        device,
    )
    return token_ids, parents, num_nodes


def top_k_ids_cuda(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Same contract as `top_k_ids_ref`."""
    device = logits.device
    _cuda.check_cuda_tensor("logits", logits, [torch.float32], 2, device)
    _cuda.check(logits.stride(1) == 1, "logits rows must be contiguous")
    _cuda.check(0 < k <= MAX_TOP_K, f"k must be in 1..{MAX_TOP_K}")
    num_rows, vocab = logits.shape
    _cuda.check(k <= vocab, f"k {k} is larger than the vocabulary ({vocab})")
    out = torch.empty(num_rows, k, dtype=torch.int64, device=device)
    if num_rows == 0:
        return out
    kernel = _cuda.function(TOP_K_SOURCE, "top_k_ids", device, K=k)
    _cuda.launch(
        kernel,
        (num_rows,),
        (TOP_K_THREADS,),
        (logits, np.int64(logits.stride(0)), np.int32(vocab), out),
        device,
    )
    return out


def tree_forward_inputs_cuda(
    positions: torch.Tensor,
    newest_rows: torch.Tensor,
    num_wanted: torch.Tensor,
    block_tables: torch.Tensor,
    seq_rows: torch.Tensor,
    node_depths: torch.Tensor,
    node_masks: torch.Tensor,
    num_nodes: int,
    block_size: int,
) -> TreeForwardInputs:
    """Same contract as `tree_forward_inputs_ref`."""
    device = positions.device
    for name, tensor, dtype in (
        ("positions", positions, torch.int64),
        ("newest_rows", newest_rows, torch.int64),
        ("num_wanted", num_wanted, torch.int32),
        ("seq_rows", seq_rows, torch.int64),
        ("node_depths", node_depths, torch.int64),
        ("node_masks", node_masks, torch.int64),
    ):
        _cuda.check_cuda_tensor(name, tensor, [dtype], 1, device)
        _cuda.check(tensor.is_contiguous(), f"{name} must be contiguous")
    _cuda.check_cuda_tensor("block_tables", block_tables, [torch.int32], 2, device)
    _cuda.check(block_tables.stride(1) == 1, "block_tables rows must be contiguous")
    num_seqs = newest_rows.shape[0]
    _cuda.check(num_wanted.shape[0] == num_seqs and seq_rows.shape[0] == num_seqs, "one entry a request")
    _cuda.check(
        0 < num_nodes <= min(node_depths.shape[0], node_masks.shape[0]),
        "the nodes must have depths and masks",
    )
    max_blocks = block_tables.shape[1]
    width = max_blocks - (-num_nodes // block_size) + 1
    inputs = TreeForwardInputs(
        positions=torch.empty(num_seqs * num_nodes, dtype=torch.int64, device=device),
        slot_mapping=torch.empty(num_seqs * num_nodes, dtype=torch.int64, device=device),
        seq_lens=torch.empty(num_seqs, dtype=torch.int32, device=device),
        query_start_loc=torch.empty(num_seqs + 1, dtype=torch.int32, device=device),
        block_tables=torch.empty(num_seqs, width, dtype=torch.int32, device=device),
        tree_mask=torch.empty(num_seqs * num_nodes, dtype=torch.int64, device=device),
    )
    if num_seqs == 0:
        inputs.query_start_loc.zero_()
        return inputs
    kernel = _cuda.function(TREE_INPUT_SOURCE, "tree_forward_inputs", device)
    i32 = np.int32
    _cuda.launch(
        kernel,
        (num_seqs,),
        (TREE_INPUT_THREADS,),
        (
            positions,
            newest_rows,
            num_wanted,
            block_tables,
            np.int64(block_tables.stride(0)),
            i32(max_blocks),
            seq_rows,
            node_depths,
            node_masks,
            i32(num_nodes),
            i32(block_size),
            i32(num_seqs),
            i32(width),
            *inputs,
        ),
        device,
    )
    return inputs
