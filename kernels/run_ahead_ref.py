"""Torch reference of the completion of a step launched ahead, from what the device holds.

A decode step is *launched ahead* when the host describes it before the previous step's result is
read back (services/engine/run_ahead.py): the host knows each request's slot, blocks and query
length (its newest token, then one place per draft it asked for), not the tokens. The previous
step's tail left them in the request's slot (services/engine/input_batch.py): its token row and
length, its output count, the drafts it proposed. For token j of a request's query (its *offset*,
counted from the query's first token):

- its position is the request's newest token's (length - 1) + j, its KV slot that position's place
  in the request's blocks (-1, no KV written, outside its block table);
- its input id is the newest token (j = 0), draft j - 1 (1 <= j <= the drafts found, at most
  query length - 1), or `PLACEHOLDER_TOKEN_ID` past the drafts found;
- its logit row checks draft j (j < the drafts found) or none (`NO_DRAFT`: a bonus row, or a
  placeholder's: verification stops there and samples);
- its row samples output position: the request's output count + j;
- the request's context length is its newest token's position + its query length.

Where the step verifies draft trees (a server that drafts them: `tree_mask` given), token j is node
j of the request's tree, whose parent is the slot's `draft_parents[j - 1]` (j <= the drafts found)
or node j - 1 (a placeholder: they hang in a chain under the last draft found; a chain's parents are
j - 1 throughout); a parent outside [0, j - 1] is read as its nearest end. Then:

- its *depth* is its number of ancestors, the root excluded; its position is the newest token's +
  its depth, while its KV slot stays that of the newest token's position + j;
- its row samples output position: the request's output count + its depth;
- its tree mask has bit a set for itself and each ancestor a, the root included
  (kernels/attention_ref.py: a query holds at most MAX_TREE_NODES tokens);
- the request's parent array (`tree_parents`, as far as it is wide) holds node j's parent, -1 at
  the root.

Every written value depends only on what is read, so completing a step twice gives the same step.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kernels.attention_ref import MAX_TREE_NODES

PLACEHOLDER_TOKEN_ID = 0
"""The input id of a query position that has no draft (any id the vocabulary has)."""
NO_DRAFT = -1
"""`draft_ids` of a row that checks no draft."""


class SlotState(Protocol):
    """Per input-batch slot, what the last step's tail left (`InputBatch` is one)."""

    token_rows: torch.Tensor  # [num_slots, capacity] int32 each request's tokens so far
    num_tokens: torch.Tensor  # [num_slots] int32 tokens in each row
    num_output: torch.Tensor  # [num_slots] int32 output tokens of each request
    drafts: torch.Tensor  # [num_slots, width] int32 the drafts proposed for the next step
    num_drafts: torch.Tensor  # [num_slots] int32 drafts found (the rest of the row is not)
    draft_parents: torch.Tensor  # [num_slots, width] int32 each draft's parent node (read for trees only)


