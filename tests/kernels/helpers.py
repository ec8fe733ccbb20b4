"""Helpers shared by the kernel tests: relative error against float64, output poisoning."""

from __future__ import annotations

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere fails."""
    out64, ref64 = out.double(), ref.double()
    assert not torch.isnan(out64).any(), "output has NaN (an element was never written?)"
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-300))


def poison_allocator(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """Fills the block the caching allocator will hand out next for this shape with NaN (floats)
    or a sentinel (integers), so an output element the kernel never writes shows up."""
    fill = float("nan") if dtype.is_floating_point else -777
    block = torch.full(shape, fill, dtype=dtype, device=device)
    del block
