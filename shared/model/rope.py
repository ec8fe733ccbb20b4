"""Rotary position embedding (Su et al. 2021) with the scalings Llama-family checkpoints use.

Scalings (`rope_type`): `linear` (position interpolation), `llama3`, `yarn` (Peng et al. 2023,
arXiv 2309.00071: frequencies blended between interpolated and original by wavelength, cos / sin
multiplied by an attention factor) and `dynamic` (NTK-aware: past the pretraining length L0, the
base grows with the context length L). transformers recomputes the dynamic base for the longest
position of each forward, so what a token gets depends on how it was batched; here a token at
position p is rotated for L = max(p + 1, L0): the frequencies transformers uses when tokens past L0
come one at a time (generate()), fixed per position, so chunking, batching and speculation cannot
change the output.
"""

from __future__ import annotations

import math
from typing import Any

import torch

import kernels
from kernels.fused_layers_ref import rotary_embedding_ref


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, device: torch.device
) -> torch.Tensor:
    """Returns the [head_dim / 2] float32 rotation frequencies, scaled as the checkpoint asks
    (for `dynamic`, those of positions within the pretraining length)."""
    exponents = _exponents(head_dim, device)
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None or scaling["rope_type"] == "dynamic":
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / float(scaling["factor"])
    if scaling["rope_type"] == "yarn":
        return _yarn_frequencies(inv_freq, theta, head_dim, scaling)
    return _llama3_frequencies(inv_freq, scaling)


def _exponents(head_dim: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim


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


def _yarn_frequencies(
    inv_freq: torch.Tensor, theta: float, head_dim: int, scaling: dict[str, Any]
) -> torch.Tensor:
    """YaRN "NTK-by-parts": dimensions that turn fewer than `beta_slow` times over the pretraining
    length are interpolated (divided by `factor`), those turning more than `beta_fast` times are
    kept, a linear ramp between."""
    factor = float(scaling["factor"])
    context = float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dimension_of(num_rotations: float) -> float:
        # the dimension index whose wavelength fits `num_rotations` times into the context
        return head_dim * math.log(context / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_of(fast), dimension_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    dims = torch.arange(head_dim // 2, dtype=torch.float32, device=inv_freq.device)
    kept = 1 - ((dims - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * (1 - kept) + inv_freq * kept


def yarn_attention_factor(scaling: dict[str, Any]) -> float:
    """YaRN's multiplier of cos / sin (so of attention logits, squared): `attention_factor`, else
    0.1 ln(factor) + 1, as a ratio of two such terms when `mscale` and `mscale_all_dim` are given."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(weight: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale(1.0)


def rotation_angles(
    head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None, device: torch.device
) -> torch.Tensor:
    """[max_positions, head_dim / 2] float32: position times frequency, per position."""
    positions = torch.arange(max_positions, dtype=torch.float32, device=device)
    if scaling is None or scaling["rope_type"] != "dynamic":
        return torch.outer(positions, inverse_frequencies(head_dim, theta, scaling, device))
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    context = torch.clamp(positions + 1, min=original)  # [max_positions]: L of each position
    base = theta * ((factor * context / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (base[:, None] ** _exponents(head_dim, device)[None, :])
    return positions[:, None] * inv_freq


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
        angles = rotation_angles(self.head_dim, self.max_positions, self.theta, self.scaling, device)
        self.cos, self.sin = angles.cos(), angles.sin()
        if self.scaling is not None and self.scaling["rope_type"] == "yarn":
            factor = yarn_attention_factor(self.scaling)
            self.cos, self.sin = self.cos * factor, self.sin * factor

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

    def forward_and_write_kv(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] int64; negative: the token writes no KV
    ) -> torch.Tensor:  # the rotated query, a new contiguous tensor
        """`forward`, with the rotated key and the value written to the paged KV cache at each token's
        slot rather than returned: one fused kernel on CUDA (`kernels.rotary_write_kv`)."""
        return kernels.rotary_write_kv(
            positions, query, key, value, self.cos, self.sin, key_cache, value_cache, slot_mapping
        )

    def forward_dense(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same in plain torch ops, differentiable (training and scoring)."""
        return rotary_embedding_ref(positions, query, key, self.cos, self.sin)