def fill_ahead_ref(
    num_filled: torch.Tensor | None,  # [1] int32 leading tokens to complete; None: every token
    token_slots: torch.Tensor,  # [>= num_tokens] int64 slot of each token's request
    request_of_token: torch.Tensor,  # [>= num_tokens] int32 each token's request in the step
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32 each request's first token
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    slots: SlotState,
    input_ids: torch.Tensor,  # [num_tokens] int64, written
    positions: torch.Tensor,  # [num_tokens] int64, written
    slot_mapping: torch.Tensor,  # [num_tokens] int64, written
    seq_lens: torch.Tensor,  # [num_seqs] int32 context lengths, written
    row_positions: torch.Tensor,  # [>= num_tokens] int64 output position each row samples, written
    draft_ids: torch.Tensor,  # [>= num_tokens] int32 the draft each row checks, written
    block_size: int,
    tree_mask: torch.Tensor | None = None,  # [>= num_tokens] int64 each token's tree mask, written
    tree_parents: torch.Tensor | None = None,  # [num_seqs, width] int64 each request's parents, written
) -> None:
    """Completes the step's leading tokens in place (the module docstring's rules); every token
    is a logit row, in the same order. With `tree_mask` the tokens are laid out as trees."""
    num_tokens = capacity(input_ids, request_of_token, row_positions, draft_ids)
    if num_filled is not None:
        num_tokens = min(int(num_filled[0]), num_tokens)
    if num_tokens == 0:
        return
    token_slots = token_slots[:num_tokens]
    request = request_of_token[:num_tokens].long()
    first = query_start_loc[request].long()
    query_len = query_start_loc[request + 1].long() - first
    offset = torch.arange(num_tokens, device=input_ids.device) - first
    newest = slots.num_tokens[token_slots].long() - 1
    found = torch.minimum(slots.num_drafts[token_slots].long(), query_len - 1)
    depth = offset
    if tree_mask is not None:
        depth, tree_mask[:num_tokens], parent = _tree_layout(slots.draft_parents[token_slots], offset, found)
        if tree_parents is not None:
            inside = offset < tree_parents.shape[1]
            tree_parents[request[inside], offset[inside]] = parent[inside]
    kv_position = newest + offset
    width = slots.drafts.shape[1]
    checked = slots.drafts[token_slots, offset.clamp(0, width - 1)].long()  # draft j
    before = slots.drafts[token_slots, (offset - 1).clamp(0, width - 1)].long()  # draft j - 1
    newest_id = slots.token_rows[token_slots, newest.clamp(min=0)].long()
    input_ids[:num_tokens] = torch.where(
        offset == 0, newest_id, torch.where(offset <= found, before, PLACEHOLDER_TOKEN_ID)
    )
    positions[:num_tokens] = newest + depth
    slot_mapping[:num_tokens] = _kv_slots(block_tables, request, kv_position, block_size)
    row_positions[:num_tokens] = slots.num_output[token_slots].long() + depth
    draft_ids[:num_tokens] = torch.where(offset < found, checked, NO_DRAFT).to(draft_ids.dtype)
    starts = offset == 0  # one token per request
    seq_lens[request[starts]] = (kv_position + query_len)[starts].to(seq_lens.dtype)


def _tree_layout(
    draft_parents: torch.Tensor,  # [num_tokens, width] int32 the slot's parents of each token's request
    offset: torch.Tensor,  # [num_tokens] int64 each token's node
    found: torch.Tensor,  # [num_tokens] int64 drafts found by its request
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(depth, tree mask, parent: -1 at the root) of each token's node, walking up to the root."""
    width = draft_parents.shape[1]

    def parent_of(node: torch.Tensor) -> torch.Tensor:  # of nodes >= 1
        stored = draft_parents.gather(1, (node - 1).clamp(0, width - 1)[:, None])[:, 0].long()
        return torch.minimum(torch.where(node <= found, stored, node - 1).clamp(min=0), node - 1)

    parent = torch.where(offset > 0, parent_of(offset), -1)
    node, depth = offset.clone(), torch.zeros_like(offset)
    mask = torch.ones_like(offset)
    one = torch.ones_like(offset)
    while bool((node > 0).any()):
        up = node > 0
        bit = torch.bitwise_left_shift(one, node.clamp(0, MAX_TREE_NODES - 1))
        mask |= torch.where(up & (node < MAX_TREE_NODES), bit, 0)
        depth += up.long()
        node = torch.where(up, parent_of(node), node)
    return depth, mask, parent


def capacity(
    input_ids: torch.Tensor,
    request_of_token: torch.Tensor,
    row_positions: torch.Tensor,
    draft_ids: torch.Tensor,
) -> int:
    """The most tokens a step in these tensors can have: every token is a logit row (a CUDA
    graph's bucket may have fewer rows than tokens)."""
    return min(input_ids.shape[0], request_of_token.shape[0], row_positions.shape[0], draft_ids.shape[0])


def _kv_slots(
    block_tables: torch.Tensor, request: torch.Tensor, position: torch.Tensor, block_size: int
) -> torch.Tensor:
    """[num_tokens] int64 each position's KV slot in its request's blocks, -1 outside its table."""
    block = position // block_size
    inside = (position >= 0) & (block < block_tables.shape[1])
    blocks = block_tables[request, block.clamp(0, block_tables.shape[1] - 1)].long()
    return torch.where(inside, blocks * block_size + position % block_size, -1)
