"""What a draft tree costs the paged append-attention against a chain of the same token count.

    python -m benchmarks.tree_attention [--tree 3,2,1] [--batch-sizes 1 16 64] [--context 1024]

Every request verifies 1 + drafts query tokens over `context` cached tokens, once as a chain
(causal, no mask: the kernel variant chain verification runs) and once as the tree (its ancestor
masks: the TREE variant); the ratio is tree time / chain time. On a GPU the CUDA kernel is timed
with CUDA events, elsewhere the torch twin with the wall clock. Heads of Llama-3.2-1B's shape by
default (32 query heads, 8 kv heads, head_dim 64).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from kernels import append_attention
from kernels.attention_ref import AttentionMetadata
from services.engine.spec_decode.tree import DraftTree

BLOCK_SIZE = 16


def batch_inputs(
    batch: int, query_len: int, context: int, heads: tuple[int, int, int], dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random queries and caches, each request in blocks of its own."""
    num_heads, num_kv_heads, head_dim = heads
    seq_len = context + query_len
    blocks = -(-seq_len // BLOCK_SIZE)
    tables = torch.arange(batch * blocks, dtype=torch.int32, device=device).view(batch, blocks)
    cache_shape = (batch * blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, device=device).to(dtype)
    value_cache = torch.randn(cache_shape, device=device).to(dtype)
    query = torch.randn(batch * query_len, num_heads, head_dim, device=device).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch * query_len, dtype=torch.long, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device) * query_len,
        seq_lens=torch.full((batch,), seq_len, dtype=torch.int32, device=device),
        block_tables=tables,
        query_lens_cpu=[query_len] * batch,
        seq_lens_cpu=[seq_len] * batch,
    )
    return query, key_cache, value_cache, meta


def time_ms(
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], device: str, reps: int
) -> float:
    """Median of `reps` timed attention calls over `inputs` after a warm-up."""

    def run() -> None:
        append_attention(*inputs)

    run()
    times = []
    for _ in range(reps):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            run()
            times.append((time.perf_counter() - started) * 1e3)
    return sorted(times)[len(times) // 2]


def measure(args: argparse.Namespace) -> list[dict[str, float | int]]:
    tree = DraftTree(tuple(args.tree))
    query_len = tree.num_nodes()
    rows = []
    for batch in args.batch_sizes:
        query, key_cache, value_cache, meta = batch_inputs(
            batch, query_len, args.context, tuple(args.heads), getattr(torch, args.dtype), args.device
        )
        masks = torch.tensor(tree.masks * batch, dtype=torch.long, device=args.device)
        tree_meta = dataclasses.replace(meta, tree_mask=masks)
        scale = args.heads[2] ** -0.5
        chain_ms = time_ms((query, key_cache, value_cache, meta, scale), args.device, args.reps)
        tree_ms = time_ms((query, key_cache, value_cache, tree_meta, scale), args.device, args.reps)
        rows.append(
            {
                "batch": batch,
                "query_len": query_len,
                "chain_ms": chain_ms,
                "tree_ms": tree_ms,
                "ratio": tree_ms / chain_ms,
            }
        )
        print(
            f"batch {batch:4d}: chain {chain_ms:.4f} ms, tree {tree_ms:.4f} ms, ratio {tree_ms / chain_ms:.3f}"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tree", type=lambda s: [int(b) for b in s.split(",")], default=[3, 2, 1])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument(
        "--heads", type=int, nargs=3, default=[32, 8, 64], help="query heads, kv heads, head_dim"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rows = measure(args)
    if args.out:
        args.out.write_text(
            json.dumps({"settings": vars(args) | {"out": str(args.out)}, "results": rows}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
