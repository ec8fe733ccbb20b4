"""Torch references for the fused per-layer kernels: residual add + RMSNorm, a draft head's two
input norms, SiLU-and-mul, rotary, rotary with the KV write (and the Gemma variants, offset-weight
RMSNorm and GeGLU, which have no CUDA kernel).

These are the twins of `kernels/fused_layers.py` (same signatures); the CPU path, CI and the
autograd (training) paths run them. Their rounding is the model's: the residual sum and every
activation are rounded to the model dtype where the unfused model code rounded them, so the CPU
outputs are bit-identical to the plain formulas they replace.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention_ref import write_kv_ref


def fused_add_rms_norm_ref(
    x: torch.Tensor,  # [num_tokens, hidden_size]
    residual: torch.Tensor | None,  # [num_tokens, hidden_size]; None in the first layer
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, new_residual), each [num_tokens, hidden_size]
    """new_residual = x + residual (x when residual is None), in x's dtype;
    normed = weight * RMSNorm(new_residual) (Zhang & Sennrich 2019), the norm in float32 and cast
    back to x's dtype before the weight multiplies it, as Hugging Face Llama does."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype), x


def embed_norm_concat_ref(
    input_ids: torch.Tensor,  # [num_tokens] int32 or int64
    embedding: torch.Tensor,  # [vocab_size, hidden_size]
    hidden: torch.Tensor,  # [num_tokens, hidden_size]
    embed_weight: torch.Tensor,  # [hidden_size]
    hidden_weight: torch.Tensor,  # [hidden_size]
    embed_eps: float,
    hidden_eps: float,
) -> torch.Tensor:  # [num_tokens, 2 * hidden_size]
    """concat(embed_weight * RMSNorm(embedding[input_ids]), hidden_weight * RMSNorm(hidden)): the
    input of a draft head's first projection (the MTP head's eh_proj, EAGLE-3's attention), each
    half rounded as `fused_add_rms_norm_ref` rounds it."""
    embeds = F.embedding(input_ids, embedding)
    return torch.cat(
        (
            fused_add_rms_norm_ref(embeds, None, embed_weight, embed_eps)[0],
            fused_add_rms_norm_ref(hidden, None, hidden_weight, hidden_eps)[0],
        ),
        dim=-1,
    )


def offset_add_rms_norm_ref(
    x: torch.Tensor,  # [..., hidden_size]
    residual: torch.Tensor | None,  # [..., hidden_size]; None: x alone
    weight: torch.Tensor,  # [hidden_size]: the stored weight, an offset from `offset`
    eps: float,
    offset: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, new_residual)
    """As `fused_add_rms_norm_ref` with the weight (offset + weight) multiplied in float32 before
    the cast back, as Gemma's RMSNorm does; torch ops on every device (no fused kernel)."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (offset + weight.float())).to(x.dtype), x


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [num_tokens, 2 * intermediate_size] (gate half, then up half) ->
    silu(gate) * up [num_tokens, intermediate_size]; silu's output is rounded to the dtype before
    the product (SwiGLU, Shazeer 2020)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [num_tokens, 2 * intermediate_size] -> gelu_tanh(gate) * up (GeGLU, Shazeer 2020,
    with GELU's tanh approximation, as Gemma uses)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rotary_embedding_ref(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [max_positions, head_dim / 2] float32
    sin: torch.Tensor,  # [max_positions, head_dim / 2] float32
) -> tuple[torch.Tensor, torch.Tensor]:  # rotated (query, key), new contiguous tensors
    """Rotary position embedding (Su et al. 2021) of each token at its position; out of place."""
    cos_t = cos[positions].unsqueeze(1)
    sin_t = sin[positions].unsqueeze(1)
    return rotate_half_split(query, cos_t, sin_t), rotate_half_split(key, cos_t, sin_t)


def rotary_write_kv_ref(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [max_positions, head_dim / 2] float32
    sin: torch.Tensor,  # [max_positions, head_dim / 2] float32
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; negative: the token writes no KV
) -> torch.Tensor:  # the rotated query, a new contiguous tensor
    """`rotary_embedding_ref`, then the rotated key and the value written to the paged cache at each
    token's slot (`write_kv_ref`): what an attention layer does before attending."""
    query, key = rotary_embedding_ref(positions, query, key, cos, sin)
    write_kv_ref(key, value, key_cache, value_cache, slot_mapping)
    return query


def rotate_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split (GPT-NeoX) layout, as Hugging Face Llama checkpoints are stored: element i pairs
    with element i + head_dim / 2. Float32 math, cast back to x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)
