"""Post-step update: CUDA kernel vs reference; the reference's stop rules on hand-made cases."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.post_step_ref import LENGTH, RUNNING, STOP, post_step_update_ref
from tests.kernels.helpers import needs_cuda


def make_state(num_reqs: int, rng: random.Random, device: str = "cpu") -> list[torch.Tensor]:
    capacity = 64
    lengths = [rng.randrange(1, 40) for _ in range(num_reqs)]
    token_ids = torch.full((num_reqs, capacity), -9, dtype=torch.int32)
    for b, n in enumerate(lengths):
        token_ids[b, :n] = torch.randint(0, 20, (n,), dtype=torch.int32)
    num_output = [rng.randrange(0, n) for n in lengths]
    num_computed = [n - 1 for n in lengths]
    width = 6
    new_tokens = torch.randint(0, 20, (num_reqs, width), dtype=torch.int32)
    num_new = [rng.randrange(1, width + 1) for _ in range(num_reqs)]
    max_tokens = [o + rng.randrange(1, 8) for o in num_output]
    min_tokens = [rng.choice([0, 0, o + 2]) for o in num_output]
    ignore_eos = [rng.random() < 0.3 for _ in range(num_reqs)]
    stop_ids = torch.tensor(
        [[rng.randrange(20), rng.randrange(20), -1] for _ in range(num_reqs)], dtype=torch.int32
    )
    i32 = torch.int32
    state = [
        token_ids,
        torch.tensor(lengths, dtype=i32),
        torch.tensor(num_computed, dtype=i32),
        torch.tensor(num_output, dtype=i32),
        new_tokens,
        torch.tensor(num_new, dtype=i32),
        torch.tensor(max_tokens, dtype=i32),
        torch.tensor(min_tokens, dtype=i32),
        torch.tensor(ignore_eos, dtype=i32),
        torch.tensor([3, 7], dtype=i32),
        stop_ids,
    ]
    return [t.to(device) for t in state]


def test_reference_stop_rules() -> None:
    i32 = torch.int32

    def run(
        new: list[int], num_output: int = 0, max_tokens: int = 10, min_tokens: int = 0, ignore_eos: int = 0
    ) -> tuple[int, int, int, list[int]]:
        token_ids = torch.zeros(1, 16, dtype=i32)
        lengths = torch.tensor([2], dtype=i32)
        kept, finish, stop = post_step_update_ref(
            token_ids,
            lengths,
            torch.tensor([1], dtype=i32),
            torch.tensor([num_output], dtype=i32),
            torch.tensor([new], dtype=i32),
            torch.tensor([len(new)], dtype=i32),
            torch.tensor([max_tokens], dtype=i32),
            torch.tensor([min_tokens], dtype=i32),
            torch.tensor([ignore_eos], dtype=i32),
            torch.tensor([0], dtype=i32),
            torch.tensor([[9, -1]], dtype=i32),
        )
        return int(kept[0]), int(finish[0]), int(stop[0]), token_ids[0, 2 : int(lengths[0])].tolist()

    assert run([5, 6, 8]) == (3, RUNNING, -1, [5, 6, 8])
    assert run([5, 0, 8]) == (2, STOP, -1, [5, 0])  # EOS ends it and is kept
    assert run([5, 0, 8], ignore_eos=1) == (3, RUNNING, -1, [5, 0, 8])
    assert run([5, 9, 8]) == (2, STOP, 9, [5, 9])  # a stop id
    assert run([0, 9, 8], min_tokens=2) == (2, STOP, 9, [0, 9])  # EOS before min_tokens is not a stop
    assert run([5, 6, 8], num_output=8) == (2, LENGTH, -1, [5, 6])


@pytest.mark.gpu
@needs_cuda
def test_cuda_post_step_matches_reference() -> None:
    from kernels.post_step import post_step_update_cuda

    rng = random.Random(2)
    for num_reqs in (1, 9, 300):
        cpu_state = make_state(num_reqs, rng)
        gpu_state = [t.cuda() for t in cpu_state]
        expected = post_step_update_ref(*cpu_state)
        got = post_step_update_cuda(*gpu_state)
        for g, e in zip(got, expected):
            assert torch.equal(g.cpu(), e.cpu())
        for g, e in zip(gpu_state[:4], cpu_state[:4]):  # token rows, lengths, num_computed, num_output
            assert torch.equal(g.cpu(), e)
