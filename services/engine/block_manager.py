"""Paged KV-cache bookkeeping: which blocks each sequence owns, and the prefix cache.

Prefix caching: a block that is full of known tokens is keyed by a chained hash of its token ids
(the hash of the previous block folded in), so equal prefixes map to equal keys. Cached blocks are
reference-counted and shared between sequences; when no sequence holds one it stays cached on the
free list and is evicted least-recently-freed first, only when a fresh block is needed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from services.engine.sequence import Sequence

NO_HASH = -1


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int = NO_HASH
    token_ids: tuple[int, ...] = field(default_factory=tuple)


def chain_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- admission: prefix-cache look-up and allocation -------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of `seq`, leaving at least one token to compute
        (none for a request that scores its prompt: cached blocks come without their logits)."""
        if not self.enable_prefix_caching or seq.scores_prompt:
            return []
        matched: list[int] = []
        parent = NO_HASH
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = chain_hash(parent, tokens)
            block_id = self.cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            matched.append(block_id)
        return matched

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_block_ids: list[int]) -> bool:
        """Whether `seq` can be admitted with its cached prefix plus `num_new_tokens` computed now."""
        num_cached_tokens = len(cached_block_ids) * self.block_size
        needed = self.blocks_needed(num_cached_tokens + num_new_tokens) - len(cached_block_ids)
        reusable_free = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        return needed <= self.num_free_blocks - reusable_free

    def allocate(self, seq: Sequence, cached_block_ids: list[int]) -> None:
        """Gives `seq` its cached prefix blocks; the rest comes from `append_slots`."""
        assert not seq.block_table
        self.num_prefix_queries += seq.num_tokens
        for block_id in cached_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(block.block_hash)
        num_cached = len(cached_block_ids) * self.block_size
        self.num_prefix_hits += num_cached
        seq.num_computed_tokens = num_cached
        seq.num_cached_prompt_tokens = min(num_cached, seq.num_prompt_tokens)

    # ---- growth during prefill chunks and decode -------------------------------------------------

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Makes room for `num_new_tokens` more KV entries after `seq.num_computed_tokens`."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Registers every block whose tokens are all computed, so later requests can share it."""
        if not self.enable_prefix_caching:
            return
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // self.block_size):
            parent = seq.block_hashes[-1] if seq.block_hashes else NO_HASH
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block_hash = chain_hash(parent, tokens)
            seq.block_hashes.append(block_hash)
            block = self.blocks[seq.block_table[i]]
            if block.block_hash != NO_HASH or block_hash in self.cached:
                continue  # shared from the cache already, or an identical block is cached: keep private
            block.block_hash, block.token_ids = block_hash, tokens
            self.cached[block_hash] = block.block_id

    def free(self, seq: Sequence) -> None:
        """Releases the blocks of a finished or preempted sequence.

        Tail blocks go onto the free list first, so they are evicted before the shared-prefix blocks.
        """
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash != NO_HASH:
            del self.cached[block.block_hash]
            block.block_hash, block.token_ids = NO_HASH, ()
        block.ref_count = 1
        return block_id
