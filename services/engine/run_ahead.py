"""A decode step launched *ahead*: before the previous step's result is read back.

The previous step's tail already left on the device what the next decode step feeds the target:
each request's kept tokens at the end of its token row (`InputBatch.num_tokens`) and the drafts its
device proposer made (`InputBatch.drafts`). So the host describes the step by what it knows — which
requests, in which slots, over which blocks, and how many query tokens each brings: its newest
token and one per draft it asked for (`StepPlan.num_wanted` of the previous step) — and the rest is
completed on the device (`fill_from_device`) from those lengths, just before the forward: eager
torch ops after a CUDA graph's copy-in and before its replay (the graphs do not capture them).

A request whose proposer found fewer drafts than it asked for fills the rest of its query with
placeholders: they are never drafts (their rows check none, so the first of them is where
verification stops and samples, as a bonus row would), and their KV, written past the kept tokens,
is rolled back by length like a rejected draft's. The greedy and seeded tokens are those of a
step without them: a row's token depends only on the target's logits there and the row's output
position (kernels/verify_ref.py).
"""

from __future__ import annotations

import numpy as np
import torch

import kernels
from services.engine.cuda_graph import HostStep
from services.engine.input_batch import InputBatch
from services.engine.scheduler import ScheduledBatch
from services.engine.verify_update import StepPlan, StepTensors

PLACEHOLDER_TOKEN_ID = 0
"""The input id of a query position that has no draft (any id the vocabulary has)."""
NO_DRAFT = -1
"""`draft_ids` of a row that checks no draft."""


def ahead_step(
    batch: ScheduledBatch, plan: StepPlan, inputs: InputBatch, block_size: int, max_model_len: int
) -> HostStep:
    """The host's part of a step launched ahead: each request brings `batch.num_new_tokens` query
    tokens (its newest token, then its drafts' places), every one a logit row. Where a token's
    position, id or draft is not known here, the field holds its offset in the request's query
    (positions, row positions, context lengths: the query's length) or a placeholder, for
    `fill_from_device`."""
    seqs = batch.seqs
    lens = np.array(batch.num_new_tokens, dtype=np.int64)
    cu = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    num_tokens = int(cu[-1])
    offsets = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu[:-1], lens)
    slot_list = [inputs.slot_of[seq.request_id] for seq in seqs]
    slots = np.array(slot_list, dtype=np.int64)
    token_slots = np.repeat(slots, lens)
    longest = max(len(seq.block_table) for seq in seqs) * block_size  # every position the step writes
    return HostStep(
        input_ids=np.full(num_tokens, PLACEHOLDER_TOKEN_ID, dtype=np.int64),
        positions=offsets,
        slot_mapping=np.full(num_tokens, -1, dtype=np.int64),
        token_slots=token_slots,
        query_lens=lens.astype(np.int32),
        seq_lens=lens.astype(np.int32),
        block_tables=inputs.block_tables.rows(seqs, slot_list),
        logits_indices=np.arange(num_tokens, dtype=np.int64),
        row_slots=token_slots,
        row_positions=offsets,
        draft_ids=np.full(num_tokens, NO_DRAFT, dtype=np.int32),
        request_of_row=np.repeat(np.arange(len(seqs), dtype=np.int32), lens),
        masked_rows=np.zeros(num_tokens, dtype=np.int32),
        cu_num_rows=cu.astype(np.int32),
        seq_slots=slots,
        seq_rows=np.arange(len(seqs), dtype=np.int64),
        num_output=np.array([seq.num_output_tokens for seq in seqs], dtype=np.int64),
        seq_methods=np.array(plan.methods, dtype=np.int32),
        num_wanted=np.array(plan.num_wanted, dtype=np.int32),
        max_seq_len=min(longest + inputs.max_num_drafts + 1, max_model_len),
    )


def fill_from_device(t: StepTensors, step: HostStep, inputs: InputBatch, block_size: int) -> None:
    """Completes `step` (as `ahead_step` described it) in its device tensors `t`, in place, from
    the device state the previous step's tail left: token j of a request's query sits at its
    newest token's position + j and is that token (j = 0), its draft j - 1, or a placeholder; row
    j checks draft j where there is one."""
    forward, meta = t.forward, t.forward.meta
    num_tokens, num_seqs = step.num_tokens, len(step.query_lens)
    token_slots = forward.token_slots[:num_tokens]
    offsets = forward.positions[:num_tokens]  # [num_tokens] each token's place in its query
    newest = inputs.num_tokens.index_select(0, token_slots).long() - 1
    positions = newest + offsets
    query_lens = t.cu_num_rows[1:] - t.cu_num_rows[:-1]
    request = t.request_of_row[:num_tokens].long()
    num_drafts = torch.minimum(inputs.num_drafts.index_select(0, token_slots), query_lens[request] - 1)
    width = inputs.drafts.shape[1]
    drafts = inputs.drafts[token_slots, offsets.clamp(max=width - 1)]  # draft j, the one row j checks
    before = inputs.drafts[token_slots, (offsets - 1).clamp(0, width - 1)]  # draft j - 1
    newest_ids = inputs.token_rows[token_slots, newest.clamp(min=0)]
    input_ids = torch.where(
        offsets == 0, newest_ids, torch.where(offsets <= num_drafts, before, PLACEHOLDER_TOKEN_ID)
    )
    blocks = meta.block_tables[request, positions // block_size].long()
    seq_slots = t.seq_slots[:num_seqs]
    forward.input_ids[:num_tokens] = input_ids
    meta.slot_mapping[:num_tokens] = blocks * block_size + positions % block_size
    meta.seq_lens[:num_seqs] += inputs.num_tokens.index_select(0, seq_slots) - 1
    t.row_positions[:num_tokens] += inputs.num_output.index_select(0, token_slots).long()
    t.draft_ids[:num_tokens] = torch.where(offsets < num_drafts, drafts, NO_DRAFT)
    forward.positions[:num_tokens] = positions
    if not kernels.cuda_available(positions):  # the attention's torch twin reads lengths on the host
        meta.seq_lens_cpu = meta.seq_lens[:num_seqs].tolist()
    elif meta.max_seq_len is None:  # an eager step: the CUDA kernel's bound, which its host lengths are not
        meta.max_seq_len = step.max_seq_len
