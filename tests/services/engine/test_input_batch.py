"""The input batch's host-side per-slot state: block tables kept by deltas, and which requests the
fused verify kernel may verify alone."""

from __future__ import annotations

import numpy as np
import torch

from services.engine.input_batch import MAX_STOP_IDS, UNLIMITED, InputBatch, fused_from
from services.engine.sequence import Sequence
from shared.sampling_params import SamplingParams


def request(request_id: str, **params: object) -> Sequence:
    return Sequence(request_id, [1, 2, 3], SamplingParams(**params), frozenset({0}))


def padded(tables: list[list[int]]) -> np.ndarray:
    width = max(len(table) for table in tables)
    return np.array([table + [0] * (width - len(table)) for table in tables], dtype=np.int32)


def test_block_tables_take_appended_blocks_and_start_empty_for_a_new_request() -> None:
    inputs = InputBatch(max_num_seqs=2, row_capacity=16, max_num_drafts=0, device=torch.device("cpu"))
    first, second = request("a"), request("b")
    first.block_table, second.block_table = [7], [3, 4]
    slots = [inputs.add(first), inputs.add(second)]
    tables = inputs.block_tables
    assert (tables.rows([first, second], slots) == padded([[7], [3, 4]])).all()
    first.block_table += [8, 9, 10, 11, 12]  # wider than any row so far
    assert (tables.rows([first, second], slots) == padded([[7, 8, 9, 10, 11, 12], [3, 4]])).all()
    assert (tables.rows([second], slots[1:]) == padded([[3, 4]])).all()  # as wide as its requests
    inputs.remove("a")
    third = request("c")
    third.block_table = [20, 21, 22, 23, 24, 25]
    slot = inputs.add(third)
    assert slot == slots[0]  # the freed slot, whose row held the first request's six blocks
    assert (tables.rows([third, second], [slot, slots[1]]) == padded([third.block_table, [3, 4]])).all()
    second.block_table = [6]  # a table that shrank is written again whole
    assert (tables.rows([second], slots[1:]) == padded([[6]])).all()


def test_the_fused_kernel_verifies_a_request_alone_unless_its_logits_change_first() -> None:
    assert fused_from(request("plain")) == 0
    assert fused_from(request("sampled", temperature=0.8, top_p=0.95, seed=3)) == 0
    assert fused_from(request("min", min_tokens=5)) == 5  # its EOS suppressed on the torch path till then
    assert fused_from(request("penalty", repetition_penalty=1.2)) == UNLIMITED
    assert fused_from(request("bias", logit_bias={5: 2.0})) == UNLIMITED
    assert fused_from(request("logprobs", logprobs=2)) == UNLIMITED
    many_stops = list(range(10, 11 + MAX_STOP_IDS))
    assert fused_from(request("stops", stop_token_ids=many_stops)) == UNLIMITED
