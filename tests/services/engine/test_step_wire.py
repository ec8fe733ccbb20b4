"""A step as one bytes message (what rank 0 sends its tensor-parallel followers): what arrives
equals what left, field by field, with and without the rare parts."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from services.engine.cuda_graph import HostStep
from services.engine.input_batch import SlotJoin
from services.engine.prompt_logprobs import PromptRows
from services.engine.step_wire import pack_step, unpack_step
from services.engine.tensor_parallel import StepCommand, Stop, decode, encode


def random_step(num_seqs: int, rows_each: int, num_blocks: int, seed: int = 0) -> HostStep:
    """A step of `num_seqs` requests of `rows_each` query tokens, every one a logit row."""
    rng = np.random.default_rng(seed)
    num_tokens = num_seqs * rows_each

    def ints(n: int, dtype: type) -> np.ndarray:
        return rng.integers(-1, 1000, n).astype(dtype)

    return HostStep(
        input_ids=ints(num_tokens, np.int64),
        positions=ints(num_tokens, np.int64),
        slot_mapping=ints(num_tokens, np.int64),
        token_slots=ints(num_tokens, np.int64),
        query_lens=ints(num_seqs, np.int32),
        seq_lens=ints(num_seqs, np.int32),
        block_tables=rng.integers(0, 99, (num_seqs, num_blocks)).astype(np.int32),
        logits_indices=ints(num_tokens, np.int64),
        row_slots=ints(num_tokens, np.int64),
        row_positions=ints(num_tokens, np.int64),
        draft_ids=ints(num_tokens, np.int32),
        request_of_row=ints(num_tokens, np.int32),
        masked_rows=ints(num_tokens, np.int32),
        cu_num_rows=ints(num_seqs + 1, np.int32),
        seq_slots=ints(num_seqs, np.int64),
        seq_rows=ints(num_seqs, np.int64),
        num_output=ints(num_seqs, np.int64),
        seq_methods=ints(num_seqs, np.int32),
        num_wanted=ints(num_seqs, np.int32),
        max_seq_len=int(rng.integers(1, 4096)),
    )


def assert_same_step(got: HostStep, sent: HostStep) -> None:
    for field in dataclasses.fields(HostStep):
        a, b = getattr(got, field.name), getattr(sent, field.name)
        if isinstance(b, np.ndarray):
            assert isinstance(a, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, field.name
            assert np.array_equal(a, b), field.name
            assert a.flags.writeable, field.name  # torch.from_numpy takes it without a warning
        elif isinstance(b, PromptRows):
            assert isinstance(a, PromptRows)
            assert np.array_equal(a.token_indices, b.token_indices) and a.segments == b.segments
        else:
            assert a == b, field.name


@pytest.mark.parametrize("num_seqs, rows_each, num_blocks", [(1, 1, 1), (64, 4, 7), (3, 2, 0)])
def test_a_step_arrives_as_it_left(num_seqs: int, rows_each: int, num_blocks: int) -> None:
    step = random_step(num_seqs, rows_each, num_blocks)
    got, numbers, extra = unpack_step(pack_step(step, [3, -1, 1, 0]))
    assert_same_step(got, step)
    assert numbers == [3, -1, 1, 0] and extra is None


def test_rare_parts_and_other_dtypes_travel_pickled_in_the_same_message() -> None:
    step = random_step(2, 3, 2, seed=1)
    step.tree_mask = np.arange(6, dtype=np.int64)
    step.masked_rows = step.masked_rows.astype(np.int8)  # a dtype that does not travel raw
    step.tree_parents = np.array([[-1, 0, 1], [-1, 0, 0]], dtype=np.int64)
    step.prompt_rows = PromptRows(
        np.array([0, 1], np.int64), np.array([5, 6], np.int64), np.ones(2, np.float32), 2, [(0, 1, 2)]
    )
    joins = [SlotJoin(4, np.array([7, 8, 9], np.int32), 1, {"temperature": np.float32(0.5)})]
    got, numbers, extra = unpack_step(pack_step(step, [], joins))
    assert_same_step(got, step)
    assert numbers == [] and len(extra) == 1
    assert extra[0].slot == 4 and np.array_equal(extra[0].token_ids, joins[0].token_ids)


@pytest.mark.parametrize("only, ahead", [(None, True), (2, False)])
def test_a_step_command_and_other_commands_decode_to_what_was_sent(only: int | None, ahead: bool) -> None:
    step = random_step(5, 4, 3)
    step.ahead = ahead  # each rank completes a step launched ahead from its own input batch
    command = StepCommand([], step, num_steps=2, only=only, fused=True)
    got = decode(encode(command))
    assert isinstance(got, StepCommand)
    assert (got.joins, got.num_steps, got.only, got.fused, got.step.ahead) == ([], 2, only, True, ahead)
    assert isinstance(got.step.ahead, bool)
    assert_same_step(got.step, command.step)
    plan = got.plan()
    assert plan.num_wanted == command.step.num_wanted.tolist()
    assert plan.methods == command.step.seq_methods.tolist()
    assert isinstance(decode(encode(Stop())), Stop)
