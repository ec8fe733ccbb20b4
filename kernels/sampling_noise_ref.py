"""Counter-based random numbers for sampling, keyed by (request seed, output position, stream).

A token's randomness depends only on its request's seed and its position in the output, never on
the batch, the step or how many drafts were verified with it. So a seeded request gives the same
tokens alone or in any batch, and — because a draft is accepted exactly when it equals the
target's own sample at that position — the same tokens with or without speculation.

The generator is SplitMix64 (Steele et al. 2014) over the counter (key, column), computed with
wrapping int64 arithmetic; the CUDA kernel computes the same function in registers.
"""

from __future__ import annotations

import torch

STREAM_TARGET = 0
"""Exponential noise for sampling target tokens (Gumbel-max)."""
STREAM_ACCEPT = 1
"""Uniforms for an accept test against a draft distribution (none today: every draft reaches the
verifier as a fixed token, drafting models' drafts being sampled with STREAM_TARGET's noise)."""

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB
_MASK53 = (1 << 53) - 1


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """[num_rows] int64 key per (seed, position, stream)."""
    return splitmix64(seeds.long() ^ splitmix64(positions.long() * 4 + stream))


def _unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """Top 53 bits as a float64 in (0, 1)."""
    return (_shr(bits, 11) & _MASK53).double().add_(0.5).mul_(2.0**-53)


def uniform_ref(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """[num_rows] float32 uniforms in (0, 1)."""
    return _unit_interval(splitmix64(row_keys(seeds, positions, stream))).float()


def exponential_noise_ref(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, stream: int
) -> torch.Tensor:
    """[num_rows, vocab_size] float32 Exp(1) noise; argmax(probs / noise) samples from probs."""
    keys = row_keys(seeds, positions, stream)[:, None]
    columns = torch.arange(vocab_size, device=seeds.device, dtype=torch.long)[None, :]
    uniforms = _unit_interval(splitmix64(keys + columns * _GOLDEN))
    return (-torch.log(uniforms)).float()
