"""Torch references of a draft tree's verification walk, its KV compaction and the small top-k
that drafts a tree's levels (services/engine/tree_verify.py says what the rule and the compaction
are; kernels/tree.py holds their CUDA twins).

Every function here keeps fixed shapes and reads nothing back to the host, so that a CUDA graph's
tail can capture it as it is.
"""

from __future__ import annotations

import torch

ROOT = 0
"""A tree's root node: the request's newest token before the step (row 0 of its query)."""


def verify_tree_ref(
    target_ids: torch.Tensor,  # [num_rows] int64: the target token of every row
    draft_ids: torch.Tensor,  # [num_rows] int32: row j of a request holds node j + 1's token, -1 on its last row
    cu_num_rows: torch.Tensor,  # [num_seqs + 1] int32: a request's rows are its tree's nodes
    parents: torch.Tensor,  # [num_seqs, max_rows] int64: each request's parent array (a chain: j - 1), -1 past its rows
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The accepted path of every request: (token_ids [num_seqs, max_rows] int32: the accepted
    drafts, then the target token of the last accepted node, -1 after; num_accepted [num_seqs]
    int32; path [num_seqs, max_rows] int64: the accepted node at each depth, the last one repeated
    past it). At each node the walk goes on to its first child (in row order) whose token equals
    the node's target token."""
    device = target_ids.device
    num_nodes = parents.shape[1]
    starts = cu_num_rows[:-1].long()
    num_rows = (cu_num_rows[1:] - cu_num_rows[:-1]).long()
    nodes = torch.arange(num_nodes, device=device)
    rows = (starts[:, None] + nodes).clamp(max=target_ids.shape[0] - 1)  # [num_seqs, num_nodes]
    present = (nodes < num_rows[:, None]) & (nodes != ROOT)
    targets = target_ids[rows]
    node_ids = torch.where(present, draft_ids.long()[(rows - 1).clamp(min=0)], -1)
    matches = present & (node_ids == targets.gather(1, parents.clamp(min=0)))  # [num_seqs, num_nodes]
    current = torch.zeros_like(num_rows)
    path = [current]
    for _ in range(num_nodes - 1):
        children = (parents == current[:, None]) & matches
        found = children.any(dim=1)
        current = torch.where(found, children.int().argmax(dim=1), current)
        path.append(current)
    steps = torch.stack(path, dim=1)  # [num_seqs, num_nodes]
    num_accepted = (steps[:, 1:] != steps[:, :-1]).sum(dim=1)
    path_ids = torch.nn.functional.pad(node_ids.gather(1, steps[:, 1:]), (0, 1), value=-1)
    last = targets.gather(1, current[:, None])
    columns = nodes[None, :]
    token_ids = torch.where(columns < num_accepted[:, None], path_ids, -1)
    token_ids = torch.where(columns == num_accepted[:, None], last, token_ids)
    return token_ids.int(), num_accepted.int(), steps


def compact_path_kv_ref(
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    path: torch.Tensor,  # [num_seqs, max_rows] int64 (verify_tree's path)
    num_accepted: torch.Tensor,  # [num_seqs] int32
    root_positions: torch.Tensor,  # [num_seqs] int64: each request's root position
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    block_size: int,
) -> None:
    """Moves the KV of each accepted path's node at depth d from position root + node to root + d,
    in every layer of `caches`; every entry is read before any is written.

    Every (request, depth) pair copies one entry. A pair with nothing to move repeats the first pair
    that moves (the same source and destination, so the repeated writes agree), or, where no pair
    moves, copies the first pair's destination onto itself."""
    if path.shape[1] < 2:
        return
    depths = torch.arange(1, path.shape[1], device=path.device)[None, :]
    moved = ((depths <= num_accepted[:, None].long()) & (path[:, 1:] != depths)).flatten()
    roots = root_positions[:, None].long()
    sources = _slots(roots + path[:, 1:], block_tables, block_size).flatten()
    destinations = _slots(roots + depths, block_tables, block_size).flatten()
    first = moved.int().argmax(dim=0, keepdim=True)  # the first pair that moves; 0 where none does
    first_source = torch.where(moved[first], sources[first], destinations[first])
    sources = torch.where(moved, sources, first_source)
    destinations = torch.where(moved, destinations, destinations[first])
    for key_cache, value_cache in caches:
        for cache in (key_cache, value_cache):
            flat = cache.view(-1, *cache.shape[2:])
            flat[destinations] = flat[sources]


def _slots(positions: torch.Tensor, tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of `positions` ([num_seqs, n] int64) under each request's block table (`tables`
    [num_seqs, max_blocks]); positions past a table read its last entry (pairs that move nothing)."""
    blocks = tables.gather(1, (positions // block_size).clamp(0, tables.shape[1] - 1)).long()
    return blocks * block_size + positions % block_size


def top_k_ids_ref(logits: torch.Tensor, k: int) -> torch.Tensor:  # [num_rows, k] int64
    """The columns of each row's k largest entries of `logits` ([num_rows, vocab] float32), largest
    first; of equal values the lower column first (a stable descending sort)."""
    return torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k].contiguous()
