"""A decode step launched *ahead*: before the previous step's result is read back.

The previous step's tail already left on the device what the next decode step feeds the target:
each request's kept tokens at the end of its token row (`InputBatch.num_tokens`) and the drafts its
device proposer made (`InputBatch.drafts`). So the host describes the step by what it knows — which
requests, in which slots, over which blocks, and how many query tokens each brings: its newest
token and one per draft it asked for (`StepPlan.num_wanted` of the previous step) — and the rest is
completed on the device (`StepTensors.complete_ahead`, one kernel: kernels/run_ahead_ref.py gives
the rules) just before the forward. A CUDA-graph step's forward graph begins with that kernel, which
reads from the copied-in inputs how many tokens to complete, so the replay needs no launch before it
(services/engine/cuda_graph.py); an eager step launches it after moving its inputs.

A request whose proposer found fewer drafts than it asked for fills the rest of its query with
placeholders: they are never drafts (their rows check none, so the first of them is where
verification stops and samples, as a bonus row would), and their KV, written past the kept tokens,
is rolled back by length like a rejected draft's. The greedy and seeded tokens are those of a
step without them: a row's token depends only on the target's logits there and the row's output
position (kernels/verify_ref.py).

On a server that drafts trees the same kernel lays each request's tree out from the parents its
drafts were kept with (`InputBatch.draft_parents`; a chain's are j - 1): each token's tree mask,
its position at the root's + its depth, its row's output position by depth and the request's
parent array. Placeholders hang in a chain under the last draft found; their token matches no
target's, so the tree rule never accepts them (services/engine/tree_verify.py).

A step with grammar rows is launched ahead in two parts: its forward before the step in flight
lands, its tail (verify with the masks) after, once the host has advanced each grammar by the
tokens that step kept and filled the masks while the forward runs (`ModelRunner.launch_tail`). Only
requests that verify no drafts run so (services/engine/engine.py says why).
"""

from __future__ import annotations

import numpy as np

from kernels.attention_ref import CAUSAL_MASK
from kernels.run_ahead_ref import NO_DRAFT, PLACEHOLDER_TOKEN_ID
from services.engine.cuda_graph import HostStep
from services.engine.input_batch import InputBatch
from services.engine.scheduler import ScheduledBatch
from services.engine.verify_update import StepPlan


def ahead_step(
    batch: ScheduledBatch,
    plan: StepPlan,
    inputs: InputBatch,
    block_size: int,
    max_model_len: int,
    trees: bool = False,
) -> HostStep:
    """The host's part of a step launched ahead: each request brings `batch.num_new_tokens` query
    tokens (its newest token, then its drafts' places), every one a logit row. What the device
    completes (the tokens' ids, positions, KV slots, row positions and drafts, the context
    lengths; with `trees`, the tree masks and parent arrays) holds placeholders here; the context
    lengths hold the query lengths."""
    seqs = batch.seqs
    lens = np.array(batch.num_new_tokens, dtype=np.int64)
    cu = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    num_tokens = int(cu[-1])
    slot_list = [inputs.slot_of[seq.request_id] for seq in seqs]
    slots = np.array(slot_list, dtype=np.int64)
    token_slots = np.repeat(slots, lens)
    tables = inputs.block_tables.rows(seqs, slot_list)
    unknown = np.zeros(num_tokens, dtype=np.int64)
    query_lens = lens.astype(np.int32)
    has_grammar = np.array([seq.grammar is not None for seq in seqs], dtype=np.int32)
    return HostStep(
        input_ids=np.full(num_tokens, PLACEHOLDER_TOKEN_ID, dtype=np.int64),
        positions=unknown,
        slot_mapping=np.full(num_tokens, -1, dtype=np.int64),
        token_slots=token_slots,
        query_lens=query_lens,
        seq_lens=query_lens,
        block_tables=tables,
        logits_indices=np.arange(num_tokens, dtype=np.int64),
        row_slots=token_slots,
        row_positions=unknown,
        draft_ids=np.full(num_tokens, NO_DRAFT, dtype=np.int32),
        request_of_row=np.repeat(np.arange(len(seqs), dtype=np.int32), lens),
        masked_rows=np.repeat(has_grammar, lens),
        cu_num_rows=cu.astype(np.int32),
        seq_slots=slots,
        seq_rows=np.arange(len(seqs), dtype=np.int64),
        num_output=np.zeros(len(seqs), dtype=np.int64),
        seq_methods=np.array(plan.methods, dtype=np.int32),
        num_wanted=np.array(plan.num_wanted, dtype=np.int32),
        # every position the step writes lies in its requests' blocks
        max_seq_len=min(tables.shape[1] * block_size + inputs.max_num_drafts + 1, max_model_len),
        tree_mask=np.full(num_tokens, CAUSAL_MASK, dtype=np.int64) if trees else None,
        tree_parents=np.full((len(seqs), int(lens.max(initial=1))), -1, dtype=np.int64) if trees else None,
        ahead=True,
    )
