"""Driving the serving path by hand in tests: one sequence, two prefill chunks, scattered blocks."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kernels import AttentionMetadata
from shared.model.llama import LlamaForCausalLM
from shared.model.parallel import num_local_kv_heads


@dataclass
class Chunk:
    start: int
    end: int
    meta: AttentionMetadata

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(self.start, self.end)


def num_cache_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks to allocate: those the sequence uses plus spares, so its table is not 0..n-1."""
    return -(-num_tokens // block_size) + 2


def two_chunks(num_tokens: int, block_size: int) -> Iterator[Chunk]:
    """Metadata for prefilling `num_tokens` in two chunks over out-of-order blocks (the block table
    runs backwards through the cache), exercising the paged layout the engine uses."""
    num_used = -(-num_tokens // block_size)
    block_table = list(reversed(range(num_cache_blocks(num_tokens, block_size))))[:num_used]
    split = num_tokens // 2
    for start, end in ((0, split), (split, num_tokens)):
        slots = [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        yield Chunk(
            start,
            end,
            AttentionMetadata(
                slot_mapping=torch.tensor(slots),
                query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
                seq_lens=torch.tensor([end], dtype=torch.int32),
                block_tables=torch.tensor([block_table], dtype=torch.int32),
                query_lens_cpu=[end - start],
                seq_lens_cpu=[end],
            ),
        )


def empty_cache(
    num_tokens: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_cache_blocks(num_tokens, block_size), block_size, num_kv_heads, head_dim)
    return torch.zeros(shape), torch.zeros(shape)


def prefill_logits(model: LlamaForCausalLM, token_ids: list[int], block_size: int = 4) -> torch.Tensor:
    """Prefills one sequence in two chunks through a fresh paged cache (this rank's heads under tensor
    parallelism); [len(token_ids), vocab] logits."""
    config = model.config
    kv = [
        empty_cache(len(token_ids), block_size, num_local_kv_heads(config, model.tp), config.head_dim)
        for _ in range(config.num_hidden_layers)
    ]
    logits = []
    for chunk in two_chunks(len(token_ids), block_size):
        hidden = model(torch.tensor(token_ids[chunk.start : chunk.end]), chunk.positions, kv, chunk.meta)
        logits.append(model.compute_logits(hidden))
    return torch.cat(logits)
