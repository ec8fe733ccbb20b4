"""The step's tail (services/engine/verify_update.py): how the device proposers' drafts are merged
per request."""

from __future__ import annotations

import pytest
import torch

from services.engine.verify_update import _merged

WIDTH = 6


def filled_then_assigned(
    mine: list[torch.Tensor], found: list[torch.Tensor], defaults: torch.Tensor
) -> torch.Tensor:
    """The merge as `VerifyAndUpdate.draft` wrote it before `_merged`: a filled buffer, each
    proposer's columns written over its requests' rows."""
    merged = defaults.repeat(mine[0].shape[0], 1)
    for rows, drafted in zip(mine, found):
        drafted = drafted[:, :WIDTH]
        width = drafted.shape[1]
        merged[:, :width] = torch.where(rows[:, None], drafted, merged[:, :width])
    return merged


@pytest.mark.parametrize("widths", [(WIDTH,), (1,), (3, WIDTH + 2), (WIDTH, 2, 4)])
def test_merged_drafts_are_the_filled_buffers(widths: tuple[int, ...]) -> None:
    """Proposers drafting as wide as the step, narrower (the rest keeps the defaults) or wider (cut),
    each for its own requests; the others keep the defaults."""
    generator = torch.Generator().manual_seed(len(widths))
    num_seqs = 9
    methods = torch.randint(-1, len(widths), (num_seqs,), generator=generator)
    for defaults in (torch.full((WIDTH,), -1, dtype=torch.int32), torch.arange(WIDTH, dtype=torch.int32)):
        mine = [methods == index for index in range(len(widths))]
        found = [torch.randint(0, 50, (num_seqs, w), generator=generator, dtype=torch.int32) for w in widths]
        merged = defaults.expand(num_seqs, -1)
        for rows, drafted in zip(mine, found):
            merged = _merged(rows, drafted, merged, defaults)
        want = filled_then_assigned(mine, found, defaults)
        assert merged.dtype == want.dtype and torch.equal(merged, want)
