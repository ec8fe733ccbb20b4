"""Rotary position embedding (Su et al. 2021) with the scalings Llama-family checkpoints use."""

from __future__ import annotations

import math
from typing import Any

import torch

import kernels
from kernels.fused_layers_ref import rotary_embedding_ref


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, device: torch.device
) -> torch.Tensor:
    """Returns the [head_dim / 2] float32 rotation frequencies, scaled as the checkpoint asks."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / float(scaling["factor"])
    return _llama3_frequencies(inv_freq, scaling)


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputes cos / sin for every position up to `max_positions`; applies them by position id."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.register_buffer("cos", torch.empty(0), persistent=False)  # [max_positions, head_dim / 2]
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build(torch.device("cpu"))

    def build(self, device: torch.device) -> None:
        """(Re)computes the tables on `device`; called again after the model is materialised from meta."""
        inv_freq = inverse_frequencies(self.head_dim, self.theta, self.scaling, device)
        angles = torch.outer(torch.arange(self.max_positions, dtype=torch.float32, device=device), inv_freq)
        self.cos, self.sin = angles.cos(), angles.sin()

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (query, key) as new contiguous tensors; query and key may be views of a fused
        QKV projection. One fused kernel on CUDA, which has no backward: inference only. The
        kernel takes float32 tables, so `build` runs after the model is cast."""
        return kernels.rotary_embedding(positions, query, key, self.cos, self.sin)

    def forward_dense(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same in plain torch ops, differentiable (training and scoring)."""
        return rotary_embedding_ref(positions, query, key, self.cos, self.sin)
