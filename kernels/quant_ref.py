"""Quantized weights: the torch references of kernels/quant_gemm.py and the weight formats they read.

Three schemes, each symmetric (no zero points) with float32 scales, one scale per output row and
per `group_size` input features (group_size = in_features: one scale per output channel):

- `fp8`: float8 e4m3 weights, w ~= q * scale, scale = amax(row) / 448 (e4m3's largest finite);
- `int8`: integers in [-128, 127], scale = amax(group) / 127;
- `int4`: integers in [-8, 7], scale = amax(group) / 7.

Integer weights are stored as compressed-tensors' `pack-quantized` format stores them
(`weight_packed`, int32 [out_features, in_features * bits / 32]): each value plus 2^(bits-1) as an
unsigned field, packed along the input features from the low bits up, so input feature k sits in
word k / (32 / bits) at bit (k % (32 / bits)) * bits. In memory (little-endian) int8 is then one byte
per value in feature order, int4 two values a byte, the lower feature in the low nibble.

A quantized linear layer computes x @ dequantize(weight).T: the activations keep the model's dtype
(weight-only quantization). The FP8 tensor-core path of many rows (`torch._scaled_mm`) also
quantizes the activations, per token (`quantize_fp8_per_token_ref`, `fp8_scaled_mm_ref`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SCHEMES = ("fp8", "int8", "int4")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
"""Largest finite float8 e4m3fn value."""
BITS = {"int8": 8, "int4": 4}
QMAX = {"int8": 127, "int4": 7}
MIN_SCALE = 1e-12
"""Scales never go below this: an all-zero row or group quantizes to zeros, not NaN."""


def packed_width(scheme: str, in_features: int) -> int:
    """Columns of the stored weight: in_features for fp8, int32 words for int8 / int4."""
    return in_features if scheme == "fp8" else in_features * BITS[scheme] // 32


def check_group_size(scheme: str, in_features: int, group_size: int) -> None:
    """Raises ValueError when `group_size` does not tile `in_features` or splits a packed word."""
    per_word = 1 if scheme == "fp8" else 32 // BITS[scheme]
    if group_size <= 0 or in_features % group_size or group_size % per_word:
        raise ValueError(
            f"{scheme} group size {group_size} must divide in_features {in_features} "
            f"and be a multiple of {per_word}"
        )
    if scheme == "fp8" and group_size != in_features:
        raise ValueError(
            f"fp8 takes one scale per output channel (group size {in_features}), not {group_size}"
        )


def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """values [rows, cols] int in [-2^(bits-1), 2^(bits-1)) -> int32 [rows, cols * bits / 32]."""
    per_word = 32 // bits
    rows, cols = values.shape
    if cols % per_word:
        raise ValueError(f"{cols} columns do not pack into int32 words of {per_word} values")
    fields = (values.to(torch.int64) + (1 << (bits - 1))).view(rows, cols // per_word, per_word)
    shifts = torch.arange(per_word, device=values.device, dtype=torch.int64) * bits
    words = (fields << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int32(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `pack_int32`: int32 [rows, words] -> int8 [rows, words * 32 / bits]."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, device=packed.device, dtype=torch.int64) * bits
    fields = (packed.to(torch.int64)[..., None] >> shifts) & ((1 << bits) - 1)
    return (fields - (1 << (bits - 1))).flatten(-2).to(torch.int8)


def quantize_weight_ref(
    weight: torch.Tensor,  # [out_features, in_features], floating
    scheme: str,
    group_size: int | None = None,  # None: in_features (one scale per output channel)
) -> tuple[torch.Tensor, torch.Tensor]:  # (stored weight, scale float32 [out_features, num_groups])
    """The stored weight: fp8 [out, in] float8_e4m3fn, or int8 / int4 packed int32 (module docstring)."""
    if scheme not in SCHEMES:
        raise ValueError(f"quantization scheme {scheme!r}: one of {', '.join(SCHEMES)}")
    out_features, in_features = weight.shape
    group_size = group_size or in_features
    check_group_size(scheme, in_features, group_size)
    groups = weight.float().view(out_features, in_features // group_size, group_size)
    qmax = FP8_MAX if scheme == "fp8" else float(QMAX[scheme])
    scale = (groups.abs().amax(-1) / qmax).clamp(min=MIN_SCALE)  # [out, num_groups]
    scaled = groups / scale[..., None]
    if scheme == "fp8":
        return scaled.clamp(-FP8_MAX, FP8_MAX).view(out_features, in_features).to(FP8_DTYPE), scale
    values = scaled.round().clamp(-qmax - 1, qmax).view(out_features, in_features)
    return pack_int32(values, BITS[scheme]), scale


def dequantize_weight_ref(
    qweight: torch.Tensor,  # the stored weight (quantize_weight_ref)
    scale: torch.Tensor,  # [out_features, num_groups] float32
    scheme: str,
    dtype: torch.dtype,
) -> torch.Tensor:  # [out_features, in_features] in `dtype`
    """q * scale in float32, rounded once to `dtype`."""
    values = qweight.float() if scheme == "fp8" else unpack_int32(qweight, BITS[scheme]).float()
    out_features, in_features = values.shape
    num_groups = scale.shape[1]
    grouped = values.view(out_features, num_groups, in_features // num_groups) * scale[..., None]
    return grouped.view(out_features, in_features).to(dtype)


def quant_linear_ref(
    x: torch.Tensor,  # [num_rows, in_features]
    qweight: torch.Tensor,
    scale: torch.Tensor,  # [out_features, num_groups] float32
    scheme: str,
    bias: torch.Tensor | None = None,  # [out_features]
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [num_rows, out_features]
    """Weight-only quantized `F.linear`: x @ dequantize(weight).T in x's dtype (then `out_dtype`)."""
    result = F.linear(x, dequantize_weight_ref(qweight, scale, scheme, x.dtype), bias)
    return result if out_dtype is None else result.to(out_dtype)


def quantize_fp8_per_token_ref(
    x: torch.Tensor,  # [num_rows, in_features]
) -> tuple[
    torch.Tensor, torch.Tensor
]:  # (float8_e4m3fn [num_rows, in_features], scale float32 [num_rows, 1])
    """Each row scaled so its largest magnitude is e4m3's largest finite value."""
    rows = x.float()
    scale = (rows.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (rows / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_scaled_mm_ref(
    x: torch.Tensor,  # [num_rows, in_features]
    qweight: torch.Tensor,  # [out_features, in_features] float8_e4m3fn
    scale: torch.Tensor,  # [out_features, 1] float32
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [num_rows, out_features]
    """W8A8 FP8: x quantized per token, the product of the two fp8 operands accumulated in float32,
    both scales applied, one rounding to `out_dtype` (x's dtype by default)."""
    x_q, x_scale = quantize_fp8_per_token_ref(x)
    result = (x_q.float() @ qweight.float().T) * x_scale * scale.view(1, -1)
    if bias is not None:
        result = result + bias.float()
    return result.to(out_dtype or x.dtype)
