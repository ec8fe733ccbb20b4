"""Paged append-attention and the KV write: CUDA kernel vs torch reference vs plain loops."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from kernels.attention_ref import AttentionMetadata, append_attention_ref, write_kv_ref
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
) -> torch.Tensor:
    """Token by token, head by head, in float64."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    starts = meta.query_start_loc.tolist()
    for s, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        table = meta.block_tables[s].tolist()
        for i in range(q_len):
            pos = seq_len - q_len + i
            visible = [c for c in range(pos + 1) if window is None or pos - c < window]
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
