"""Post-step update: CUDA kernel vs reference; the reference's stop rules on hand-made cases."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kernels.post_step_ref import LENGTH, RUNNING, STOP, post_step_update_ref, post_step_update_slots_ref
from tests.kernels.helpers import needs_cuda, needs_gxx, run_on_host

I32 = torch.int32


def make_state(num_reqs: int, rng: random.Random, by_row_id: bool) -> list:
    """Random token rows (more rows than requests when `by_row_id`, each request's row picked by
    id, as in the CUDA-graph step's token history) and random stop settings."""
    capacity, width = 64, 6
    num_rows = num_reqs + 3 if by_row_id else num_reqs
    token_ids = torch.full((num_rows, capacity), -9, dtype=I32)
    row_ids = torch.randperm(num_rows, generator=torch.Generator().manual_seed(num_reqs))[:num_reqs]
    lengths = [rng.choice([rng.randrange(1, 40), capacity - 2]) for _ in range(num_reqs)]  # some fill up
    num_output = [rng.randrange(0, n) for n in lengths]
    new_tokens = torch.randint(0, 20, (num_reqs, width), dtype=I32)
    num_new = [rng.randrange(1, width + 1) for _ in range(num_reqs)]
    max_tokens = [o + rng.randrange(1, 8) for o in num_output]
    min_tokens = [rng.choice([0, 0, o + 2]) for o in num_output]
    ignore_eos = [rng.random() < 0.3 for _ in range(num_reqs)]
    eos_ids = torch.tensor([[rng.randrange(20), rng.choice([7, -1])] for _ in range(num_reqs)], dtype=I32)
    stop_ids = torch.tensor([[rng.randrange(20), rng.randrange(20), -1] for _ in range(num_reqs)], dtype=I32)
    return [
        token_ids,
        row_ids if by_row_id else None,
        torch.tensor(lengths, dtype=I32),
        torch.tensor(num_output, dtype=I32),
        new_tokens,
        torch.tensor(num_new, dtype=I32),
        torch.tensor(max_tokens, dtype=I32),
        torch.tensor(min_tokens, dtype=I32),
        torch.tensor(ignore_eos, dtype=I32),
        eos_ids,
        stop_ids,
    ]


def run_one(
    new: list[int],
    num_output: int = 0,
    max_tokens: int = 10,
    min_tokens: int = 0,
    ignore_eos: int = 0,
    length: int = 2,
    capacity: int = 16,
) -> tuple[int, int, int, list[int], int]:
    """One request in row 1 of three, EOS 0 (and -1 padding), stop id 9: (kept, finish, stop
    token, the row's new tokens, num_output after)."""
    token_ids = torch.full((3, capacity), -9, dtype=I32)
    lengths = torch.tensor([length], dtype=I32)
    produced = torch.tensor([num_output], dtype=I32)
    kept, finish, stop = post_step_update_ref(
        token_ids,
        torch.tensor([1]),
        lengths,
        produced,
        torch.tensor([new], dtype=I32),
        torch.tensor([len(new)], dtype=I32),
        torch.tensor([max_tokens], dtype=I32),
        torch.tensor([min_tokens], dtype=I32),
        torch.tensor([ignore_eos], dtype=I32),
        torch.tensor([[0, -1]], dtype=I32),
        torch.tensor([[9, -1]], dtype=I32),
    )
    assert token_ids[[0, 2]].eq(-9).all()  # other rows untouched
    assert token_ids[1, int(lengths[0]) :].eq(-9).all()  # nothing past the kept tokens
    assert int(lengths[0]) - length == int(kept[0])
    row = token_ids[1, length : int(lengths[0])].tolist()
    return int(kept[0]), int(finish[0]), int(stop[0]), row, int(produced[0])


def test_reference_stop_rules() -> None:
    assert run_one([5, 6, 8]) == (3, RUNNING, -1, [5, 6, 8], 3)
    assert run_one([5, 0, 8]) == (2, STOP, -1, [5, 0], 2)  # EOS ends it and is kept; 8 is dropped
    assert run_one([5, 0, 8], ignore_eos=1) == (3, RUNNING, -1, [5, 0, 8], 3)
    assert run_one([5, 9, 8]) == (2, STOP, 9, [5, 9], 2)  # a stop id
    assert run_one([5, 9, 8], ignore_eos=1) == (2, STOP, 9, [5, 9], 2)  # ignore_eos leaves stop ids
    assert run_one([0, 9, 8], num_output=0, min_tokens=2) == (2, STOP, 9, [0, 9], 2)  # EOS too early
    assert run_one([0, 0, 8], num_output=3, min_tokens=5) == (2, STOP, -1, [0, 0], 5)
    assert run_one([5, 6, 8], num_output=8) == (2, LENGTH, -1, [5, 6], 10)  # max_tokens mid-step
    assert run_one([5, 0, 8], num_output=8) == (2, STOP, -1, [5, 0], 10)  # a stop wins on the last token
    assert run_one([5, 6, 8], length=14) == (2, RUNNING, -1, [5, 6], 2)  # a full row takes no more


@pytest.mark.parametrize("by_row_id", [False, True])
def test_reference_keeps_tokens_up_to_the_first_stop(by_row_id: bool) -> None:
    """Property over random cases: the kept tokens are the emitted ones up to and including the
    first that ends the request, written right after the row's tokens."""
    rng = random.Random(1)
    state = make_state(50, rng, by_row_id)
    before = [t.clone() if t is not None else None for t in state]
    kept, finish, stop = post_step_update_ref(*state)
    token_ids, row_ids, lengths, num_output = state[:4]
    old_tokens, _, old_lengths, old_output, new, num_new, max_tokens, min_tokens, ignore, eos, stops = before
    for b in range(50):
        row = int(row_ids[b]) if row_ids is not None else b
        expected, reason, stopped_by = [], RUNNING, -1
        length, produced = int(old_lengths[b]), int(old_output[b])
        for token in new[b, : int(num_new[b])].tolist():
            if length + len(expected) >= token_ids.shape[1]:
                break
            expected.append(token)
            produced += 1
            if produced >= int(min_tokens[b]):
                if not int(ignore[b]) and token in eos[b].tolist():
                    reason = STOP
                    break
                if token in stops[b].tolist():
                    reason, stopped_by = STOP, token
                    break
            if produced >= int(max_tokens[b]):
                reason = LENGTH
                break
        assert (int(kept[b]), int(finish[b]), int(stop[b])) == (len(expected), reason, stopped_by)
        assert token_ids[row, length : length + len(expected)].tolist() == expected
        assert torch.equal(
            token_ids[row, length + len(expected) :], old_tokens[row, length + len(expected) :]
        )
        assert int(lengths[b]) == length + len(expected)
        assert int(num_output[b]) == int(old_output[b]) + len(expected)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("by_row_id", [False, True])
def test_cuda_post_step_matches_reference(by_row_id: bool) -> None:
    from kernels.post_step import post_step_update_cuda

    rng = random.Random(2)
    for num_reqs in (1, 9, 300):
        cpu_state = make_state(num_reqs, rng, by_row_id)
        gpu_state = [t.cuda() if t is not None else None for t in cpu_state]
        expected = post_step_update_ref(*cpu_state)
        got = post_step_update_cuda(*gpu_state)
        for g, e in zip(got, expected):
            assert torch.equal(g.cpu(), e.cpu())
        for i in (0, 2, 3):  # token rows, lengths, num_output
            assert torch.equal(gpu_state[i].cpu(), cpu_state[i])


# ---- the slot-indexed update (`post_step_update_slots`: the tail's gathers and scatters folded in) ----


def make_slot_state(num_reqs: int, rng: random.Random) -> list:
    """Per-slot tensors laid out as InputBatch keeps them (stop limits and the EOS / stop ids rows
    of one packed int32 tensor, the ids read through transposed views) and `num_reqs` requests in
    shuffled slots; the random stop settings of `make_state`."""
    state = make_state(num_reqs, rng, by_row_id=True)
    token_rows, slots, lengths, num_output, new_tokens, num_new = state[:6]
    max_tokens, min_tokens, ignore_eos, eos_ids, stop_ids = state[6:]
    num_slots = token_rows.shape[0]
    packed = torch.full((3 + eos_ids.shape[1] + stop_ids.shape[1], num_slots), -5, dtype=I32)
    per_slot = [torch.full((num_slots,), 3, dtype=I32) for _ in range(2)]
    for column, values in enumerate((max_tokens, min_tokens, ignore_eos)):
        packed[column, slots] = values
    packed[3 : 3 + eos_ids.shape[1], slots] = eos_ids.t()
    packed[3 + eos_ids.shape[1] :, slots] = stop_ids.t()
    per_slot[0][slots], per_slot[1][slots] = lengths, num_output
    return [
        token_rows,
        slots,
        per_slot[0],
        per_slot[1],
        new_tokens,
        num_new - 1,  # num_accepted
        packed[0],
        packed[1],
        packed[2],
        packed[3 : 3 + eos_ids.shape[1]].t(),
        packed[3 + eos_ids.shape[1] :].t(),
    ]


def test_slot_update_reference_is_the_update_between_gathers_and_scatters() -> None:
    torch.manual_seed(4)  # make_state's new tokens
    row_state = make_state(40, random.Random(4), by_row_id=True)
    torch.manual_seed(4)
    slot_state = make_slot_state(40, random.Random(4))
    kept, finish, stop = post_step_update_ref(*row_state)
    got = post_step_update_slots_ref(*slot_state)
    slots = slot_state[1]
    assert torch.equal(got[0], kept) and torch.equal(got[1], finish) and torch.equal(got[2], stop)
    assert torch.equal(got[3], row_state[3]) and torch.equal(slot_state[3][slots], row_state[3])
    assert torch.equal(slot_state[2][slots], row_state[2]) and torch.equal(slot_state[0], row_state[0])


@needs_gxx
@pytest.mark.parametrize("num_reqs", [1, 9, 130])
def test_slot_update_kernel_on_the_host_matches_reference(num_reqs: int, tmp_path) -> None:
    """post_step_update_slots and post_step_update run on the host (one thread per request)."""
    from kernels.post_step import SOURCE, THREADS

    state = make_slot_state(num_reqs, random.Random(num_reqs))
    expected_state = [t.clone() for t in state[:4]]
    expected = post_step_update_slots_ref(*expected_state, *state[4:])
    token_rows, slots, num_tokens, num_output, new_tokens, num_accepted = state[:6]
    max_tokens, min_tokens, ignore_eos, eos_ids, stop_ids = state[6:]
    outputs = torch.full((4, num_reqs), -7, dtype=I32)
    args = (
        token_rows, np.int64(token_rows.stride(0)), np.int32(token_rows.shape[1]), slots, num_tokens, num_output,
        new_tokens, np.int32(new_tokens.shape[1]), num_accepted, max_tokens, min_tokens, ignore_eos,
        eos_ids, np.int32(eos_ids.shape[1]), np.int64(eos_ids.stride(0)), np.int64(eos_ids.stride(1)),
        stop_ids, np.int32(stop_ids.shape[1]), np.int64(stop_ids.stride(0)), np.int64(stop_ids.stride(1)),
        *outputs, np.int32(num_reqs),
    )  # fmt: skip
    grid = (-(-num_reqs // THREADS),)
    run_on_host(SOURCE, "post_step_update_slots", {}, grid, (THREADS,), args, tmp_path)
    for got, want in zip(outputs, expected):
        assert torch.equal(got, want)
    for got, want in zip(state[:4], expected_state):
        assert torch.equal(got, want)
    # the per-request kernel, now a wrapper of the same loop
    rows = make_state(num_reqs, random.Random(num_reqs), by_row_id=True)
    expected_rows = [t.clone() for t in rows[:4]]
    expected = post_step_update_ref(*expected_rows[:2], *expected_rows[2:4], *rows[4:])
    out = torch.full((3, num_reqs), -7, dtype=I32)
    token_ids, row_ids, lengths, produced, new_tokens, num_new = rows[:6]
    args = (
        token_ids, np.int64(token_ids.stride(0)), np.int32(token_ids.shape[1]), row_ids, lengths, produced,
        new_tokens, np.int32(new_tokens.shape[1]), num_new, *rows[6:9], rows[9], np.int32(rows[9].shape[1]),
        rows[10], np.int32(rows[10].shape[1]), *out, np.int32(num_reqs),
    )  # fmt: skip
    run_on_host(SOURCE, "post_step_update", {}, grid, (THREADS,), args, tmp_path)
    for got, want in zip(out, expected):
        assert torch.equal(got, want)
    for got, want in zip(rows[:4], expected_rows):
        assert torch.equal(got, want)


@pytest.mark.gpu
@needs_cuda
def test_cuda_slot_update_matches_reference() -> None:
    from kernels.post_step import post_step_update_slots_cuda

    for num_reqs in (1, 9, 300):
        cpu_state = make_slot_state(num_reqs, random.Random(num_reqs))
        gpu_state = [t.cuda() for t in cpu_state]
        gpu_state[9] = gpu_state[9].t().contiguous().t()  # the transposed views as InputBatch's
        gpu_state[10] = gpu_state[10].t().contiguous().t()
        expected = post_step_update_slots_ref(*cpu_state)
        got = post_step_update_slots_cuda(*gpu_state)
        for g, e in zip(got, expected):
            assert torch.equal(g.cpu(), e)
        for i in range(4):  # token rows, slot lengths, slot num_output
            assert torch.equal(gpu_state[i].cpu(), cpu_state[i])
