"""Post-step update: CUDA kernel vs reference; the reference's stop rules on hand-made cases."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.post_step_ref import LENGTH, RUNNING, STOP, post_step_update_ref
from tests.kernels.helpers import needs_cuda

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
