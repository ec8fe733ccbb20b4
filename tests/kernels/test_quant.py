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
from tests.kernels.helpers import assemble_sm90, needs_cuda, needs_nvcc, poison_allocator, rel_error

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


# ---- quant_mma's layout, emulated on CPU (the CUDA source's bit operations and fragment order) ----


def _byte_perm(lo: np.ndarray, hi: np.ndarray, selector: int) -> np.ndarray:
    """PTX prmt: byte i of the result is byte (selector >> 4i) & 7 of the 8 bytes hi:lo."""
    pool = np.stack([lo, hi], -1).astype("<u4").view(np.uint8).reshape(*lo.shape, 8)
    picks = [(selector >> (4 * i)) & 7 for i in range(4)]
    return np.ascontiguousarray(pool[..., picks]).view("<u4")[..., 0]


def _halves(words: np.ndarray, dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    """A 32-bit register's two 16-bit halves read as `dtype`, as float64 (low, high)."""
    flat = np.ascontiguousarray(words, dtype=np.uint32).reshape(-1).view(np.int32)
    pairs = torch.from_numpy(flat).view(torch.int16).view(dtype).double().view(*np.shape(words), 2).numpy()
    return pairs[..., 0], pairs[..., 1]


def _fma_x2(a: np.ndarray, b: np.ndarray, c: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """fma.rn.{bf16,f16}x2 (its results here are small integers: exact in either dtype)."""
    out = []
    for half in range(2):
        value = _halves(a, dtype)[half] * _halves(b, dtype)[half] + _halves(c, dtype)[half]
        bits = torch.from_numpy(value).to(dtype).view(torch.int16).numpy().astype(np.uint16)
        out.append(bits.astype(np.uint32))
    return out[0] | (out[1] << 16)


def _decode_unit(raw: np.ndarray, unit: int, scheme: str, dtype: torch.dtype) -> list[np.ndarray]:
    """quant_mma's decode_unit: four 32-bit words of a 16-byte chunk -> 4 pair registers."""
    from kernels.quant_gemm import decode_constants

    c = {k: np.full(raw.shape[:-1], v, dtype=np.uint32) for k, v in decode_constants(scheme, dtype).items()}
    if scheme == "int4":
        w = raw[..., unit]
        return [
            _fma_x2(((w >> (4 * j)) & 0x000F000F) | c["MAGIC_X2"], c["ONE_X2"], c["OFFSET_X2"], dtype)
            for j in range(4)
        ]
    pairs = []
    for h in range(2):
        w = raw[..., 2 * unit + h]
        if dtype == torch.bfloat16:
            offset = c["FLOAT_OFFSET"].view(np.float32)
            f = [_byte_perm(w, c["FLOAT_MAGIC"], 0x7540 + i).view(np.float32) - offset for i in range(4)]
            for lo, hi in ((f[0], f[1]), (f[2], f[3])):
                halves = [
                    torch.from_numpy(v).to(dtype).view(torch.int16).numpy().astype(np.uint16)
                    for v in (lo, hi)
                ]
                pairs.append(halves[0].astype(np.uint32) | (halves[1].astype(np.uint32) << 16))
        else:
            for selector in (0x7150, 0x7352):
                pairs.append(
                    _fma_x2(_byte_perm(w, c["MAGIC_X2"], selector), c["ONE_X2"], c["OFFSET_X2"], dtype)
                )
    return pairs


def _x_pairs(v: np.ndarray, scheme: str) -> list[np.ndarray]:
    """quant_mma's x_pairs: one uint4 of x (8 values) -> the 4 B pair registers."""
    if scheme == "int4":
        return [
            _byte_perm(v[..., 0], v[..., 2], 0x5410),
            _byte_perm(v[..., 0], v[..., 2], 0x7632),
            _byte_perm(v[..., 1], v[..., 3], 0x5410),
            _byte_perm(v[..., 1], v[..., 3], 0x7632),
        ]
    return [v[..., i] for i in range(4)]


def _mma_m16n8k16(a: np.ndarray, b: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """D = A @ B of one mma.sync m16n8k16 from its fragments as the PTX ISA places them: lane
    (g, t) holds A (row g + 8 (r & 1), cols 2t + 8 (r >> 1) + {0, 1}) in register r of a [32, 4] and
    B (rows 2t + 8 r + {0, 1}, col g) in register r of b [32, 2]."""
    a_matrix, b_matrix = np.full((16, 16), np.nan), np.full((16, 8), np.nan)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for r in range(4):
            for half, value in enumerate(_halves(a[lane, r], dtype)):
                a_matrix[g + 8 * (r & 1), 2 * t + 8 * (r >> 1) + half] = value
        for r in range(2):
            for half, value in enumerate(_halves(b[lane, r], dtype)):
                b_matrix[2 * t + 8 * r + half, g] = value
    return a_matrix @ b_matrix


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quant_mma_decoding_gives_every_stored_value_exactly(scheme: str, dtype: torch.dtype) -> None:
    """Every stored byte through decode_unit's bit operations (the constants the kernel is compiled
    with) comes out as its value, in the documented order of input features."""
    from kernels.quant_gemm import VALUES_PER_CHUNK

    bits = {"int8": 8, "int4": 4}[scheme]
    per_unit = 8
    values = torch.arange(256 * 8 // bits, dtype=torch.int64) % (1 << bits) - (1 << (bits - 1))
    values = values[torch.randperm(len(values), generator=torch.Generator().manual_seed(3))]
    chunks = values.view(-1, VALUES_PER_CHUNK[scheme]).to(torch.int8)
    raw = pack_int32(chunks, bits).numpy().view(np.uint32)  # [num_chunks, 4 words]
    order = [0, 4, 1, 5, 2, 6, 3, 7] if scheme == "int4" else list(range(8))
    for unit in range(VALUES_PER_CHUNK[scheme] // per_unit):
        pairs = _decode_unit(raw, unit, scheme, dtype)
        decoded = np.stack([v for p in pairs for v in _halves(p, dtype)], -1)  # [num_chunks, 8]
        expected = chunks[:, unit * per_unit : (unit + 1) * per_unit][:, order].double().numpy()
        assert np.array_equal(decoded, expected), f"unit {unit}"


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quant_mma_fragments_multiply_matching_input_features(scheme: str, dtype: torch.dtype) -> None:
    """One warp tile over one K step as the kernel builds it (lane g, t: chunk t of outputs g and
    g + 8, x row g at the same features), through the PTX fragment placement: x @ q.T exactly."""
    from kernels.quant_gemm import MMA_STEP, VALUES_PER_CHUNK

    bits, vals = {"int8": 8, "int4": 4}[scheme], VALUES_PER_CHUNK[scheme]
    generator = torch.Generator().manual_seed(4)
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (16, MMA_STEP[scheme]), generator=generator)
    x = torch.randn(8, MMA_STEP[scheme], generator=generator).to(dtype)
    stored = (
        pack_int32(q.to(torch.int8), bits).numpy().view(np.uint32).reshape(16, 4, 4)
    )  # [out, chunk, word]
    x_words = (
        x.view(torch.int16).numpy().view(np.uint32).reshape(8, 4, vals // 8, 4)
    )  # [row, chunk, unit, word]
    lanes = np.arange(32)
    g, t = lanes // 4, lanes % 4
    result = np.zeros((16, 8))
    for unit in range(vals // 8):
        low = _decode_unit(stored[g, t], unit, scheme, dtype)  # output g
        high = _decode_unit(stored[g + 8, t], unit, scheme, dtype)  # output g + 8
        b = _x_pairs(x_words[g, t, unit], scheme)
        for first, second in ((0, 1), (2, 3)):
            a = np.stack([low[first], high[first], low[second], high[second]], -1)
            result += _mma_m16n8k16(a, np.stack([b[first], b[second]], -1), dtype)
    assert np.array_equal(result, (q.double() @ x.double().T).numpy())


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_mma_config_covers_every_output_row_and_step_once(scheme: str) -> None:
    from kernels.quant_gemm import (
        BITS,
        MMA_PARTIAL_FRACTION,
        MMA_ROW_TILES,
        MMA_STEP,
        MMA_TILES_M,
        MMA_WARPS,
        mma_config,
    )

    for num_rows in (1, 7, 8, 9, 16, 17, 32, 33, 64, 65, 200, 256, 300):
        for n, k in ((80, 384), (3584, 18944), (37888, 3584), (2048, 2048)):
            config = mma_config(num_rows, n, k, scheme, num_sms=132)
            grid_x, grid_y, splits = config.grid
            assert config.row_tiles in MMA_ROW_TILES and splits == config.splits
            assert config.k_warps in (1, MMA_WARPS) and (num_rows > 16 or config.k_warps == MMA_WARPS)
            outputs_per_block = 16 * MMA_TILES_M * MMA_WARPS // config.k_warps
            assert grid_x * outputs_per_block >= n > (grid_x - 1) * outputs_per_block
            assert grid_y * 8 * config.row_tiles >= num_rows > (grid_y - 1) * 8 * config.row_tiles
            num_steps = k // MMA_STEP[scheme]
            # every split holds at least one step, together exactly the K steps
            assert (splits - 1) * config.steps_per_split < num_steps <= splits * config.steps_per_split
            assert config.steps_per_split % (config.k_warps * config.unroll) == 0  # whole turns of every warp
            if splits > 1:  # the partial sums stay a small fraction of the weight's traffic
                assert splits * 8 * num_rows * n <= MMA_PARTIAL_FRACTION * n * k * BITS[scheme] // 8
            if num_rows <= 8:
                assert config.row_tiles == 1 and config.unroll == 2
            elif num_rows <= 16:
                assert config.row_tiles == 2
            elif num_rows > 32:
                assert config.row_tiles == 8
    # a batch-1 product on few outputs splits K to fill the card; a wide one does not need to
    assert mma_config(1, 3584, 18944, scheme, 132).splits > 1
    assert mma_config(1, 37888, 3584, scheme, 132).splits == 1
    with pytest.raises(ValueError, match="cannot take"):
        mma_config(4, 64, MMA_STEP[scheme] + 8, scheme, 132)


def test_quant_mma_takes_int_groups_of_whole_steps_only() -> None:
    from kernels.quant_gemm import mma_shape_fits

    x = torch.randn(20, 256, dtype=torch.bfloat16)
    for scheme, group, fits in (
        ("int8", None, True),
        ("int8", 64, True),
        ("int8", 32, False),
        ("int4", 128, True),
        ("int4", None, True),
        ("int4", 64, False),
        ("int4", 32, False),
    ):
        qweight, scale = quantize_weight_ref(random_weight(48, 256), scheme, group)
        assert mma_shape_fits(x, qweight, scale, scheme) == fits, f"{scheme} g{group}"
        assert not mma_shape_fits(x.float(), qweight, scale, scheme)
        assert not mma_shape_fits(x[:0], qweight, scale, scheme)
    qweight, scale = quantize_weight_ref(random_weight(48, 256), "fp8")
    assert not mma_shape_fits(x, qweight, scale, "fp8")  # fp8 goes to quant_gemv / _scaled_mm
    qweight, scale = quantize_weight_ref(random_weight(48, 192), "int8")
    assert mma_shape_fits(x[:, :192].contiguous(), qweight, scale, "int8")  # 192 features: 3 steps of 64
    qweight, scale = quantize_weight_ref(random_weight(48, 160), "int8")  # 160 features: not whole steps
    assert not mma_shape_fits(torch.randn(4, 160, dtype=torch.bfloat16), qweight, scale, "int8")


def test_dispatch_by_row_count() -> None:
    from kernels.quant_gemm import FP8_GEMV_MAX_ROWS, MAX_ROWS, MMA_MAX_ROWS, choose_path

    # int8 / int4 whose groups are whole steps: one row on the one-row kernel, then tensor cores
    assert choose_path(1, gemv_ok=True, mma_ok=True, scaled_mm_ok=False) == "gemv"
    for num_rows in (2, MAX_ROWS, MAX_ROWS + 1, MMA_MAX_ROWS):
        assert choose_path(num_rows, gemv_ok=num_rows <= MAX_ROWS, mma_ok=True, scaled_mm_ok=False) == "mma"
    assert choose_path(MMA_MAX_ROWS + 1, gemv_ok=False, mma_ok=True, scaled_mm_ok=False) == "dequantize"
    # int4 in groups of 32: the one-row kernel up to MAX_ROWS, then dequantize + cuBLAS
    assert choose_path(MAX_ROWS, gemv_ok=True, mma_ok=False, scaled_mm_ok=False) == "gemv"
    assert choose_path(MAX_ROWS + 1, gemv_ok=False, mma_ok=False, scaled_mm_ok=False) == "dequantize"
    # fp8 on an sm_89+ card: the one-row kernel up to FP8_GEMV_MAX_ROWS, then the FP8 tensor cores
    assert choose_path(FP8_GEMV_MAX_ROWS, gemv_ok=True, mma_ok=False, scaled_mm_ok=True) == "gemv"
    assert choose_path(FP8_GEMV_MAX_ROWS + 1, gemv_ok=True, mma_ok=False, scaled_mm_ok=True) == "scaled_mm"
    assert choose_path(600, gemv_ok=False, mma_ok=False, scaled_mm_ok=True) == "scaled_mm"


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


MMA_GROUPS = {"int8": [None, 64], "int4": [None, 128, 256]}
MMA_ROW_COUNTS = (1, 2, 5, 8, 9, 16, 17, 32, 33, 64, 65, 130, 256)
"""Every row-count class of mma_config: 1 and 2 row tiles (K split), 4, 8 (and several grid rows)."""


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_quant_mma_matches_reference(scheme: str, dtype: torch.dtype) -> None:
    """The tensor-core kernel against the float64 product with the dequantized weight (its integer
    weights are exact; only the summation order and the output rounding differ) over every shape,
    group size and row-count class; every failing case is listed, not just the first."""
    from kernels.quant_gemm import mma_config, mma_fits, quant_mma_cuda

    generator = torch.Generator().manual_seed(34)
    worst, failures = 0.0, []
    for n, k in SHAPES:
        for group_size in [g for g in MMA_GROUPS[scheme] if g is None or k % g == 0]:
            qweight, scale = _cuda_weight(n, k, scheme, group_size, n + 2 * k)
            weight = dequantize_weight_ref(qweight, scale, scheme, torch.float64)
            bias = torch.randn(n, generator=generator).to("cuda", dtype)
            for num_rows in MMA_ROW_COUNTS if n * k < 1e7 else (1, 3, 16, 17, 64, 256):
                x = torch.randn(num_rows, k, generator=generator).to("cuda", dtype)
                assert mma_fits(x, qweight, scale, scheme)
                product = x.double() @ weight.t()
                for b in (None, bias):
                    poison_allocator((num_rows, n), dtype, x.device)
                    out = quant_mma_cuda(x, qweight, scale, scheme, b)
                    torch.cuda.synchronize()
                    expected = product + (b.double() if b is not None else 0)
                    error = rel_error(out, expected) if not torch.isnan(out).any() else float("nan")
                    if not error < TOLERANCE[dtype]:
                        splits = mma_config(num_rows, n, k, scheme, _cuda.num_sms(0)).splits
                        failures.append(f"g{group_size} {num_rows}x{k}x{n} splits {splits}: {error:.2e}")
                    elif error > worst:
                        worst = error
    print(f"\nquant_mma {scheme} {dtype}: max relative error vs the dequantized float64 product {worst:.2e}")
    assert not failures, f"{len(failures)} failing cases: " + "; ".join(failures[:20])


@pytest.mark.gpu
@needs_cuda
def test_cuda_quant_mma_needs_whole_step_groups_and_can_be_switched_off(monkeypatch) -> None:
    from kernels.quant_gemm import MMA_ENV, mma_fits, quant_mma_cuda

    x = torch.randn(20, 256, device="cuda", dtype=torch.bfloat16)
    qweight, scale = _cuda_weight(64, 256, "int4", 128, 1)
    assert mma_fits(x, qweight, scale, "int4")
    small_groups, small_scale = _cuda_weight(64, 256, "int4", 32, 1)
    assert not mma_fits(x, small_groups, small_scale, "int4")
    with pytest.raises(_cuda.KernelError, match="quant_mma takes int4"):
        quant_mma_cuda(x, small_groups, small_scale, "int4")
    monkeypatch.setenv(MMA_ENV, "off")
    assert not mma_fits(x, qweight, scale, "int4")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_cuda_quant_mma_takes_strided_rows_and_replays_from_a_graph(scheme: str) -> None:
    """Batch 1 on a narrow, deep matrix (K split over the grid, partial sums reduced) and 40 rows:
    strided x equals contiguous x, and graph replays equal eager calls on the new input."""
    from kernels.quant_gemm import mma_config, quant_mma_cuda

    generator = torch.Generator().manual_seed(35)
    n, k = 2048, 8192
    qweight, scale = _cuda_weight(n, k, scheme, 128 if scheme == "int4" else None, 7)
    assert mma_config(1, n, k, scheme, _cuda.num_sms(0)).splits > 1
    for num_rows in (1, 40):
        wide = torch.randn(num_rows, k + 512, generator=generator).to("cuda", torch.bfloat16)
        x = wide[:, 256 : 256 + k]
        eager = quant_mma_cuda(x, qweight, scale, scheme)
        assert torch.equal(eager, quant_mma_cuda(x.contiguous(), qweight, scale, scheme))
        static = x.contiguous()
        quant_mma_cuda(static, qweight, scale, scheme)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = quant_mma_cuda(static, qweight, scale, scheme)
        fresh = torch.randn(num_rows, k, generator=generator).to("cuda", torch.bfloat16)
        static.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, quant_mma_cuda(fresh, qweight, scale, scheme)), f"{num_rows} rows"


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


@needs_nvcc
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quant_mma_compiles_for_sm90(scheme: str, tmp_path) -> None:
    """Where the CUDA toolkit is installed, the tensor-core kernel's source assembles for sm_90 as
    quant_mma_cuda compiles it for 1, 64 and 256 rows, bf16 and fp16 (the launch's -D macros),
    without spilling registers."""
    from kernels.quant_gemm import (
        MMA_SOURCE,
        MMA_TILES_M,
        MMA_WARPS,
        SCHEME_IDS,
        decode_constants,
        mma_config,
    )

    for dtype in (torch.bfloat16, torch.float16):
        for num_rows, out_features in ((1, 4096), (64, 4096), (256, 32768)):  # k_warps 4, 4, 1
            config = mma_config(num_rows, out_features, 4096, scheme, num_sms=132)
            defines = dict(
                DTYPE=_cuda.DTYPE_IDS[dtype],
                SCHEME=SCHEME_IDS[scheme],
                WARPS=MMA_WARPS,
                WM=MMA_TILES_M,
                NT=config.row_tiles,
                KW=config.k_warps,
                UNROLL=config.unroll,
                HAS_BIAS=1,
                **decode_constants(scheme, dtype),
            )
            registers = assemble_sm90(MMA_SOURCE, defines, tmp_path)
            assert set(registers) == {"quant_mma", "quant_mma_reduce"}
            print(f"\nquant_mma {scheme} {dtype} {num_rows} rows registers: {registers}")
