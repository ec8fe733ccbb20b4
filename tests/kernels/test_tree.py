"""Draft-tree kernels (kernels/tree.py) against their torch references: the verification walk,
the accepted path's KV compaction, the small top-k, the n-gram graft and a head's forward inputs
over a tree's nodes; on the host through g++ where the kernel's threads never meet, on the GPU
for all of them."""

from __future__ import annotations

import math
import random
from typing import NamedTuple

import numpy as np
import pytest
import torch

from kernels.tree_ref import (
    TreeForwardInputs,
    compact_path_kv_ref,
    graft_trees_ref,
    top_k_ids_ref,
    tree_forward_inputs_ref,
    verify_tree_ref,
)
from tests.kernels.helpers import assemble_sm90, needs_cuda, needs_gxx, needs_nvcc, run_on_host

UINT4 = "struct uint4 { unsigned int x, y, z, w; };\n"
"""What the compaction kernel needs of CUDA's vector types to compile as C++."""


def random_trees(
    num_seqs: int, max_rows: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target_ids, draft_ids, cu_num_rows, parents) of random trees over a 3-token vocabulary (so
    drafts often match), some chains, some requests of one row, one of none (a graph's padding)."""
    rng = random.Random(seed)
    sizes = [rng.choice([0, 1, rng.randrange(1, max_rows + 1), max_rows]) for _ in range(num_seqs)]
    sizes[0] = max_rows
    parents = torch.full((num_seqs, max_rows), -1, dtype=torch.int64)
    draft_ids: list[int] = []
    for i, n in enumerate(sizes):
        chain = rng.random() < 0.3
        for j in range(1, n):
            parents[i, j] = j - 1 if chain else rng.randrange(j)
        draft_ids += [rng.randrange(3) for _ in range(n - 1)] + ([-1] if n else [])
    cu = torch.tensor([0, *np.cumsum(sizes)], dtype=torch.int32)
    target_ids = torch.tensor([rng.randrange(3) for _ in draft_ids], dtype=torch.int64)
    return target_ids, torch.tensor(draft_ids, dtype=torch.int32), cu, parents


def random_compaction(
    num_seqs: int, depth: int, seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(stack [layers, 2, blocks, block_size, heads, head_dim], path, num_accepted, roots, tables)
    with each request in blocks of its own and random accepted paths (nodes after their depth)."""
    rng = random.Random(seed)
    block_size, blocks_each, num_layers, heads, head_dim = 4, 16, 3, 2, 16
    stack = torch.randn(num_layers, 2, num_seqs * blocks_each, block_size, heads, head_dim).to(dtype)
    order = torch.randperm(num_seqs * blocks_each, generator=torch.Generator().manual_seed(seed))
    tables = order.view(num_seqs, blocks_each).int()
    path = torch.zeros(num_seqs, depth + 1, dtype=torch.int64)
    num_accepted = torch.zeros(num_seqs, dtype=torch.int32)
    for i in range(num_seqs):
        accepted = rng.randrange(depth + 1)
        node = 0
        for d in range(1, depth + 1):
            if d <= accepted:
                node = rng.randrange(max(node + 1, d), max(node + 1, d) + 3)
            path[i, d] = node
        num_accepted[i] = accepted
    roots = torch.tensor(
        [rng.randrange(0, block_size * blocks_each - 3 * depth - 1) for _ in range(num_seqs)]
    )
    return (t.to(device) for t in (stack, path, num_accepted, roots, tables))  # type: ignore[return-value]


def test_top_k_reference_takes_the_lower_column_of_equal_values() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0], [5.0, -1.0, 5.0, 7.0, 0.0]])
    assert top_k_ids_ref(logits, 3).tolist() == [[1, 3, 4], [3, 0, 2]]
    assert top_k_ids_ref(torch.tensor([[1.0, math.nan, 3.0, math.nan]]), 3).tolist() == [[1, 3, 2]]


@needs_gxx
@pytest.mark.parametrize("max_rows", [1, 5, 17])
def test_verify_walk_on_the_host_matches_reference(max_rows: int, tmp_path) -> None:
    from kernels.tree import VERIFY_SOURCE, VERIFY_THREADS

    for seed in range(4):
        target_ids, draft_ids, cu, parents = random_trees(9, max_rows, seed)
        num_seqs = parents.shape[0]
        token_ids = torch.full((num_seqs, max_rows), -7, dtype=torch.int32)
        num_accepted = torch.full((num_seqs,), -7, dtype=torch.int32)
        path = torch.full((num_seqs, max_rows), -7, dtype=torch.int64)
        args = (
            target_ids, np.int32(target_ids.shape[0]), draft_ids, cu, parents, np.int32(max_rows),
            np.int32(num_seqs), token_ids, num_accepted, path,
        )  # fmt: skip
        run_on_host(VERIFY_SOURCE, "verify_tree", {}, (1,), (VERIFY_THREADS,), args, tmp_path)
        want = verify_tree_ref(target_ids, draft_ids, cu, parents)
        assert torch.equal(token_ids, want[0]) and torch.equal(num_accepted, want[1])
        assert torch.equal(path, want[2])
        assert max_rows == 1 or int(num_accepted.max()) > 0  # the walk went somewhere


@needs_gxx
@pytest.mark.parametrize("depth", [1, 4])
def test_compaction_on_the_host_matches_reference(depth: int, tmp_path) -> None:
    from kernels.tree import COMPACT_SOURCE

    stack, path, num_accepted, roots, tables = random_compaction(5, depth, seed=depth)
    expected = stack.clone()
    compact_path_kv_ref([(layer[0], layer[1]) for layer in expected], path, num_accepted, roots, tables, 4)
    num_seqs, num_planes = path.shape[0], stack.shape[0] * 2
    row_bytes = stack[0, 0, 0, 0].numel() * stack.element_size()
    args = (
        stack, np.int64(stack[0, 1].data_ptr() - stack[0, 0].data_ptr()), path, np.int32(path.shape[1]),
        num_accepted, roots, tables, np.int32(tables.shape[1]), np.int32(4), np.int64(row_bytes),
        np.int32(row_bytes // 16), np.int32(num_seqs),
    )  # fmt: skip
    grid, block = (num_seqs * num_planes,), (row_bytes // 16,)
    run_on_host(UINT4 + COMPACT_SOURCE, "compact_path_kv", {"DEPTH": depth}, grid, block, args, tmp_path)
    assert int((num_accepted > 0).sum()) > 1
    assert torch.equal(stack, expected)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("max_rows", [1, 6, 17, 33])
def test_verify_walk_on_the_gpu_matches_reference(max_rows: int) -> None:
    from kernels.tree import verify_tree_cuda

    for seed in range(3):
        inputs = [t.cuda() for t in random_trees(200, max_rows, seed)]
        got = verify_tree_cuda(*inputs)
        want = verify_tree_ref(*inputs)
        for g, w in zip(got, want):
            assert torch.equal(g, w)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("stacked", [True, False])
def test_compaction_on_the_gpu_matches_reference(dtype: torch.dtype, stacked: bool) -> None:
    from kernels.tree import compact_path_kv_cuda

    for depth in (1, 3, 16):
        stack, path, num_accepted, roots, tables = random_compaction(37, depth, depth, dtype, "cuda")
        if stacked:  # the engine's layout: one tensor, one launch
            caches = [(layer[0], layer[1]) for layer in stack]
        else:  # planes allocated apart: one launch each
            caches = [(layer[0].clone(), layer[1].clone()) for layer in stack]
        expected = [(k.clone(), v.clone()) for k, v in caches]
        compact_path_kv_ref(expected, path, num_accepted, roots, tables, 4)
        compact_path_kv_cuda(caches, path, num_accepted, roots, tables, 4)
        for (k, v), (k_want, v_want) in zip(caches, expected):
            assert torch.equal(k, k_want) and torch.equal(v, v_want)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("vocab", [5, 8192, 151_936])
def test_top_k_on_the_gpu_matches_reference(vocab: int) -> None:
    from kernels.tree import MAX_TOP_K, top_k_ids_cuda

    generator = torch.Generator(device="cuda").manual_seed(vocab)
    logits = torch.randn(70, vocab, device="cuda", generator=generator)
    logits[1] = 0.0  # every value equal: the lowest columns
    logits[2, : vocab // 2] = logits[2, vocab // 2 :: 1][: vocab // 2]  # pairs of equal values
    logits[3, 1::2] = float("nan")  # a broken row: NaN first, as torch sorts it
    for k in (1, 2, 3, min(MAX_TOP_K, vocab)):
        assert torch.equal(top_k_ids_cuda(logits, k), top_k_ids_ref(logits, k))
    strided = logits[:, : vocab - 1] if vocab > 5 else logits
    assert torch.equal(top_k_ids_cuda(strided, 2), top_k_ids_ref(strided, 2))


def random_graft_rows(
    num_seqs: int, num_branch: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(head_parents, drafts, num_drafts) of a [2, 2, 1] head's tree with an n-gram branch over a
    3-token vocabulary (so the branch often follows the head's nodes), rows cut at random."""
    from services.engine.spec_decode.tree import DraftTree

    rng = random.Random(seed)
    tree = DraftTree((2, 2, 1))
    rows = []
    for _ in range(num_seqs):
        matched = rng.randrange(num_branch + 1)
        branch = [rng.randrange(3) for _ in range(matched)] + [-1] * (num_branch - matched)
        rows.append(branch + [rng.randrange(3) for _ in range(tree.num_nodes() - 1)])
    cuts = [rng.randrange(len(rows[0]) + 1) for _ in rows]
    head_parents = torch.tensor(tree.parents[1:], dtype=torch.int64)
    return head_parents, torch.tensor(rows, dtype=torch.int32), torch.tensor(cuts, dtype=torch.int32)


@needs_gxx
@pytest.mark.parametrize("num_branch", [0, 1, 5])
def test_graft_on_the_host_matches_reference(num_branch: int, tmp_path) -> None:
    from kernels.tree import GRAFT_SOURCE, VERIFY_THREADS

    head_parents, drafts, num_drafts = random_graft_rows(40, num_branch, seed=num_branch)
    num_seqs, width = drafts.shape
    token_ids, parents = (torch.full((num_seqs, width), -7, dtype=torch.int32) for _ in range(2))
    num_nodes = torch.full((num_seqs,), -7, dtype=torch.int32)
    args = (
        head_parents, drafts, np.int64(width), np.int32(width), np.int32(num_branch), num_drafts,
        np.int32(num_seqs), token_ids, parents, num_nodes,
    )  # fmt: skip
    run_on_host(GRAFT_SOURCE, "graft_trees", {}, (1,), (VERIFY_THREADS,), args, tmp_path)
    for got, want in zip(
        (token_ids, parents, num_nodes), graft_trees_ref(head_parents, drafts, num_drafts, num_branch)
    ):
        assert torch.equal(got, want)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_branch", [0, 1, 5])
def test_graft_on_the_gpu_matches_reference(num_branch: int) -> None:
    from kernels.tree import graft_trees_cuda

    inputs = [t.cuda() for t in random_graft_rows(300, num_branch, seed=num_branch)]
    for got, want in zip(graft_trees_cuda(*inputs, num_branch), graft_trees_ref(*inputs, num_branch)):
        assert torch.equal(got, want)


class TreeForwardArgs(NamedTuple):
    """The tensors `tree_forward_inputs` reads, in its order."""

    positions: torch.Tensor
    newest_rows: torch.Tensor
    num_wanted: torch.Tensor
    block_tables: torch.Tensor
    seq_rows: torch.Tensor
    node_depths: torch.Tensor
    node_masks: torch.Tensor


def random_tree_forward(
    num_seqs: int, branching: tuple[int, ...], seed: int, device: str = "cpu"
) -> tuple[TreeForwardArgs, int]:
    """(the kernel's tensors, num_head_nodes): a step of more sequences than requests (the block
    tables' rows picked by `seq_rows`), some requests drafting nothing, roots anywhere their
    blocks leave room for the tree's nodes."""
    from services.engine.spec_decode.tree import DraftTree

    rng = random.Random(seed)
    tree = DraftTree(branching)
    num_head_nodes = tree.num_nodes() - 1
    block_size, num_step_seqs = 4, num_seqs + 3
    max_blocks = num_head_nodes // block_size + 6
    num_tokens = 3 * num_step_seqs
    rows = torch.tensor(rng.sample(range(num_step_seqs), num_seqs))
    tables = torch.randint(1, 500, (num_step_seqs, max_blocks), generator=torch.Generator().manual_seed(seed))
    positions = torch.tensor(
        [rng.randrange(block_size * max_blocks - num_head_nodes - 1) for _ in range(num_tokens)]
    )
    newest_rows = torch.tensor([rng.randrange(num_tokens) for _ in range(num_seqs)])
    num_wanted = torch.tensor([rng.choice([0, 0, 1, 5]) for _ in range(num_seqs)], dtype=torch.int32)
    depths = torch.tensor(tree.depths[1:])
    masks = torch.tensor([m >> 1 for m in tree.masks[1:]])
    args = TreeForwardArgs(positions, newest_rows, num_wanted, tables.int(), rows, depths, masks)
    return TreeForwardArgs._make(t.to(device) for t in args), num_head_nodes


def old_tree_forward_inputs(args: TreeForwardArgs, num_nodes: int, block_size: int) -> TreeForwardInputs:
    """MTPProposer._tree_forward's torch ops before the fused kernel, as they were."""
    positions, newest_rows, num_wanted, block_tables, seq_rows, node_depths, node_masks = args
    newest = positions.index_select(0, newest_rows)
    num_seqs = newest.shape[0]
    drafting = num_wanted > 0
    base = torch.where(drafting, newest, 0)
    depths, masks = node_depths[:num_nodes], node_masks[:num_nodes]
    node_positions = base[:, None] + depths
    kv_positions = base[:, None] + torch.arange(1, num_nodes + 1)
    extra = -(-num_nodes // block_size) + 1
    tables = torch.nn.functional.pad(block_tables[seq_rows], (0, extra))
    blocks = tables.gather(1, kv_positions // block_size).long()
    slots = torch.where(drafting[:, None], blocks * block_size + kv_positions % block_size, -1)
    seq_lens = (base + 1 + num_nodes).int()
    return TreeForwardInputs(
        node_positions.flatten(),
        slots.flatten(),
        seq_lens,
        torch.arange(num_seqs + 1, dtype=torch.int32) * num_nodes,
        tables,
        masks.repeat(num_seqs),
    )


def assert_same_inputs(got: TreeForwardInputs, want: TreeForwardInputs) -> None:
    for name, g, w in zip(TreeForwardInputs._fields, got, want):
        assert g.dtype == w.dtype and torch.equal(g, w), name


@pytest.mark.parametrize("branching", [(2, 2, 1), (3, 2, 1), (1, 1, 1, 1, 1, 1), (4, 4, 2)])
def test_tree_forward_inputs_reference_matches_the_proposers_old_formulas(branching: tuple[int, ...]) -> None:
    for seed in range(5):
        inputs, num_head_nodes = random_tree_forward(11, branching, seed)
        for num_nodes in range(1, num_head_nodes + 1):
            want = old_tree_forward_inputs(inputs, num_nodes, 4)
            assert_same_inputs(tree_forward_inputs_ref(*inputs, num_nodes, 4), want)


def run_tree_forward_inputs_on_host(
    inputs: TreeForwardArgs, num_nodes: int, block_size: int, tmp_path
) -> TreeForwardInputs:
    from kernels.tree import TREE_INPUT_SOURCE, TREE_INPUT_THREADS

    positions, newest_rows, num_wanted, tables, seq_rows, depths, masks = inputs
    num_seqs, max_blocks = newest_rows.shape[0], tables.shape[1]
    width = max_blocks - (-num_nodes // block_size) + 1
    out = TreeForwardInputs(
        torch.full((num_seqs * num_nodes,), -7, dtype=torch.int64),
        torch.full((num_seqs * num_nodes,), -7, dtype=torch.int64),
        torch.full((num_seqs,), -7, dtype=torch.int32),
        torch.full((num_seqs + 1,), -7, dtype=torch.int32),
        torch.full((num_seqs, width), -7, dtype=torch.int32),
        torch.full((num_seqs * num_nodes,), -7, dtype=torch.int64),
    )
    args = (
        positions, newest_rows, num_wanted, tables, np.int64(tables.stride(0)), np.int32(max_blocks), seq_rows,
        depths, masks, np.int32(num_nodes), np.int32(block_size), np.int32(num_seqs), np.int32(width), *out,
    )  # fmt: skip
    grid, block = (num_seqs,), (TREE_INPUT_THREADS,)
    run_on_host(TREE_INPUT_SOURCE, "tree_forward_inputs", {}, grid, block, args, tmp_path)
    return out


@needs_gxx
@pytest.mark.parametrize("branching", [(2, 2, 1), (3, 2, 1)])
def test_tree_forward_inputs_on_the_host_match_reference(branching: tuple[int, ...], tmp_path) -> None:
    for seed in range(3):
        inputs, num_head_nodes = random_tree_forward(9, branching, seed)
        assert int((inputs.num_wanted == 0).sum()) > 0 and int((inputs.num_wanted > 0).sum()) > 0
        for num_nodes in (1, num_head_nodes // 2, num_head_nodes):
            got = run_tree_forward_inputs_on_host(inputs, num_nodes, 4, tmp_path)
            assert_same_inputs(got, tree_forward_inputs_ref(*inputs, num_nodes, 4))


@needs_gxx
def test_tree_forward_inputs_on_the_host_read_strided_block_tables(tmp_path) -> None:
    """The step's block tables may be a view of wider static buffers (a CUDA graph's)."""
    inputs, num_head_nodes = random_tree_forward(6, (3, 2, 1), seed=7)
    tables = inputs.block_tables
    strided = inputs._replace(block_tables=torch.nn.functional.pad(tables, (0, 5))[:, : tables.shape[1]])
    assert not strided.block_tables.is_contiguous()
    got = run_tree_forward_inputs_on_host(strided, num_head_nodes, 4, tmp_path)
    assert_same_inputs(got, tree_forward_inputs_ref(*inputs, num_head_nodes, 4))


@needs_nvcc
def test_tree_forward_inputs_assemble_for_sm90_without_spills(tmp_path) -> None:
    from kernels.tree import TREE_INPUT_SOURCE

    assert assemble_sm90(TREE_INPUT_SOURCE, {}, tmp_path)["tree_forward_inputs"] <= 64


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("branching", [(2, 2, 1), (3, 2, 1), (4, 4, 2)])
def test_tree_forward_inputs_on_the_gpu_match_reference(branching: tuple[int, ...]) -> None:
    from kernels.tree import tree_forward_inputs_cuda

    for seed in range(3):
        inputs, num_head_nodes = random_tree_forward(150, branching, seed, "cuda")
        for num_nodes in range(1, num_head_nodes + 1):
            got = tree_forward_inputs_cuda(*inputs, num_nodes, 4)
            assert_same_inputs(got, tree_forward_inputs_ref(*inputs, num_nodes, 4))
    tables = inputs.block_tables
    strided = inputs._replace(block_tables=torch.nn.functional.pad(tables, (0, 3))[:, : tables.shape[1]])
    assert_same_inputs(
        tree_forward_inputs_cuda(*strided, num_head_nodes, 4),
        tree_forward_inputs_ref(*inputs, num_head_nodes, 4),
    )


@pytest.mark.gpu
@needs_cuda
def test_tree_forward_inputs_replay_from_a_cuda_graph() -> None:
    """Captured once, replayed with new roots and wanted counts: no host read, no host data."""
    from kernels.tree import tree_forward_inputs_cuda

    inputs, num_head_nodes = random_tree_forward(40, (3, 2, 1), 0, "cuda")
    static = TreeForwardArgs._make(t.clone() for t in inputs)
    tree_forward_inputs_cuda(*static, num_head_nodes, 4)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = tree_forward_inputs_cuda(*static, num_head_nodes, 4)
    for seed in range(1, 4):
        fresh, _ = random_tree_forward(40, (3, 2, 1), seed, "cuda")
        for buffer, value in zip(static, fresh):
            buffer.copy_(value)
        graph.replay()
        assert_same_inputs(captured, tree_forward_inputs_ref(*fresh, num_head_nodes, 4))
