"""Paged append-attention and the KV write: CUDA kernel vs torch reference vs plain loops."""

from __future__ import annotations

import dataclasses
import math
import random
import subprocess

import numpy as np
import pytest
import torch

from kernels.attention_ref import (
    CAUSAL_MASK,
    AttentionMetadata,
    ancestor_masks,
    append_attention_ref,
    write_kv_ref,
)
from tests.kernels.helpers import (
    needs_cuda,
    needs_gxx,
    needs_nvcc,
    poison_allocator,
    rel_error,
    run_on_host,
)


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


# ---- the split rule (`min_split_keys`) ----


def split_keys(span: int, num_splits: int, min_keys: int, block_n: int = 64) -> tuple[int, int]:
    """The kernels' `split_keys`: (splits used, keys per split) of a query tile's context span."""
    per_split = max(-(-span // num_splits), min_keys)
    per_split = -(-per_split // block_n) * block_n
    return max(1, min(num_splits, -(-span // per_split))), per_split


@pytest.mark.parametrize("min_keys", [64, 128, 256, 1024])
def test_split_rule_covers_the_context_with_nonempty_splits(min_keys: int) -> None:
    for span in [1, 63, 64, 65, 100, 256, 257, 1000, 4096, 8193]:
        for num_splits in [1, 2, 3, 4, 33, 64]:
            used, per_split = split_keys(span, num_splits, min_keys)
            assert 1 <= used <= num_splits and per_split % 64 == 0
            assert (used - 1) * per_split < span <= used * per_split  # every used split has keys
            assert used == 1 or per_split >= min_keys


def test_choose_splits_honours_min_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels import _cuda, attention

    monkeypatch.setattr(_cuda, "num_sms", lambda index: 132)
    device = torch.device("cuda", 0)
    assert attention.choose_splits(8, 256, device) == 4  # batch 1, 8 kv heads, 256 keys: 64-key splits
    assert attention.choose_splits(8, 256, device, 256) == 1
    assert attention.choose_splits(8, 8192, device, 256) == 32  # a graph's bound: used per tile in-kernel
    assert attention.choose_splits(264, 8192, device) == 1  # the blocks cover the SMs
    monkeypatch.setenv(attention.MIN_SPLIT_KEYS_ENV, "100")
    assert attention.min_split_keys() == 128  # whole tiles
    monkeypatch.delenv(attention.MIN_SPLIT_KEYS_ENV)
    assert attention.min_split_keys() == attention.MIN_KEYS_PER_SPLIT


HOST_MERGE_SHIM = r"""
#include <cmath>
#include <cstring>
struct uint4 { unsigned int x, y, z, w; };
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
using std::exp2f; using std::fmaxf;
"""


def merge_source() -> str:
    """merge_splits and the split rule it shares, as C++ the host can run (float32 variant)."""
    from kernels import _cuda
    from kernels.attention import SOURCE

    rule = SOURCE[SOURCE.index("__device__ __forceinline__ int split_keys") :]
    rule = rule[: rule.index("\n}\n") + 3]
    merge = SOURCE[SOURCE.index('extern "C" __global__ void merge_splits') :]
    merge = merge[: merge.index("\n}\n") + 3]
    neg_inf = "#define NEG_INF (-__int_as_float(0x7f800000))\n"
    return HOST_MERGE_SHIM + _cuda.CONVERSIONS + neg_inf + rule + merge.replace('extern "C" ', "")


@needs_gxx
@pytest.mark.parametrize("min_keys", [64, 256])
def test_merge_splits_merges_only_the_splits_a_tile_used_on_the_host(min_keys: int, tmp_path) -> None:
    """merge_splits run on the host (kernels/attention.py): a tile whose context one split covers
    keeps the output its block wrote; the others get the merge of their used splits only (the
    unused splits' partials are poisoned)."""
    head_dim, num_heads, num_splits, tile_tokens = 16, 2, 8, 4
    query_lens, seq_lens = [1, 6, 3], [200, 900, 70]  # tiles of 4 tokens: 1 + 2 + 1
    cu = [0, 1, 7, 10]
    num_tokens = cu[-1] + 2  # two padding tokens past the last sequence
    generator = torch.Generator().manual_seed(5)
    part_out = torch.randn(num_splits, num_tokens, num_heads, head_dim, generator=generator)
    part_ml = torch.stack(
        [
            torch.randn(num_splits, num_tokens, num_heads, generator=generator) * 3,
            torch.rand(num_splits, num_tokens, num_heads, generator=generator) + 0.5,
        ],
        dim=-1,
    )
    expected = torch.full((num_tokens, num_heads, head_dim), 7.0)
    used_by_token = {}
    for seq, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        for t in range(q_len):
            t0 = t // tile_tokens * tile_tokens
            kv_end = seq_len - q_len + t0 + min(tile_tokens, q_len - t0)
            used, _ = split_keys(kv_end, num_splits, min_keys)
            used_by_token[cu[seq] + t] = used
    for token, used in used_by_token.items():
        part_out[used:, token] = float("nan")
        part_ml[used:, token] = float("nan")
        if used > 1:
            maxes, sums = part_ml[:used, token, :, 0], part_ml[:used, token, :, 1]
            weight = torch.exp2(maxes - maxes.max(0).values)
            expected[token] = (weight[..., None] * part_out[:used, token]).sum(0) / (weight * sums).sum(0)[
                :, None
            ]
    out = torch.full((num_tokens, num_heads, head_dim), 7.0)
    args = (
        part_out,
        part_ml,
        torch.tensor(cu, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        out,
        np.int32(3),
        np.int32(num_tokens),
        np.int32(num_heads),
        np.int32(num_splits),
        np.int32(16),
        np.int32(tile_tokens),
        np.int32(0),
        np.int32(min_keys),
    )
    defines = {"DTYPE": 0, "HEAD_DIM": head_dim, "BLOCK_N": 64}
    run_on_host(
        merge_source(), "merge_splits", defines, (num_tokens * num_heads,), (head_dim,), args, tmp_path
    )
    assert sorted(set(used_by_token.values())) != [1]  # some tiles merge
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-6)


@needs_nvcc
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tensor_core_attention_and_merge_assemble_for_sm90_without_spills(head_dim: int, tmp_path) -> None:
    """The decode path (the tensor-core variant, merge_splits) assembles without spills. (The
    CUDA-core variant, the fallback for float32 and wide heads, spills a few bytes.)"""
    from kernels import _cuda
    from kernels.attention import SOURCE
    from tests.kernels.helpers import _kernel_reports

    source = tmp_path / "attention.cu"
    source.write_text(SOURCE)
    defines = [
        f"-D{k}={v}"
        for k, v in {"DTYPE": 1, "HEAD_DIM": head_dim, "RMAX": 16, "BLOCK_N": 64, "THREADS": 128}.items()
    ]
    command = [
        "nvcc",
        "-cubin",
        "-arch=sm_90",
        *_cuda.NVRTC_OPTIONS,
        "-Xptxas=-v",
        "-o",
        str(tmp_path / "a.cubin"),
    ]
    result = subprocess.run([*command, str(source), *defines], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = _kernel_reports(result.stderr)
    for kernel in ("append_attention_mma", "merge_splits"):
        assert "0 bytes spill stores, 0 bytes spill loads" in reports[kernel], reports[kernel]


DECODE_CASES = [  # (num_heads, num_kv_heads, head_dim, query_lens, context_lens): batch-1 decode and verify
    (32, 8, 64, [1], [255]),
    (32, 8, 64, [1], [1023]),
    (32, 8, 64, [1], [4095]),
    (28, 4, 128, [6], [250]),
    (32, 8, 64, [1, 6, 1], [40, 3000, 700]),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
def test_cuda_attention_min_split_keys_under_a_graph_bound(
    dtype: torch.dtype, case: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A graph launches splits for its longest context (max_seq_len); each tile uses only those its
    own context fills with min_split_keys keys, one split writing its output itself."""
    from kernels.attention import MIN_SPLIT_KEYS_ENV, append_attention_cuda

    num_heads, num_kv_heads, head_dim, query_lens, context_lens = DECODE_CASES[case]
    generator = torch.Generator().manual_seed(3000 + case)
    query, key_cache, value_cache, meta = make_batch(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, 16, dtype, "cuda", generator
    )
    scale = 1 / math.sqrt(head_dim)
    ref = append_attention_ref(query.double(), key_cache.double(), value_cache.double(), meta, scale)
    bounded = dataclasses.replace(meta, max_query_len=8, max_seq_len=8192)
    for min_keys in (64, 128, 256, 1024, 1 << 20):
        monkeypatch.setenv(MIN_SPLIT_KEYS_ENV, str(min_keys))
        for splits in (None, 33):
            for batch_meta in (meta, bounded):
                poison_allocator(tuple(query.shape), dtype, query.device)
                out = append_attention_cuda(
                    query, key_cache, value_cache, batch_meta, scale, num_splits=splits
                )
                torch.cuda.synchronize()
                error = rel_error(out, ref)
                assert error < TOLERANCE[dtype], f"min keys {min_keys}, splits {splits}: {error:.2e}"
