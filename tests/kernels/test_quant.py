"""Quantized weights (kernels/quant_ref.py, kernels/quant_gemm.py, `kernels.quant_linear`).

On CPU: the compressed-tensors int32 packing, quantize -> dequantize round trips within each
scheme's step, the weight-only product against F.linear of the dequantized weight, the per-token
FP8 activations, the kernels' fp8 decoding formula over every e4m3 code, and the dispatch rules.
On a GPU: each CUDA kernel (one-row, tensor-core, dequantize, FP8 activations + _scaled_mm) against
its torch reference over shapes, row counts, group sizes and dtypes (outputs poisoned first), the
dispatch over row counts, and replay from a CUDA graph.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import _cuda
from kernels.quant_gemm import FP8_GEMV_MAX_ROWS
from kernels.quant_ref import (
    FP8_DTYPE,
    FP8_MAX,
    QMAX,
    SCHEMES,
    dequantize_weight_ref,
    fp8_scaled_mm_ref,
    pack_int32,
    quant_linear_ref,
    quantize_fp8_per_token_ref,
    quantize_weight_ref,
    unpack_int32,
)
from tests.kernels.helpers import needs_cuda, poison_allocator, rel_error

GROUPS = {"fp8": [None], "int8": [None, 64], "int4": [None, 32, 128]}


def random_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=generator) * in_features**-0.5


@pytest.mark.parametrize("bits", [4, 8])
def test_packing_is_compressed_tensors_layout(bits: int) -> None:
    per_word = 32 // bits
    low, high = -(1 << (bits - 1)), 1 << (bits - 1)
    values = torch.randint(low, high, (5, 4 * per_word), dtype=torch.int8)
    packed = pack_int32(values, bits)
    assert packed.dtype == torch.int32 and packed.shape == (5, 4)
    fields = (values.to(torch.int64) + high).view(5, 4, per_word)
    words = sum(fields[..., i] << (bits * i) for i in range(per_word))
    assert torch.equal(packed.to(torch.int64) & 0xFFFFFFFF, words)  # feature k at bits (k % per_word) * bits
    assert torch.equal(unpack_int32(packed, bits), values)
    # in memory, int8 is one byte per feature and int4 two per byte, the lower feature in the low nibble
    raw = packed.view(torch.uint8).view(5, -1).to(torch.int64)
    if bits == 8:
        assert torch.equal(raw - 128, values.to(torch.int64))
    else:
        assert torch.equal((raw & 15) - 8, values[:, 0::2].to(torch.int64))
        assert torch.equal((raw >> 4) - 8, values[:, 1::2].to(torch.int64))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_round_trip_is_within_half_a_step_of_each_group(scheme: str) -> None:
    weight = random_weight(48, 256)
    for group_size in GROUPS[scheme]:
        qweight, scale = quantize_weight_ref(weight, scheme, group_size)
        num_groups = 256 // (group_size or 256)
        assert scale.shape == (48, num_groups) and scale.dtype == torch.float32
        restored = dequantize_weight_ref(qweight, scale, scheme, torch.float32)
        error = (restored - weight).abs().view(48, num_groups, -1)
        if scheme == "fp8":  # 3 mantissa bits: relative half-step 2^-4 (subnormals: absolute)
            bound = weight.abs().view(48, num_groups, -1) * 2**-4 + scale[..., None] * 2**-9
        else:
            bound = scale[..., None] * 0.5 + 1e-7
        assert (error <= bound).all(), f"{scheme} group {group_size}: worst {(error - bound).max():.2e} over"
        # the largest magnitude of each group maps onto the scheme's largest value
        qmax = FP8_MAX if scheme == "fp8" else QMAX[scheme]
        amax = weight.abs().view(48, num_groups, -1).amax(-1)
        assert torch.allclose(scale * qmax, amax, rtol=1e-6)


def test_zero_rows_quantize_to_zeros_not_nan() -> None:
    weight = torch.zeros(4, 64)
    for scheme in SCHEMES:
        qweight, scale = quantize_weight_ref(weight, scheme)
        assert torch.equal(dequantize_weight_ref(qweight, scale, scheme, torch.float32), weight)


def test_bad_schemes_and_group_sizes_are_refused() -> None:
    weight = random_weight(8, 256)
    with pytest.raises(ValueError, match="int3"):
        quantize_weight_ref(weight, "int3")
    with pytest.raises(ValueError, match="group size 100 must divide in_features 256"):
        quantize_weight_ref(weight, "int4", 100)
    with pytest.raises(ValueError, match="multiple of 8"):
        quantize_weight_ref(random_weight(8, 36), "int4", 36)
    with pytest.raises(ValueError, match="one scale per output channel"):
        quantize_weight_ref(weight, "fp8", 128)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_on_cpu_is_f_linear_of_the_dequantized_weight(scheme: str, dtype: torch.dtype) -> None:
    weight, x, bias = random_weight(40, 128), torch.randn(7, 128).to(dtype), torch.randn(40).to(dtype)
    qweight, scale = quantize_weight_ref(weight, scheme, 32 if scheme == "int4" else None)
    expected = F.linear(x, dequantize_weight_ref(qweight, scale, scheme, dtype), bias)
    assert torch.equal(kernels.quant_linear(x, qweight, scale, scheme, bias), expected)
    without_bias = F.linear(x, dequantize_weight_ref(qweight, scale, scheme, dtype)).float()
    assert torch.equal(quant_linear_ref(x, qweight, scale, scheme, None, torch.float32), without_bias)
    # close to the unquantized product: the quantization error, not a wrong layout
    exact = F.linear(x.float(), weight, bias.float())
    assert rel_error(expected, exact) < {"fp8": 0.05, "int8": 0.01, "int4": 0.15}[scheme]


def test_fp8_per_token_activations() -> None:
    x = torch.randn(6, 64) * torch.logspace(-3, 2, 6)[:, None]
    x_q, scale = quantize_fp8_per_token_ref(x)
    assert x_q.dtype == FP8_DTYPE and scale.shape == (6, 1)
    assert torch.allclose(x_q.float().abs().amax(-1), torch.full((6,), FP8_MAX))
    assert rel_error(x_q.float() * scale, x) < 0.04
    weight = random_weight(32, 64)
    qweight, wscale = quantize_weight_ref(weight, "fp8")
    expected = (x_q.float() @ qweight.float().T) * scale * wscale.T
    assert torch.allclose(fp8_scaled_mm_ref(x, qweight, wscale, out_dtype=torch.float32), expected)


def test_kernel_fp8_decoding_formula_matches_every_e4m3_code() -> None:
    """quant_gemm decodes e4m3 by placing its 7 low bits at fp16 bits 7-13 (sign at 15) and
    multiplying by 256: exact for every finite code, subnormals included."""
    codes = np.arange(256, dtype=np.uint16)
    half_bits = ((codes & 0x80) << 8) | ((codes & 0x7F) << 7)
    decoded = torch.from_numpy(half_bits.astype(np.uint16).view(np.float16).astype(np.float32)) * 256
    expected = torch.from_numpy(codes.astype(np.uint8)).view(FP8_DTYPE).float()
    finite = ~torch.isnan(expected)
    assert int(finite.sum()) == 254
    assert torch.equal(decoded[finite], expected[finite])


def test_cuda_wrappers_refuse_bad_inputs_with_a_clear_message() -> None:
    from kernels.quant_gemm import gemv_fits, quant_gemv_cuda

    qweight, scale = quantize_weight_ref(random_weight(32, 128), "int4", 32)
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    assert gemv_fits(x, qweight, scale, "int4")
    assert not gemv_fits(x.float(), qweight, scale, "int4")  # float32 takes the reference
    assert not gemv_fits(torch.randn(17, 128, dtype=torch.bfloat16), qweight, scale, "int4")
    assert not gemv_fits(x, qweight, quantize_weight_ref(random_weight(32, 128), "int4", 8)[1], "int4")
    assert not gemv_fits(
        torch.randn(2, 256, dtype=torch.bfloat16), qweight, scale, "int4"
    )  # 256 != 128 features
    assert not gemv_fits(x, qweight, scale, "int8")  # int4 storage read as int8: 64 features, not 128
    with pytest.raises(_cuda.KernelError, match="quant_gemv takes int4"):
        quant_gemv_cuda(x.float(), qweight, scale, "int4")


# ---- GPU ----

SHAPES = [  # (out_features, in_features): small odd ones, then Llama-1B and Qwen-7B projections
    (16, 128),
    (80, 384),
    (1000, 768),
    (3072, 2048),
    (2048, 8192),
    (4608, 3584),
    (3584, 18944),
    (37888, 3584),
]
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _cuda_weight(n: int, k: int, scheme: str, group_size: int | None, seed: int) -> tuple[torch.Tensor, ...]:
    qweight, scale = quantize_weight_ref(random_weight(n, k, seed), scheme, group_size)
    return qweight.cuda(), scale.cuda()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_quant_gemv_matches_reference(scheme: str, dtype: torch.dtype) -> None:
    from kernels.quant_gemm import MAX_ROWS, quant_gemv_cuda

    generator = torch.Generator().manual_seed(30)
    worst = 0.0
    for n, k in SHAPES:
        for group_size in [g for g in GROUPS[scheme] if g is None or k % g == 0]:
            qweight, scale = _cuda_weight(n, k, scheme, group_size, n + k)
            dequantized = dequantize_weight_ref(qweight, scale, scheme, torch.float64)
            bias = torch.randn(n, generator=generator).to("cuda", dtype)
            for num_rows in range(1, MAX_ROWS + 1) if n * k < 1e7 else (1, 3, 8, 16):
                x = torch.randn(num_rows, k, generator=generator).to("cuda", dtype)
                for b, rows_per_warp in ((None, 1), (bias, 2), (bias, None)):
                    poison_allocator((num_rows, n), dtype, x.device)
                    out = quant_gemv_cuda(x, qweight, scale, scheme, b, rows_per_warp)
                    torch.cuda.synchronize()
                    expected = x.double() @ dequantized.t() + (b.double() if b is not None else 0)
                    error = rel_error(out, expected)
                    assert error < TOLERANCE[dtype], f"{scheme} g{group_size} {num_rows}x{k}x{n}: {error:.2e}"
                    worst = max(worst, error)
    print(f"\nquant_gemv {scheme} {dtype}: max relative error vs the dequantized float64 product {worst:.2e}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_quant_mma_matches_reference(scheme: str, dtype: torch.dtype) -> None:
    """The tensor-core kernel multiplies by the weight dequantized to x's dtype, as the reference
    does: only the float32 summation order and the output rounding differ."""
    from kernels.quant_gemm import MMA_MAX_ROWS, mma_fits, quant_mma_cuda

    generator = torch.Generator().manual_seed(34)
    worst = 0.0
    for n, k in SHAPES:
        for group_size in [g for g in GROUPS[scheme] if g is None or k % g == 0]:
            qweight, scale = _cuda_weight(n, k, scheme, group_size, n + 2 * k)
            weight = dequantize_weight_ref(qweight, scale, scheme, dtype).double()
            bias = torch.randn(n, generator=generator).to("cuda", dtype)
            for num_rows in (1, 17, 40, 64, 65, 130, MMA_MAX_ROWS) if n * k < 1e7 else (17, 64, 200):
                x = torch.randn(num_rows, k, generator=generator).to("cuda", dtype)
                assert mma_fits(x, qweight, scale, scheme)
                for b in (None, bias):
                    poison_allocator((num_rows, n), dtype, x.device)
                    out = quant_mma_cuda(x, qweight, scale, scheme, b)
                    torch.cuda.synchronize()
                    expected = x.double() @ weight.t() + (b.double() if b is not None else 0)
                    error = rel_error(out, expected)
                    assert error < TOLERANCE[dtype], f"{scheme} g{group_size} {num_rows}x{k}x{n}: {error:.2e}"
                    worst = max(worst, error)
    print(f"\nquant_mma {scheme} {dtype}: max relative error vs the dequantized float64 product {worst:.2e}")


@pytest.mark.gpu
@needs_cuda
def test_cuda_quant_mma_takes_only_whole_64_feature_steps_and_16_value_groups(monkeypatch) -> None:
    from kernels.quant_gemm import MMA_ENV, mma_fits

    x = torch.randn(20, 192, device="cuda", dtype=torch.bfloat16)
    qweight, scale = _cuda_weight(64, 192, "int8", 64, 1)
    assert mma_fits(x, qweight, scale, "int8")
    assert not mma_fits(x.float(), qweight, scale, "int8")
    assert not mma_fits(x, qweight, torch.ones(64, 24, device="cuda"), "int8")  # groups of 8 values
    small, small_scale = _cuda_weight(64, 96, "int8", None, 1)
    assert not mma_fits(x[:, :96].contiguous(), small, small_scale, "int8")  # 96 features: not whole steps
    monkeypatch.setenv(MMA_ENV, "off")
    assert not mma_fits(x, qweight, scale, "int8")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_dequantize_is_bit_identical_to_reference(scheme: str, dtype: torch.dtype) -> None:
    from kernels.quant_gemm import dequantize_weight_cuda

    for n, k in SHAPES[:6]:
        for group_size in [g for g in GROUPS[scheme] if g is None or k % g == 0]:
            qweight, scale = _cuda_weight(n, k, scheme, group_size, n * k)
            poison_allocator((n, k), dtype, qweight.device)
            out = dequantize_weight_cuda(qweight, scale, scheme, dtype)
            assert torch.equal(out, dequantize_weight_ref(qweight, scale, scheme, dtype)), f"{scheme} {n}x{k}"


@pytest.mark.gpu
@needs_cuda
def test_cuda_fp8_row_quantization_and_scaled_mm_match_references() -> None:
    from kernels.quant_gemm import fp8_quantize_rows_cuda, fp8_scaled_mm_cuda, scaled_mm_fits

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need sm_89 or later")
    generator = torch.Generator().manual_seed(31)
    for num_rows in (1, 17, 64, 300):
        for n, k in SHAPES[2:6]:
            x = (torch.randn(num_rows, k, generator=generator) * 3).to("cuda", torch.bfloat16)
            x_q, x_scale = fp8_quantize_rows_cuda(x)
            ref_q, ref_scale = quantize_fp8_per_token_ref(x)
            assert torch.allclose(x_scale, ref_scale, rtol=1e-6)
            # each value within one e4m3 step (3 mantissa bits) of the reference's rounding
            assert torch.allclose(x_q.float(), ref_q.float(), rtol=2**-3, atol=2**-9)
            # the kernel multiplies by the scale's reciprocal: a few values round the other way
            assert (x_q.float() != ref_q.float()).float().mean() < 1e-2
            qweight, scale = _cuda_weight(n, k, "fp8", None, n)
            assert scaled_mm_fits(x, qweight) == (n % 16 == 0)  # _scaled_mm takes 16-multiple sizes
            if n % 16:
                continue
            bias = torch.randn(n, generator=generator).to("cuda", torch.bfloat16)
            out = fp8_scaled_mm_cuda(x, qweight, scale, bias)
            expected = fp8_scaled_mm_ref(x, qweight, scale, bias, torch.float64)
            assert rel_error(out, expected) < 1e-2, f"{num_rows}x{k}x{n}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("scheme", SCHEMES)
def test_cuda_quant_linear_dispatch_matches_reference_for_every_row_count(scheme: str) -> None:
    generator = torch.Generator().manual_seed(32)
    n, k = 4608, 3584
    qweight, scale = _cuda_weight(n, k, scheme, 128 if scheme == "int4" else None, 5)
    for num_rows in (1, 5, 16, 17, 64, 256, 257, 600):  # one-row kernel, tensor cores, dequantize + cuBLAS
        x = torch.randn(num_rows, k, generator=generator).to("cuda", torch.bfloat16)
        out = kernels.quant_linear(x, qweight, scale, scheme)
        expected = quant_linear_ref(x.double(), qweight, scale, scheme)
        # FP8 past FP8_GEMV_MAX_ROWS also quantizes the activations (per token): a larger error
        tolerance = 6e-2 if scheme == "fp8" and num_rows > FP8_GEMV_MAX_ROWS else 1e-2
        assert rel_error(out, expected) < tolerance, f"{scheme} {num_rows} rows"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("scheme", SCHEMES)
def test_cuda_quant_gemv_takes_strided_rows_and_replays_from_a_graph(scheme: str) -> None:
    from kernels.quant_gemm import quant_gemv_cuda

    generator = torch.Generator().manual_seed(33)
    qweight, scale = _cuda_weight(3072, 2048, scheme, 128 if scheme == "int4" else None, 6)
    wide = torch.randn(6, 2048 + 512, generator=generator).to("cuda", torch.bfloat16)
    x = wide[:, 256 : 256 + 2048]  # rows 2560 elements apart, 16-byte aligned
    eager = quant_gemv_cuda(x, qweight, scale, scheme)
    assert torch.equal(eager, quant_gemv_cuda(x.contiguous(), qweight, scale, scheme))
    static = x.contiguous()
    quant_gemv_cuda(static, qweight, scale, scheme)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = quant_gemv_cuda(static, qweight, scale, scheme)
    fresh = torch.randn(6, 2048, generator=generator).to("cuda", torch.bfloat16)
    static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, quant_gemv_cuda(fresh, qweight, scale, scheme))
