"""Torch reference for paged append-attention and the KV write.

These are the twins of the CUDA kernels (same signatures); the CPU path and CI run them.

Terms: a *block* holds `block_size` consecutive tokens' keys and values of one sequence; a
sequence's *block table* lists its blocks in order; a token's *slot* is
`block_id * block_size + offset`. Each sequence in a step contributes a *query* of one or more new
tokens (a prefill chunk, a decode token, or 1 + k tokens to verify) that attends causally to the
sequence's whole context, cached tokens first.

A *draft tree* verified in one forward is a query too: its root (the newest accepted token) and then
its nodes, each after its parent (depth-first or level order), whose KV sits in consecutive slots
after the cached context. `AttentionMetadata.tree_mask` tells which of the query's tokens each one
sees: its ancestors and itself (SpecInfer, Miao et al. 2024, "tree attention"). A chain is the tree
whose masks are lower-triangular, which is plain causal attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where each sequence's query tokens sit in the flat batch and in the paged cache."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot each new token's K/V is written to
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cu_num_query_tokens
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int | None = None
    """Launch bound for a CUDA graph: the longest query any replay may bring (None: the longest
    of `query_lens_cpu`). A graph is captured once and replayed with new tensor contents, so the
    launch shape must cover every batch it will see."""
    max_seq_len: int | None = None
    """Launch bound for a CUDA graph: the longest context any replay may bring (None: the longest
    of `seq_lens_cpu`); it sets how many splits the context is cut into."""
    tree_mask: torch.Tensor | None = None
    """[num_tokens] int64 or None (causal everywhere): bit j of a token's mask is set when it sees
    token j of its own query (its ancestors and itself in a draft tree); the cached context is
    seen whole. CAUSAL_MASK for tokens of queries that are not trees (bits past 63 count as set
    only there), so trees hold at most MAX_TREE_NODES tokens; a token never sees a later one."""

    _tile_starts: dict[tuple[int, int], torch.Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def tile_starts(self, tile_tokens: int, max_query_len: int) -> torch.Tensor:
        """[num_seqs + 1] int32 on the device: where each sequence's query tiles of `tile_tokens`
        start in a dense numbering (sequences longer than `max_query_len` have none). Computed on
        the device from `query_start_loc`, so a CUDA graph recomputes it at each replay; once per
        step and tile size, whatever the number of layers."""
        key = (tile_tokens, max_query_len)
        if key not in self._tile_starts:
            starts = self.query_start_loc
            query_lens = starts[1:] - starts[:-1]
            tiles = torch.where(query_lens <= max_query_len, (query_lens + tile_tokens - 1) // tile_tokens, 0)
            cumulative = torch.zeros_like(starts)
            torch.cumsum(tiles, 0, out=cumulative[1:])
            self._tile_starts[key] = cumulative
        return self._tile_starts[key]


def write_kv_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]; negative: skip the token (padding)
) -> None:
    num_kv_heads, head_dim = key_cache.shape[-2:]
    skipped = slot_mapping < 0
    if skipped.any():
        keep = ~skipped
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    key_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = key
    value_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = value


CAUSAL_MASK = -1
"""`tree_mask` of a token that sees every earlier token of its query (all bits set)."""
MAX_TREE_NODES = 64
"""Tokens of the longest query a tree mask can describe (root included): the bits of an int64."""


def check_tree_mask(meta: AttentionMetadata, sliding_window: int | None) -> None:
    """A tree mask is refused beside a sliding window: a tree node's position (its root's plus its
    depth) is not its slot, and the window is measured in positions."""
    if meta.tree_mask is not None and sliding_window is not None:
        raise ValueError("tree attention does not support sliding-window attention")


def ancestor_masks(parents: list[int]) -> list[int]:
    """Tree masks of one query from its parent array (`parents[0] == -1`: the root; every other
    node's parent comes before it): bit j of node i is set when node j is i or an ancestor of i."""
    if len(parents) > MAX_TREE_NODES:
        raise ValueError(f"a draft tree holds at most {MAX_TREE_NODES} nodes, got {len(parents)}")
    masks: list[int] = []
    for i, parent in enumerate(parents):
        if (i == 0) != (parent == -1) or parent >= i:
            raise ValueError(f"node {i} has parent {parent}: the root alone has none, others an earlier node")
        masks.append((masks[parent] if parent >= 0 else 0) | (1 << i))
    return [m - (1 << 64) if m >= 1 << 63 else m for m in masks]  # as signed int64


SHORT_QUERY_MAX = 16
"""Queries up to this many tokens (a decode token, 1 + k tokens to verify) are padded to the
longest of them and attended in one batched call; longer ones (prefill chunks) one call each, where
padding every query to the longest would cost more than the loop saves."""


def append_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new tokens over its paged context (GQA aware), within a
    query restricted to `meta.tree_mask` where given.

    A query token at position `p` sees context positions `c` with `c <= p` and, under a sliding
    window `w`, `p - c < w`. With `softcap`, scores become softcap * tanh(score / softcap) before
    the mask (Gemma-2).
    """
    check_tree_mask(meta, sliding_window)
    out = torch.empty_like(query)
    short = [i for i, n in enumerate(meta.query_lens_cpu) if n <= SHORT_QUERY_MAX]
    if short:
        _padded_attention(query, key_cache, value_cache, meta, short, scale, sliding_window, softcap, out)
    if len(short) == meta.num_seqs:
        return out
    starts = meta.query_start_loc.tolist()
    for i, (query_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if query_len <= SHORT_QUERY_MAX:
            continue
        start = starts[i]
        keys, values = _gather_context(key_cache, value_cache, meta.block_tables[i], seq_len)
        q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = _visible(q_pos[:, None], k_pos[None, :], sliding_window)  # [query_len, seq_len]
        if meta.tree_mask is not None:
            tree = meta.tree_mask[start : start + query_len]
            mask &= _in_tree(tree[:, None], k_pos[None, :] - (seq_len - query_len))
        seq_query = query[start : start + query_len].unsqueeze(0)
        attended = _sdpa(seq_query, keys.unsqueeze(0), values.unsqueeze(0), mask.unsqueeze(0), scale, softcap)
        out[start : start + query_len] = attended[0]
    return out


def _padded_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    rows: list[int],
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]: the rows' tokens are written
) -> None:
    """The sequences `rows`, each query padded to the longest of them, in one batched call.

    A padding slot repeats its sequence's last query token (same position, same visible context),
    so it never sees past the context; its result is dropped."""
    device = query.device
    query_lens_cpu = [meta.query_lens_cpu[i] for i in rows]
    max_query_len = max(query_lens_cpu)
    max_len = max(meta.seq_lens_cpu[i] for i in rows)
    if len(rows) == meta.num_seqs:
        starts, seq_lens, tables = meta.query_start_loc[:-1], meta.seq_lens, meta.block_tables
    else:
        index = torch.tensor(rows, dtype=torch.long, device=device)
        starts, seq_lens, tables = meta.query_start_loc[index], meta.seq_lens[index], meta.block_tables[index]
    query_lens = torch.tensor(query_lens_cpu, dtype=torch.long, device=device)[:, None]  # [num_rows, 1]
    offsets = torch.minimum(torch.arange(max_query_len, device=device)[None, :], query_lens - 1)
    token_ids = starts.long()[:, None] + offsets  # [num_rows, max_query_len]: flat token of each slot
    q_pos = seq_lens.long()[:, None] - query_lens + offsets  # [num_rows, max_query_len]
    k_pos = torch.arange(max_len, device=device)
    mask = _visible(
        q_pos[:, :, None], k_pos[None, None, :], sliding_window
    )  # [num_rows, max_query_len, max_len]
    if meta.tree_mask is not None:
        first = (seq_lens.long() - query_lens[:, 0])[
            :, None, None
        ]  # [num_rows, 1, 1]: the query's first slot
        mask &= _in_tree(meta.tree_mask[token_ids][:, :, None], k_pos[None, None, :] - first)
    block_size = key_cache.shape[1]
    blocks = tables[:, : -(-max_len // block_size)].long().flatten()
    # index_select, not key_cache[blocks]: 2-D advanced indexing is orders of magnitude slower on CPU
    keys = key_cache.index_select(0, blocks).view(len(rows), -1, *key_cache.shape[2:])[:, :max_len]
    values = value_cache.index_select(0, blocks).view(len(rows), -1, *value_cache.shape[2:])[:, :max_len]
    attended = _sdpa(query[token_ids], keys, values, mask, scale, softcap)  # [num_rows, max_query_len, ...]
    real = torch.arange(max_query_len, device=device)[None, :] < query_lens
    out[token_ids[real]] = attended[real]


def _gather_context(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    block_size = key_cache.shape[1]
    blocks = block_table[: -(-seq_len // block_size)].long()
    keys = key_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]  # [seq_len, num_kv_heads, head_dim]
    values = value_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]
    return keys, values


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= q_pos - k_pos < sliding_window
    return mask


def _in_tree(tree_mask: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Whether a query token with `tree_mask` sees the key at `index` within its query (negative:
    the cached context, always seen)."""
    bit = (tree_mask >> index.clamp(0, MAX_TREE_NODES - 1)) & 1
    in_mask = torch.where(index < MAX_TREE_NODES, bit == 1, tree_mask == CAUSAL_MASK)
    return (index < 0) | in_mask


def _sdpa(
    query: torch.Tensor,  # [batch, query_len, num_heads, head_dim]
    keys: torch.Tensor,  # [batch, kv_len, num_kv_heads, head_dim]
    values: torch.Tensor,
    mask: torch.Tensor,  # [batch or 1, query_len, kv_len] bool
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:  # [batch, query_len, num_heads, head_dim]
    # an additive float mask: with a boolean one, grouped-query SDPA takes a slow path on CPU
    bias = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(~mask, float("-inf"))
    q, k, v = query.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
    if softcap is None:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias.unsqueeze(1), scale=scale, enable_gqa=True
        )
    else:
        out = softcapped_attention(q, k, v, bias.unsqueeze(1), scale, softcap)
    return out.transpose(1, 2)


def softcapped_attention(
    query: torch.Tensor,  # [batch, num_heads, query_len, head_dim]
    keys: torch.Tensor,  # [batch, num_kv_heads, kv_len, head_dim]
    values: torch.Tensor,  # [batch, num_kv_heads, kv_len, head_dim]
    bias: torch.Tensor,  # [batch or 1, 1, query_len, kv_len]: 0 where visible, -inf elsewhere
    scale: float,
    softcap: float,
) -> torch.Tensor:  # [batch, num_heads, query_len, head_dim]
    """Attention whose scores are soft-capped (softcap * tanh(score / softcap)) before the mask,
    the softmax in float32; SDPA has no hook for the cap. Differentiable."""
    group = query.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, keys.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap + bias
    weights = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, values)
