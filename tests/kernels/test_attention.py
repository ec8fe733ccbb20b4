"""Paged append-attention and the KV write: CUDA kernel vs torch reference vs plain loops."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from kernels.attention_ref import (
    CAUSAL_MASK,
    AttentionMetadata,
    ancestor_masks,
    append_attention_ref,
    write_kv_ref,
)
from tests.kernels.helpers import needs_cuda, poison_allocator, rel_error


def make_batch(
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random caches with shuffled block tables; seq_len = cached context + query tokens."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, used = [], 0
    for n in blocks_per_seq:
        tables.append(order[used : used + n])
        used += n
    width = max(blocks_per_seq)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(device, dtype)
    value_cache = torch.randn(shape, generator=generator).to(device, dtype)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator).to(device, dtype)
    slots = [
        t[p // block_size] * block_size + p % block_size
        for t, s, q in zip(tables, seq_lens, query_lens)
        for p in range(s - q, s)
    ]
    cu = [0]
    for q in query_lens:
        cu.append(cu[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
        ),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens,
    )
    return query, key_cache, value_cache, meta


def loop_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    parents: dict[int, list[int]] | None = None,
) -> torch.Tensor:
    """Token by token, head by head, in float64. `parents`: the draft tree of a sequence's query
    (by sequence index), whose tokens see the cached context and their own ancestors."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    starts = meta.query_start_loc.tolist()
    for s, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        table = meta.block_tables[s].tolist()
        for i in range(q_len):
            pos = seq_len - q_len + i
            visible = [c for c in range(pos + 1) if window is None or pos - c < window]
            if parents is not None and s in parents:
                context_len = seq_len - q_len
                visible = list(range(context_len)) + [context_len + j for j in path_to_root(parents[s], i)]
            for h in range(query.shape[1]):
                kv = h // group
                keys = torch.stack(
                    [key_cache[table[c // block_size], c % block_size, kv] for c in visible]
                ).double()
                values = torch.stack(
                    [value_cache[table[c // block_size], c % block_size, kv] for c in visible]
                ).double()
                weights = torch.softmax(keys @ query[starts[s] + i, h].double() * scale, dim=0)
                out[starts[s] + i, h] = weights @ values
    return out


def path_to_root(parents: list[int], node: int) -> list[int]:
    """The node and its ancestors, root first."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def with_trees(meta: AttentionMetadata, parents: dict[int, list[int]]) -> AttentionMetadata:
    """`meta` with the trees `parents` (by sequence) as tree masks; other queries causal."""
    masks: list[int] = []
    for s, query_len in enumerate(meta.query_lens_cpu):
        masks += ancestor_masks(parents[s]) if s in parents else [CAUSAL_MASK] * query_len
    tree_mask = torch.tensor(masks, dtype=torch.int64, device=meta.seq_lens.device)
    return dataclasses.replace(meta, tree_mask=tree_mask)


def random_tree(num_nodes: int, rng: random.Random) -> list[int]:
    """A parent array in which every node follows its parent."""
    return [-1] + [rng.randrange(i) for i in range(1, num_nodes)]


TREE_BATCHES = [
    # (query_lens, context_lens, trees by sequence): trees beside decode tokens, chains and prefill
    # chunks; trees longer than SHORT_QUERY_MAX take the unpadded path
    ([7, 1, 4, 30], [9, 20, 3, 5], {0: [-1, 0, 0, 1, 1, 2, 3]}),
    ([10, 3, 24, 1], [0, 33, 12, 40], {0: "random", 2: "random", 1: [-1, 0, 0]}),
    ([64, 5], [17, 2], {0: "random"}),
]


@pytest.mark.parametrize("case", range(len(TREE_BATCHES)))
def test_tree_mask_reference_matches_plain_loop(case: int) -> None:
    generator = torch.Generator().manual_seed(case)
    rng = random.Random(case)
    query_lens, context_lens, trees = TREE_BATCHES[case]
    parents = {s: random_tree(query_lens[s], rng) if t == "random" else t for s, t in trees.items()}
    query, key_cache, value_cache, meta = make_batch(
        query_lens, context_lens, 6, 2, 8, 4, torch.float32, "cpu", generator
    )
    scale = 8**-0.5
    out = append_attention_ref(query, key_cache, value_cache, with_trees(meta, parents), scale)
    expected = loop_attention(query, key_cache, value_cache, meta, scale, None, parents)
    assert rel_error(out, expected) < 1e-5
    # the tree changed what its tokens see (a branch's node is not its predecessor's child)
    assert rel_error(append_attention_ref(query, key_cache, value_cache, meta, scale), expected) > 1e-3


def test_chain_tree_masks_equal_causal_attention() -> None:
    """A chain is the tree whose masks are lower-triangular: existing verification is unchanged."""
    generator = torch.Generator().manual_seed(5)
    query_lens = [4, 1, 20, 16]
    query, key_cache, value_cache, meta = make_batch(
        query_lens, [12, 30, 3, 7], 6, 2, 8, 4, torch.float32, "cpu", generator
    )
    chains = {s: [-1] + list(range(n - 1)) for s, n in enumerate(query_lens)}
    causal = append_attention_ref(query, key_cache, value_cache, meta, 8**-0.5)
    chained = append_attention_ref(query, key_cache, value_cache, with_trees(meta, chains), 8**-0.5)
    assert torch.allclose(chained, causal, rtol=0, atol=1e-6)


def test_ancestor_masks_and_bad_trees() -> None:
    assert ancestor_masks([-1, 0, 0, 1, 2]) == [0b1, 0b11, 0b101, 0b1011, 0b10101]
    assert ancestor_masks([-1] + list(range(63)))[-1] == CAUSAL_MASK  # all 64 bits, as int64
    for parents in ([0, 0], [-1, 1], [-1, 2, 0], [-1, 0, -1]):
        with pytest.raises(ValueError, match="parent"):
            ancestor_masks(parents)
    with pytest.raises(ValueError, match="at most 64"):
        ancestor_masks([-1] + list(range(64)))


def test_tree_mask_refuses_sliding_window() -> None:
    generator = torch.Generator().manual_seed(0)
    query, key_cache, value_cache, meta = make_batch([3], [4], 2, 2, 8, 4, torch.float32, "cpu", generator)
    tree = with_trees(meta, {0: [-1, 0, 0]})
    with pytest.raises(ValueError, match="sliding-window"):
        append_attention_ref(query, key_cache, value_cache, tree, 1.0, sliding_window=8)


@pytest.mark.parametrize("window", [None, 5])
def test_reference_matches_plain_loop(window: int | None) -> None:
    generator = torch.Generator().manual_seed(0)
    # decode tokens; verify queries of several lengths; prefill chunks (longer than
    # SHORT_QUERY_MAX) beside them, which are attended apart from the padded short ones
    for query_lens, context_lens in (
        ([1, 1, 1], [7, 20, 2]),
        ([3, 1, 6], [7, 20, 2]),
        ([17, 1, 5, 40, 16], [0, 20, 2, 9, 33]),
    ):
        query, key_cache, value_cache, meta = make_batch(
            query_lens, context_lens, 6, 2, 8, 4, torch.float32, "cpu", generator
        )
        scale = 8**-0.5
        out = append_attention_ref(query, key_cache, value_cache, meta, scale, window)
        assert rel_error(out, loop_attention(query, key_cache, value_cache, meta, scale, window)) < 1e-5


def test_write_kv_reference_writes_each_slot() -> None:
    key = torch.randn(5, 2, 4)
    value = torch.randn(5, 2, 4)
    key_cache, value_cache = torch.zeros(3, 4, 2, 4), torch.zeros(3, 4, 2, 4)
    slots = torch.tensor([11, 0, 5, 6, 3])
    write_kv_ref(key, value, key_cache, value_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(key_cache[slot // 4, slot % 4], key[t])
        assert torch.equal(value_cache[slot // 4, slot % 4], value[t])


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}

CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, query_lens, context_lens, window)
    (4, 4, 16, 16, [1], [5], None),
    (6, 3, 16, 8, [1, 4, 16, 2], [0, 37, 100, 300], None),
    (32, 8, 64, 16, [1] * 7, [1, 64, 65, 500, 1000, 3000, 17], None),
    (32, 8, 64, 16, [6] * 5, [128, 700, 2048, 9, 4000], None),
    (28, 4, 128, 16, [1, 6, 3, 16], [2000, 130, 64, 5000], None),
    (28, 4, 128, 32, [40, 1, 300], [0, 900, 20], None),
    (8, 2, 64, 16, [1, 5, 2], [900, 400, 40], 128),
    (16, 1, 128, 16, [1, 9], [6000, 300], None),
    (12, 12, 64, 16, [3, 1], [31, 8192], None),
    (40, 2, 64, 16, [1, 6], [300, 1000], None),  # 20 query heads per kv head: CUDA cores only
    # long prefill chunks: many query tiles per sequence
    (32, 8, 64, 16, [433, 1, 300, 2100, 6], [0, 50, 700, 0, 90], None),
    (4, 4, 16, 16, [5000], [3000], None),
    (8, 2, 64, 16, [600, 3], [100, 40], 128),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_cuda_attention_matches_float64_reference(dtype: torch.dtype, case: int) -> None:
    from kernels.attention import append_attention_cuda

    num_heads, num_kv_heads, head_dim, block_size, query_lens, context_lens, window = CASES[case]
    generator = torch.Generator().manual_seed(1000 + case)
    query, key_cache, value_cache, meta = make_batch(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda", generator
    )
    scale = 1 / math.sqrt(head_dim)
    ref = append_attention_ref(query.double(), key_cache.double(), value_cache.double(), meta, scale, window)
    # half types: the tensor-core variant where it applies (None) and the CUDA-core one (False)
    variants = (None,) if dtype == torch.float32 else (None, False)
    for splits in (None, 1, 3):
        for tensor_cores in variants:
            poison_allocator(tuple(query.shape), dtype, query.device)
            out = append_attention_cuda(
                query,
                key_cache,
                value_cache,
                meta,
                scale,
                window,
                num_splits=splits,
                tensor_cores=tensor_cores,
            )
            torch.cuda.synchronize()
            error = rel_error(out, ref)
            assert error < TOLERANCE[dtype], (
                f"splits={splits}, tensor_cores={tensor_cores}: error {error:.2e}"
            )
    if max(query_lens) <= 256:
        # a CUDA graph's launch: bounds fixed at capture (the prefill class), the tiles each
        # sequence brings found in the kernel
        bounded = dataclasses.replace(meta, max_query_len=256, max_seq_len=max(meta.seq_lens_cpu) + 100)
        poison_allocator(tuple(query.shape), dtype, query.device)
        out = append_attention_cuda(query, key_cache, value_cache, bounded, scale, window)
        torch.cuda.synchronize()
        error = rel_error(out, ref)
        assert error < TOLERANCE[dtype], f"graph bounds: error {error:.2e}"


TREE_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, query_lens, context_lens, trees by sequence)
    (32, 8, 64, 16, [7, 1, 4, 30], [900, 20, 3000, 5], [0, 2]),
    (28, 4, 128, 16, [16, 16, 1, 6], [130, 64, 5000, 40], [0, 1, 3]),
    (8, 8, 64, 16, [64, 33, 2], [300, 7000, 10], [0, 1]),
    (40, 2, 64, 16, [10, 6], [300, 1000], [0]),  # 20 query heads per kv head: CUDA cores only
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(TREE_CASES)))
def test_cuda_tree_attention_matches_reference(dtype: torch.dtype, case: int) -> None:
    from kernels.attention import append_attention_cuda

    num_heads, num_kv_heads, head_dim, block_size, query_lens, context_lens, tree_seqs = TREE_CASES[case]
    generator = torch.Generator().manual_seed(2000 + case)
    rng = random.Random(case)
    query, key_cache, value_cache, meta = make_batch(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda", generator
    )
    meta = with_trees(meta, {s: random_tree(query_lens[s], rng) for s in tree_seqs})
    scale = 1 / math.sqrt(head_dim)
    ref = append_attention_ref(query.double(), key_cache.double(), value_cache.double(), meta, scale)
    variants = (None,) if dtype == torch.float32 else (None, False)
    for splits in (None, 1, 3):
        for tensor_cores in variants:
            poison_allocator(tuple(query.shape), dtype, query.device)
            out = append_attention_cuda(
                query, key_cache, value_cache, meta, scale, num_splits=splits, tensor_cores=tensor_cores
            )
            torch.cuda.synchronize()
            error = rel_error(out, ref)
            assert error < TOLERANCE[dtype], (
                f"splits={splits}, tensor_cores={tensor_cores}: error {error:.2e}"
            )
    bounded = dataclasses.replace(meta, max_query_len=64, max_seq_len=max(meta.seq_lens_cpu) + 100)
    out = append_attention_cuda(query, key_cache, value_cache, bounded, scale)
    torch.cuda.synchronize()
    assert rel_error(out, ref) < TOLERANCE[dtype], "graph bounds"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_write_kv_matches_reference(dtype: torch.dtype) -> None:
    from kernels.attention import write_kv_cuda

    rng = random.Random(3)
    for num_tokens, num_kv_heads, head_dim in [(1, 1, 16), (37, 8, 64), (300, 4, 128)]:
        qkv = torch.randn(num_tokens, (2 + 4) * num_kv_heads * head_dim, device="cuda").to(dtype)
        size = num_kv_heads * head_dim
        # key and value as strided views of a fused projection, as the model passes them
        key = qkv[:, 4 * size : 5 * size].view(num_tokens, num_kv_heads, head_dim)
        value = qkv[:, 5 * size :].view(num_tokens, num_kv_heads, head_dim)
        shape = (64, 16, num_kv_heads, head_dim)
        slots = torch.tensor(rng.sample(range(64 * 16), num_tokens), device="cuda")
        caches = [torch.full(shape, float("nan"), device="cuda", dtype=dtype) for _ in range(4)]
        write_kv_cuda(key, value, caches[0], caches[1], slots)
        write_kv_ref(key, value, caches[2], caches[3], slots)
        assert torch.equal(caches[0].nan_to_num(7.0), caches[2].nan_to_num(7.0))
        assert torch.equal(caches[1].nan_to_num(7.0), caches[3].nan_to_num(7.0))
