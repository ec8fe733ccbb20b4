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

Every written value depends only on what is read, so completing a step twice gives the same step.
"""

from __future__ import annotations

from typing import Protocol

import torch

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
) -> None:
    """Completes the step's leading tokens in place (the module docstring's rules); every token
    is a logit row, in the same order."""
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
    position = newest + offset
    found = torch.minimum(slots.num_drafts[token_slots].long(), query_len - 1)
    width = slots.drafts.shape[1]
    checked = slots.drafts[token_slots, offset.clamp(0, width - 1)].long()  # draft j
    before = slots.drafts[token_slots, (offset - 1).clamp(0, width - 1)].long()  # draft j - 1
    newest_id = slots.token_rows[token_slots, newest.clamp(min=0)].long()
    input_ids[:num_tokens] = torch.where(
        offset == 0, newest_id, torch.where(offset <= found, before, PLACEHOLDER_TOKEN_ID)
    )
    positions[:num_tokens] = position
    slot_mapping[:num_tokens] = _kv_slots(block_tables, request, position, block_size)
    row_positions[:num_tokens] = slots.num_output[token_slots].long() + offset
    draft_ids[:num_tokens] = torch.where(offset < found, checked, NO_DRAFT).to(draft_ids.dtype)
    starts = offset == 0  # one token per request
    seq_lens[request[starts]] = (position + query_len)[starts].to(seq_lens.dtype)


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
