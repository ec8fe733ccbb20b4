"""Torch references of a draft tree's verification walk, its KV compaction, the small top-k
that drafts a tree's levels and the inputs of a drafting head's forward over a tree's nodes
(services/engine/tree_verify.py says what the rule and the compaction are; kernels/tree.py holds
their CUDA twins).

Every function here keeps fixed shapes and reads nothing back to the host, so that a CUDA graph's
tail can capture it as it is.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

ROOT = 0
"""Node number of a tree's root: the newest accepted token, which the verify query starts with."""


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
    first; of equal values the lower column first, NaN above every number (a stable descending
    sort)."""
    return torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k].contiguous()


def graft_trees_ref(
    head_parents: torch.Tensor,  # [>= num_head_nodes] int64 the head's tree's parent of node m + 1
    drafts: torch.Tensor,  # [num_seqs, num_branch + num_head_nodes] int32 proposers' rows
    num_drafts: torch.Tensor,  # [num_seqs] int32 how much of each row was drafted (a prefix)
    num_branch: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each request's draft tree from its proposers' row (services/engine/spec_decode/tree.py,
    `drafted_tree`, is the host's rule): the row holds `num_branch` n-gram drafts (-1 past the
    match) then the head's tree in level order, cut at `num_drafts`; the n-gram branch follows the
    head's nodes while they hold its tokens (the last such child where a token repeats under one
    parent) and is grafted as a chain under the last one it reached, after the head's nodes.
    (token_ids [num_seqs, width] int32, -1 past each tree; parents [num_seqs, width] int32, each
    draft's parent node; num_drafts [num_seqs] int32)."""
    num_seqs, width = drafts.shape
    num_head_nodes = width - num_branch
    device = drafts.device
    columns = torch.arange(width, device=device)
    head_parents = head_parents[:num_head_nodes].to(device=device, dtype=torch.int32)
    num_head = (num_drafts - num_branch).clamp(min=0)
    if num_branch == 0:
        parents = torch.cat([head_parents, columns[num_head_nodes:].int()])
        cut = torch.where(columns[None, :] < num_drafts[:, None], drafts, -1)
        return cut, parents.expand(num_seqs, width), num_drafts
    branch = drafts[:, :num_branch]
    head = drafts[:, num_branch:]
    valid = (branch >= 0) & (columns[None, :num_branch] < num_drafts[:, None])
    valid = valid.int().cumprod(dim=1).bool()  # the branch stops at its first -1
    present = columns[None, :num_head_nodes] < num_head[:, None]
    node = torch.zeros(num_seqs, dtype=torch.int32, device=device)  # the root
    following = torch.ones(num_seqs, dtype=torch.bool, device=device)
    num_shared = torch.zeros(num_seqs, dtype=torch.int32, device=device)
    for s in range(num_branch):
        child = present & (head_parents[None, :] == node[:, None]) & (head == branch[:, s : s + 1])
        child &= (following & valid[:, s])[:, None]
        found = child.any(dim=1)
        last = num_head_nodes - 1 - child.flip(1).int().argmax(dim=1)
        node = torch.where(found, last.int() + 1, node)
        num_shared += found.int()
        following &= found
    num_grafted = valid.sum(dim=1).int() - num_shared
    total = num_head + num_grafted
    grafted = columns[None, :] - num_head[:, None]  # index into the grafted chain
    from_branch = branch.gather(1, (num_shared[:, None] + grafted).clamp(0, num_branch - 1).long())
    is_head = columns[None, :] < num_head[:, None]
    is_grafted = ~is_head & (columns[None, :] < total[:, None])
    head_ids = torch.nn.functional.pad(head, (0, num_branch), value=-1)
    token_ids = torch.where(is_head, head_ids, torch.where(is_grafted, from_branch, -1))
    head_parent = torch.nn.functional.pad(head_parents, (0, num_branch))[None, :]
    chained = torch.where(grafted == 0, node[:, None], columns[None, :].int())
    parents = torch.where(is_head, head_parent, chained)
    return token_ids.int(), parents.int(), total.int()


class TreeForwardInputs(NamedTuple):
    """What a drafting head's forward over the nodes of a tree drafted so far reads besides its
    tokens and hidden states (the fields of its `AttentionMetadata` that change with the step)."""

    positions: torch.Tensor  # [num_seqs * num_nodes] int64: node m at the root's position + its depth
    slot_mapping: torch.Tensor  # [num_seqs * num_nodes] int64: node m's KV at the root + m + 1; -1: none
    seq_lens: torch.Tensor  # [num_seqs] int32: the root's position + 1 + num_nodes
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: num_nodes rows per request
    block_tables: torch.Tensor  # [num_seqs, max_blocks + num_nodes / block_size + 1] int32, padded with 0
    tree_mask: torch.Tensor  # [num_seqs * num_nodes] int64: each node's ancestor mask among the nodes


def tree_forward_inputs_ref(
    positions: torch.Tensor,  # [num_tokens] int64 the step's forward's positions
    newest_rows: torch.Tensor,  # [num_seqs] int64 the row of each request's last accepted position
    num_wanted: torch.Tensor,  # [num_seqs] int32 drafts each request wants (0: it drafts nothing)
    block_tables: torch.Tensor,  # [num_step_seqs, max_blocks] int32 the step's block tables
    seq_rows: torch.Tensor,  # [num_seqs] int64 each request's row of `block_tables`
    node_depths: torch.Tensor,  # [>= num_nodes] int64 each node's depth past the root (level order)
    node_masks: torch.Tensor,  # [>= num_nodes] int64 each node's ancestor mask among the nodes
    num_nodes: int,
    block_size: int,
) -> TreeForwardInputs:
    """The inputs of a head's forward over the first `num_nodes` nodes past each request's root
    (its last accepted position, `positions[newest_rows]`): node m at the root's position + its
    depth, its KV at the root's position + m + 1, the request's context ending after the nodes.
    Requests that draft nothing write no KV and sit at position 0; their padded block tables keep
    their rows in range (a KV position past a padded table reads its last column)."""
    device = positions.device
    num_seqs = newest_rows.shape[0]
    drafting = num_wanted > 0
    base = torch.where(drafting, positions.index_select(0, newest_rows), 0)
    node_positions = base[:, None] + node_depths[:num_nodes]  # [num_seqs, num_nodes]
    kv_positions = base[:, None] + torch.arange(1, num_nodes + 1, device=device)
    extra = -(-num_nodes // block_size) + 1
    tables = torch.nn.functional.pad(block_tables.index_select(0, seq_rows), (0, extra))
    columns = (kv_positions // block_size).clamp(max=tables.shape[1] - 1)
    blocks = tables.gather(1, columns).long()
    slots = torch.where(drafting[:, None], blocks * block_size + kv_positions % block_size, -1)
    return TreeForwardInputs(
        positions=node_positions.flatten(),
        slot_mapping=slots.flatten(),
        seq_lens=(base + 1 + num_nodes).int(),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * num_nodes,
        block_tables=tables,
        tree_mask=node_masks[:num_nodes].repeat(num_seqs),
    )
