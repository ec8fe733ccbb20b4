"""Torch reference of the peer all-reduce's arithmetic (`kernels/all_reduce.py`).

The sum of the ranks' parts, accumulated in float32 in rank order (rank 0's part, plus rank 1's,
...) and rounded once to the parts' dtype. Every rank of the kernel computes exactly this, so every
rank holds the same bits, which tensor parallelism's rank consistency needs.
"""

from __future__ import annotations

import torch


def all_reduce_ref(parts: list[torch.Tensor]) -> torch.Tensor:  # [*shape] in the parts' dtype
    """`parts`: one [*shape] tensor per rank, in rank order, all of one shape and dtype."""
    if not parts:
        raise ValueError("all_reduce_ref needs at least one rank's part")
    first = parts[0]
    for rank, part in enumerate(parts[1:], start=1):
        if part.shape != first.shape or part.dtype != first.dtype:
            raise ValueError(
                f"rank {rank}'s part is {tuple(part.shape)} {part.dtype}, rank 0's "
                f"{tuple(first.shape)} {first.dtype}: every rank must reduce the same shape and dtype"
            )
    total = first.float()
    for part in parts[1:]:
        total = total + part.float()
    return total.to(first.dtype)
