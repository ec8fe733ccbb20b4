"""The tile layout of int8 / int4 weights and `quant_tiled` (kernels/quant_tiled_ref.py,
kernels/quant_tiled.py).

On CPU: repacking then unpacking gives back the compressed-tensors integers and scales for every
shape the layout takes (odd ones padded), weights it cannot take are refused with the rule named,
one warp tile through the kernel's decoding and the PTX fragment placement multiplies exactly,
the K split covers every tile once, the dispatch prefers the tiled kernel, the whole kernel (and
both ways of adding K splits) runs on the host against the reference, and every compiled variant
assembles for sm_90 without spills. On a GPU: the kernel against the reference over shapes, row
counts 1..256, group sizes, dtypes, both ways of adding K splits, strided rows and CUDA graph replay.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import kernels
from kernels import _cuda
from kernels.quant_ref import BITS, dequantize_weight_ref, pack_int32, quantize_weight_ref, unpack_int32
from kernels.quant_tiled import SplitReduce
from kernels.quant_tiled_ref import (
    CHUNKS,
    TILE_K,
    TILE_N,
    TiledWeight,
    lane_positions,
    repack_tiles,
    tiled_linear_ref,
    unpack_tiles,
)
from tests.kernels.helpers import (
    assemble_sm90,
    needs_cuda,
    needs_gxx,
    needs_nvcc,
    poison_allocator,
    rel_error,
)
from tests.kernels.test_quant import _decode_unit, _halves, _mma_m16n8k16, random_weight

TILED_GROUPS = {"int8": [None, 64, 128], "int4": [None, 64, 128, 256]}
ODD_SHAPES = [(1, 8), (16, 64), (17, 200), (37, 72), (80, 384), (130, 1000), (48, 640)]
"""(out_features, in_features): one output, whole tiles, and outputs / features padded to tiles."""


def _quantized(
    n: int, k: int, scheme: str, group_size: int | None, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    return quantize_weight_ref(random_weight(n, k, seed), scheme, group_size)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_repack_then_unpack_gives_back_the_integers_and_scales(scheme: str) -> None:
    for n, k in ODD_SHAPES:
        for group_size in [g for g in TILED_GROUPS[scheme] if g is None or k % g == 0]:
            qweight, scale = _quantized(n, k, scheme, group_size, seed=n + k)
            tiled = repack_tiles(qweight, scale, scheme)
            n_tiles, k_tiles = -(-n // TILE_N), -(-k // TILE_K)
            assert tiled.tiles.shape == (k_tiles, n_tiles, CHUNKS[scheme] * 32 * 4)
            assert tiled.tiles.dtype == torch.int32 and tiled.tiles.is_contiguous()
            assert tiled.scales.shape == (scale.shape[1], n_tiles, 8, 2)
            # 16 * 64 values a tile: the stored bytes are the weight's, padded to whole tiles
            assert tiled.tiles.numel() * 32 == n_tiles * k_tiles * TILE_N * TILE_K * BITS[scheme]
            restored, restored_scale = unpack_tiles(tiled)
            assert torch.equal(restored, qweight), f"{scheme} {n}x{k} g{group_size}"
            assert torch.equal(restored_scale, scale), f"{scheme} {n}x{k} g{group_size}"


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_every_tile_position_is_stored_once_and_padding_is_zero(scheme: str) -> None:
    """Each of a tile's 16 x 64 positions has one field; a weight of 17 x 72 is stored as the same
    weight padded with zero values (and zero scales) to 32 x 128."""
    rows, cols = lane_positions(scheme)
    assert sorted((rows * TILE_K + cols).flatten().tolist()) == list(range(TILE_N * TILE_K))
    qweight, scale = _quantized(17, 72, scheme, None)
    padded_values = torch.zeros(32, 128, dtype=torch.int8)
    padded_values[:17, :72] = unpack_int32(qweight, BITS[scheme])
    padded_scale = torch.zeros(32, 1)
    padded_scale[:17] = scale
    padded = repack_tiles(pack_int32(padded_values, BITS[scheme]), padded_scale, scheme)
    tiled = repack_tiles(qweight, scale, scheme)
    assert torch.equal(tiled.tiles, padded.tiles) and torch.equal(tiled.scales, padded.scales)


def test_weights_the_layout_cannot_hold_are_refused_with_the_rule() -> None:
    qweight, scale = _quantized(32, 256, "int4", 32)
    with pytest.raises(ValueError, match="groups of 32 input features split a tile of 64"):
        repack_tiles(qweight, scale, "int4")
    qweight, scale = _quantized(32, 36, "int8", None)
    with pytest.raises(ValueError, match="a multiple of 8"):
        repack_tiles(qweight, scale, "int8")
    qweight, scale = _quantized(32, 128, "fp8", None)
    with pytest.raises(ValueError, match="int8 / int4 weights, not 'fp8'"):
        repack_tiles(qweight, scale, "fp8")
    qweight, scale = _quantized(32, 128, "int4", None)
    with pytest.raises(ValueError, match="not a compressed-tensors int32 weight with float32 scales"):
        repack_tiles(qweight, scale.double(), "int4")
    with pytest.raises(ValueError, match="does not fit weight"):
        repack_tiles(qweight, scale[:16], "int4")


def _tile_words(tiled: TiledWeight, k_tile: int, n_tile: int) -> np.ndarray:
    """One tile's stored words as lanes hold them: uint32 [chunks, 32 lanes, 4 words]."""
    words = tiled.tiles[k_tile, n_tile].numpy().view(np.uint32)
    return words.reshape(CHUNKS[tiled.scheme], 32, 4)


def _ldmatrix_b(x_words: np.ndarray, step: int) -> np.ndarray:
    """The B registers of k16 step `step` as ldmatrix (no transpose) gives them from x's shared rows
    (uint32 [8 rows, 32 pairs of features]): lane (g, t) gets row g, pair t of each 8-feature matrix."""
    lanes = np.arange(32)
    g, t = lanes // 4, lanes % 4
    return np.stack([x_words[g, 8 * step + t], x_words[g, 8 * step + 4 + t]], -1)  # [32, 2]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_warp_tile_multiplies_exactly_through_the_fragment_placement(
    scheme: str, dtype: torch.dtype
) -> None:
    """Each lane's 16-byte chunks of a tile, decoded as the kernel's decode_step does (before the
    scale), with x's B fragments from ldmatrix, through the PTX m16n8k16 placement: q @ x.T exactly,
    for the second tile of each direction (the layout's tile order)."""
    bits = BITS[scheme]
    generator = torch.Generator().manual_seed(5)
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (2 * TILE_N, 2 * TILE_K), generator=generator)
    tiled = repack_tiles(pack_int32(q.to(torch.int8), bits), torch.ones(2 * TILE_N, 1), scheme)
    x = torch.randn(8, 2 * TILE_K, generator=generator).to(dtype)
    x_words = x[:, TILE_K:].contiguous().view(torch.int16).numpy().view(np.uint32)  # [8, 32]
    raw = _tile_words(tiled, 1, 1)
    result = np.zeros((TILE_N, 8))
    for step in range(4):
        if scheme == "int4":
            a = np.stack(_decode_unit(raw[0], step, scheme, dtype), -1)  # [32 lanes, 4 registers]
        else:
            a = np.stack(_decode_unit(raw[step // 2], step % 2, scheme, dtype), -1)
        result += _mma_m16n8k16(a, _ldmatrix_b(x_words, step), dtype)
    expected = q[TILE_N:, TILE_K:].double() @ x[:, TILE_K:].double().T
    assert np.array_equal(result, expected.numpy())


def test_each_lane_reads_the_scales_of_its_two_outputs() -> None:
    qweight, scale = _quantized(40, 256, "int4", 128)
    tiled = repack_tiles(qweight, scale, "int4")
    for group in range(2):
        for tile in range(3):
            for g in range(8):
                for h in range(2):
                    n = 16 * tile + g + 8 * h
                    expected = scale[n, group] if n < 40 else 0.0
                    assert tiled.scales[group, tile, g, h] == expected


def test_decode_is_exact_before_the_scale() -> None:
    """The A registers hold the weight's integers (the scale multiplies them afterwards)."""
    qweight, scale = _quantized(16, 64, "int4", None)
    tiled = repack_tiles(qweight, scale, "int4")
    a = _decode_unit(_tile_words(tiled, 0, 0)[0], 0, "int4", torch.bfloat16)
    low, _ = _halves(a[0], torch.bfloat16)  # lane (g, t): output g, feature 2t
    values = dequantize_weight_ref(qweight, torch.ones_like(scale), "int4", torch.float64)
    assert np.array_equal(low, values[np.arange(32) // 4, 2 * (np.arange(32) % 4)].numpy())


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_tiled_config_covers_every_tile_once(scheme: str) -> None:
    from kernels.quant_tiled import (
        MAX_SHARED_BYTES,
        MIN_STAGES_PER_SPLIT,
        PARTIAL_FRACTION,
        PARTIAL_MIN_BYTES,
        split_reduce,
        tiled_config,
    )

    for n, k in ((16, 128), (80, 384), (3584, 18944), (37888, 3584), (2048, 8192), (130, 1000)):
        qweight, scale = _quantized(n, k, scheme, None)
        tiled = TiledWeight(
            torch.empty(-(-k // TILE_K), -(-n // TILE_N), 1), scale[:, :1], scheme, n, k, k
        )  # only the shapes matter here
        del qweight
        for num_rows in (1, 7, 8, 9, 16, 17, 32, 33, 64, 65, 130, 256):
            config = tiled_config(num_rows, tiled, num_sms=132)
            row_blocks, out_blocks, splits = config.grid
            assert row_blocks * 8 * config.row_tiles >= num_rows > (row_blocks - 1) * 8 * config.row_tiles
            block_tiles = config.n_warps * config.warp_tiles
            assert out_blocks * block_tiles >= tiled.n_tiles > (out_blocks - 1) * block_tiles
            assert config.tiles_per_split % config.k_warps == 0  # whole stages
            assert (splits - 1) * config.tiles_per_split < tiled.k_tiles <= splits * config.tiles_per_split
            assert config.shared_bytes <= MAX_SHARED_BYTES
            assert config.reduce == split_reduce(splits) and (config.reduce == "none") == (splits == 1)
            if splits > 1:
                assert config.tiles_per_split >= MIN_STAGES_PER_SPLIT * config.k_warps
                budget = max(PARTIAL_FRACTION * n * k * BITS[scheme] // 8, PARTIAL_MIN_BYTES)
                assert splits * 8 * num_rows * n <= budget
    with pytest.raises(ValueError, match="at least one row"):
        tiled_config(0, tiled, 132)


def test_k_splits_are_added_by_the_last_block_up_to_the_limit_then_by_the_reduce_kernel(monkeypatch) -> None:
    from kernels import quant_tiled
    from kernels.quant_tiled import split_reduce, tiled_config

    monkeypatch.setattr(quant_tiled, "LAST_BLOCK_MAX_SPLITS", 4)
    assert [split_reduce(s) for s in (1, 2, 4, 5, 19)] == ["none"] + ["last_block"] * 2 + [
        "reduce_kernel"
    ] * 2
    monkeypatch.setattr(quant_tiled, "LAST_BLOCK_MAX_SPLITS", 1)
    assert [split_reduce(s) for s in (1, 2, 19)] == ["none", "reduce_kernel", "reduce_kernel"]
    narrow_deep = TiledWeight(torch.empty(64, 3, 1), torch.empty(1, 3, 8, 2), "int4", 48, 4096, 128)
    wide = TiledWeight(torch.empty(32, 2368, 1), torch.empty(1, 2368, 8, 2), "int4", 37888, 2048, 128)
    for num_rows in (16, 33, 64):  # a few output tiles over a deep K: a wide split
        assert tiled_config(num_rows, narrow_deep, 132).splits > 1
        forced = tiled_config(num_rows, narrow_deep, 132, reduce="last_block")
        assert forced.reduce == "last_block" and forced.grid == tiled_config(num_rows, narrow_deep, 132).grid
    assert tiled_config(64, wide, 132, reduce="last_block").reduce == "none"  # its tiles fill the SMs
    with pytest.raises(ValueError, match="not a way to add splits"):
        tiled_config(16, narrow_deep, 132, reduce="none")


def test_the_split_workspace_grows_only_past_its_size_and_keeps_what_it_outgrew(monkeypatch) -> None:
    """Launches share one buffer; one needing more gets a new one at least twice as large, and the
    old one stays allocated (a CUDA graph captured on it keeps valid memory)."""
    from kernels import quant_tiled
    from kernels.quant_tiled import split_partials

    monkeypatch.setattr(quant_tiled, "_WORKSPACES", {})
    cpu = torch.device("cpu")
    first = split_partials(4, 3, 5, cpu)
    assert first.shape == (4, 3, 5) and first.dtype == torch.float32
    smaller = split_partials(2, 2, 5, cpu)
    assert smaller.data_ptr() == first.data_ptr()
    grown = split_partials(5, 3, 5, cpu)
    assert grown.data_ptr() != first.data_ptr() and grown.untyped_storage().nbytes() >= 2 * 60 * 4
    assert split_partials(1, 1, 1, cpu).data_ptr() == grown.data_ptr()
    kept = quant_tiled._WORKSPACES[cpu, torch.float32]
    assert [buffer.data_ptr() for buffer in kept] == [first.data_ptr(), grown.data_ptr()]


def test_dispatch_by_rows_with_the_tile_layout_and_the_cpu_keeps_the_reference(monkeypatch) -> None:
    from kernels.quant_gemm import MMA_MAX_ROWS, TILED_MAX_ROWS, TILED_MIN_ROWS, choose_path
    from kernels.quant_tiled import KERNEL_ENV, kernel_enabled

    assert TILED_MIN_ROWS > 1 and TILED_MAX_ROWS <= MMA_MAX_ROWS  # a narrower matrix's rows go to quant_mma
    paths = [  # rows: (a matrix wide enough (TILED_MIN_WIDTH) with the tile layout, a narrower one, none)
        (1, ("gemv", "gemv", "gemv")),
        (TILED_MIN_ROWS - 1, ("mma", "mma", "mma")),
        (TILED_MIN_ROWS, ("tiled", "mma", "mma")),
        (TILED_MAX_ROWS, ("tiled", "mma", "mma")),
        (MMA_MAX_ROWS + 1, ("dequantize", "dequantize", "dequantize")),
    ]
    for num_rows, expected in paths:
        gemv_ok = num_rows <= 16
        chosen = tuple(
            choose_path(num_rows, gemv_ok=gemv_ok, mma_ok=True, scaled_mm_ok=False, tiled_ok=tiled, wide=wide)
            for tiled, wide in ((True, True), (True, False), (False, True))
        )
        assert chosen == expected, num_rows
    assert kernel_enabled()
    monkeypatch.setenv(KERNEL_ENV, "mma")
    assert not kernel_enabled()
    qweight, scale = _quantized(40, 256, "int4", 128)
    tiled = repack_tiles(qweight, scale, "int4")
    x, bias = torch.randn(3, 256).to(torch.bfloat16), torch.randn(40).to(torch.bfloat16)
    expected = tiled_linear_ref(x, tiled, bias)
    assert torch.equal(kernels.quant_linear(x, qweight, scale, "int4", bias, tiled=tiled), expected)


def test_quantized_layer_repacks_only_on_a_gpu_and_only_what_fits() -> None:
    from shared.model.quant_config import QuantScheme
    from shared.model.quantization import QuantizedLinear, repack_layers

    layer = QuantizedLinear(256, 40, False, QuantScheme(method="int4", group_size=128), torch.bfloat16)
    qweight, scale = _quantized(40, 256, "int4", 128)
    layer.weight_packed.data.copy_(qweight)
    layer.weight_scale.data.copy_(scale)
    repack_layers(layer)
    assert layer.tiled is None and not layer.tileable()  # on CPU the reference reads the stored weight
    layer.repack()
    assert layer.tiled is not None and torch.equal(unpack_tiles(layer.tiled)[0], qweight)
    small_groups = QuantizedLinear(256, 40, False, QuantScheme(method="int4", group_size=32), torch.bfloat16)
    assert not small_groups.tileable()


def _variant_defines(
    scheme: str, dtype: torch.dtype, shape: tuple[int, int, int, int], last_block: bool = False
) -> dict[str, int]:
    from kernels.quant_gemm import SCHEME_IDS, decode_constants
    from kernels.quant_tiled import STAGES

    row_tiles, k_warps, n_warps, warp_tiles = shape
    return dict(
        DTYPE=_cuda.DTYPE_IDS[dtype],
        SCHEME=SCHEME_IDS[scheme],
        MT=row_tiles,
        KW=k_warps,
        NW=n_warps,
        TW=warp_tiles,
        STAGES=STAGES,
        HAS_BIAS=1,
        LAST_BLOCK=int(last_block),
        **decode_constants(scheme, dtype),
    )


@needs_nvcc
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_variant_compiles_for_sm90_without_spills(scheme: str, dtype: torch.dtype, tmp_path) -> None:
    """Each default block shape (1-8, 9-16, 17-32, 33+ rows) as quant_tiled_cuda compiles it, and
    the one-row shape with the last-block sum of a K split (the candidate shapes only the benchmark
    times are compiled on the GPU it runs on)."""
    from kernels.quant_tiled import TILED_SOURCE, block_shape

    variants = [(shape, False) for shape in sorted({block_shape(rows) for rows in (1, 16, 32, 64)})]
    for shape, last_block in [*variants, (block_shape(1), True)]:
        defines = _variant_defines(scheme, dtype, shape, last_block)
        registers = assemble_sm90(TILED_SOURCE, defines, tmp_path)
        assert set(registers) == {"quant_tiled"}
        print(f"\nquant_tiled {scheme} {dtype} MTxKWxNWxTW {shape} last block {last_block}: {registers}")


@needs_nvcc
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_split_reduce_compiles_for_sm90_without_spills(dtype: torch.dtype, tmp_path) -> None:
    from kernels.quant_tiled import REDUCE_SOURCE, REDUCE_THREADS

    for has_bias in (0, 1):
        defines = dict(DTYPE=_cuda.DTYPE_IDS[dtype], HAS_BIAS=has_bias, REDUCE_THREADS=REDUCE_THREADS)
        assert set(assemble_sm90(REDUCE_SOURCE, defines, tmp_path)) == {"quant_tiled_reduce"}


HOST_PTX = r"""
typedef unsigned short scalar_t;
static inline float to_float(unsigned short h) {
#if DTYPE == DT_BF16
    return __uint_as_float((unsigned)h << 16);
#else
    _Float16 v; std::memcpy(&v, &h, 2); return (float)v;
#endif
}
static inline unsigned short from_float(float f) {   /* round to nearest even */
#if DTYPE == DT_BF16
    const unsigned u = __float_as_uint(f);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#else
    const _Float16 v = (_Float16)f; unsigned short h; std::memcpy(&h, &v, 2); return h;
#endif
}
static unsigned warp_words[1024][6];
static const void* warp_pointers[1024];
static inline void warp_sync() { warp_barriers[threadIdx.x / 32]->arrive_and_wait(); }
static inline unsigned half_of(unsigned r, int h) { return h ? r >> 16 : r & 0xffffu; }
static inline void mma16816(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    const int lane = threadIdx.x & 31, base = threadIdx.x - lane, g = lane >> 2, t = lane & 3;
    for (int r = 0; r < 4; ++r) warp_words[threadIdx.x][r] = a[r];
    warp_words[threadIdx.x][4] = b0; warp_words[threadIdx.x][5] = b1;
    warp_sync();
    for (int c = 0; c < 4; ++c) {   /* D row g + 8 (c >> 1), column 2 t + (c & 1) */
        const int row = g + 8 * (c >> 1), col = 2 * t + (c & 1);
        float sum = d[c];
        for (int k = 0; k < 16; ++k) {
            const int pair = (k & 7) >> 1, half = k & 1;
            const unsigned a_reg = warp_words[base + 4 * (row & 7) + pair][(row >> 3) + 2 * (k >> 3)];
            const unsigned b_reg = warp_words[base + 4 * col + pair][4 + (k >> 3)];
            sum += to_float(half_of(a_reg, half)) * to_float(half_of(b_reg, half));
        }
        d[c] = sum;
    }
    warp_sync();
}
static inline void ldmatrix_x4(unsigned* r, const void* p) {
    const int lane = threadIdx.x & 31, base = threadIdx.x - lane;
    warp_pointers[threadIdx.x] = p;
    warp_sync();
    for (int m = 0; m < 4; ++m)
        std::memcpy(&r[m], (const char*)warp_pointers[base + 8 * m + lane / 4] + 4 * (lane % 4), 4);
    warp_sync();
}
static inline unsigned prmt(unsigned lo, unsigned hi, unsigned selector) {
    unsigned char bytes[8], out[4];
    std::memcpy(bytes, &lo, 4); std::memcpy(bytes + 4, &hi, 4);
    for (int i = 0; i < 4; ++i) out[i] = bytes[(selector >> (4 * i)) & 7];
    unsigned d; std::memcpy(&d, out, 4); return d;
}
static inline unsigned pack_x2(float lo, float hi) { return from_float(lo) | ((unsigned)from_float(hi) << 16); }
static inline unsigned fma_x2(unsigned a, unsigned b, unsigned c) {   /* exact in float for the kernel's operands */
    float r[2];
    for (int h = 0; h < 2; ++h)
        r[h] = std::fma(to_float(half_of(a, h)), to_float(half_of(b, h)), to_float(half_of(c, h)));
    return pack_x2(r[0], r[1]);
}
static inline void cp_async16(void* dst, const void* src, bool valid) {
    if (valid) std::memcpy(dst, src, 16); else std::memset(dst, 0, 16);
}
static inline void cp_async_commit() {}
template <int N> static inline void cp_async_wait() {}
"""
"""C++ twins of quant_tiled's PTX primitives for a host run: mma and ldmatrix as warps meeting at a
barrier and reading each other's registers as the PTX ISA places fragments, cp.async as a copy
(completed at once, so waiting is a no-op)."""


HOST_HEADER = "#define DT_BF16 1\n#define DT_F16 2\n"


def _run_tiled_on_host(
    x: torch.Tensor,
    tiled: TiledWeight,
    bias: torch.Tensor | None,
    num_sms: int,
    tmp_path,
    shape: tuple[int, int, int, int] | None = None,
    reduce: SplitReduce | None = None,
) -> torch.Tensor:
    """quant_tiled_cuda's launches run on the host: the kernel, then `quant_tiled_reduce` where the
    config leaves the K splits to it (`last_block`: the last block of each output tile, in launch
    order, adds them)."""
    from kernels.quant_tiled import TILED_KERNELS, TILED_MACROS, kernel_defines, tiled_config
    from tests.kernels.helpers import run_threads_on_host

    config = tiled_config(x.shape[0], tiled, num_sms, shape, reduce)
    defines = kernel_defines(tiled, x.dtype, config, bias is not None)
    kernels_source = TILED_KERNELS.replace(
        "extern __shared__ __align__(16) unsigned char smem[];",
        f"alignas(16) static unsigned char smem[{config.shared_bytes}];",
    )
    source = HOST_HEADER + TILED_MACROS + HOST_PTX + kernels_source
    num_rows, n = x.shape[0], tiled.out_features
    out = torch.full((num_rows, n), float("nan"), dtype=x.dtype)
    partial = torch.full((config.splits, num_rows, n), float("nan")) if config.splits > 1 else None
    counters = None
    if config.reduce == "last_block":
        counters = torch.zeros(config.grid[0] * config.grid[1], dtype=torch.int32)
    words = x.view(torch.int16)
    bias_words = bias.view(torch.int16) if bias is not None else words
    args = (words, tiled.tiles, tiled.scales, bias_words, out.view(torch.int16), partial, counters)
    sizes = (
        num_rows,
        n,
        tiled.in_features,
        tiled.n_tiles,
        tiled.k_tiles,
        tiled.group_tiles,
        x.stride(0),
        config.tiles_per_split,
    )
    run_threads_on_host(source, "quant_tiled", defines, config.grid, config.threads, args + sizes, tmp_path)
    if counters is not None:
        assert not counters.any(), "the last split of each output tile leaves its counter zero"
    if partial is not None and config.reduce == "reduce_kernel":
        _reduce_on_host(partial, bias_words, out, bias is not None, tmp_path)
    return out


def _reduce_on_host(
    partial: torch.Tensor, bias_words: torch.Tensor, out: torch.Tensor, has_bias: bool, tmp_path
) -> None:
    """`quant_tiled_reduce` run on the host as quant_tiled_cuda launches it."""
    from kernels.quant_tiled import REDUCE_KERNEL, REDUCE_THREADS
    from tests.kernels.helpers import run_threads_on_host

    splits, num_rows, n = partial.shape
    defines = dict(DTYPE=_cuda.DTYPE_IDS[out.dtype], HAS_BIAS=int(has_bias), REDUCE_THREADS=REDUCE_THREADS)
    grid = (-(-num_rows * n // REDUCE_THREADS),)
    args = (partial, bias_words, out.view(torch.int16), splits, num_rows, n)
    source = HOST_HEADER + HOST_PTX + REDUCE_KERNEL
    run_threads_on_host(source, "quant_tiled_reduce", defines, grid, REDUCE_THREADS, args, tmp_path)


HOST_CASES = [  # (scheme, out_features, in_features, group_size, rows): every block shape, odd edges, a K split
    ("int4", 40, 1024, 128, 3),
    ("int8", 40, 1024, None, 3),
    ("int4", 17, 200, None, 9),
    ("int8", 80, 384, 128, 17),
    ("int4", 70, 256, 64, 40),
]


@needs_gxx
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_run_on_the_host_matches_reference(dtype: torch.dtype, tmp_path) -> None:
    """The whole CUDA source (pipeline, warps' tile columns and output tiles, the reduction over
    warps, the K split and the rule's way of adding it, bias, row and output edges) run as C++
    threads with the PTX primitives' twins: the reference's product within the GPU test's
    tolerance, every output written. Two SMs make the narrow cases split K."""
    from kernels.quant_tiled import tiled_config

    generator = torch.Generator().manual_seed(44)
    splits_seen = set()
    for scheme, n, k, group_size, num_rows in HOST_CASES:
        tiled = repack_tiles(*_quantized(n, k, scheme, group_size, seed=n), scheme)
        x = torch.randn(num_rows, k, generator=generator).to(dtype)
        bias = torch.randn(n, generator=generator).to(dtype)
        splits_seen.add(tiled_config(num_rows, tiled, 2).splits)
        out = _run_tiled_on_host(x, tiled, bias, 2, tmp_path)
        expected = tiled_linear_ref(x.double(), tiled, bias.double())
        assert rel_error(out, expected) < TOLERANCE[dtype], f"{scheme} {num_rows}x{k}x{n} g{group_size}"
    assert max(splits_seen) > 1 and min(splits_seen) == 1


SPLIT_CASES = [  # (scheme, out_features, in_features, group_size, rows): few output tiles, deep K
    ("int4", 48, 4096, 128, 16),
    ("int8", 96, 2048, None, 33),
    ("int4", 40, 3072, 64, 64),
]
"""Products an H100's 132 SMs split wide (8-12 ways): what the reduce kernel is for."""


@needs_gxx
def test_both_ways_of_adding_k_splits_run_on_the_host_give_the_same_bits(tmp_path) -> None:
    """The split cases, as laid out for 132 SMs, with the splits added by each tile's last block and
    by quant_tiled_reduce (bias and none): the reference's product within tolerance, and the same
    bits both ways (the same sum in the same order)."""
    from kernels.quant_tiled import tiled_config

    generator = torch.Generator().manual_seed(47)
    for scheme, n, k, group_size, num_rows in SPLIT_CASES:
        qweight, scale = _quantized(n, k, scheme, group_size, seed=k)
        tiled = repack_tiles(qweight, scale, scheme)
        assert tiled_config(num_rows, tiled, 132).splits >= 8
        x = torch.randn(num_rows, k, generator=generator).to(torch.bfloat16)
        bias = torch.randn(n, generator=generator).to(torch.bfloat16) if num_rows != 33 else None
        expected = tiled_linear_ref(x.double(), tiled, bias.double() if bias is not None else None)
        last_block = _run_tiled_on_host(x, tiled, bias, 132, tmp_path, reduce="last_block")
        reduced = _run_tiled_on_host(x, tiled, bias, 132, tmp_path, reduce="reduce_kernel")
        case = f"{scheme} {num_rows}x{k}x{n} g{group_size}"
        assert rel_error(reduced, expected) < TOLERANCE[torch.bfloat16], case
        assert torch.equal(last_block.view(torch.int16), reduced.view(torch.int16)), case


@needs_gxx
def test_the_wrapper_launches_run_on_the_host_match_reference(monkeypatch, tmp_path) -> None:
    """quant_tiled_cuda itself on CPU tensors, each launch it makes run on the host (the kernel, then
    the reduce where the rule leaves the split to it): its workspace views, argument order and
    launch grids give the reference's product, unsplit, split by the rule and split by the last
    block, with bias and without."""
    from kernels import quant_tiled
    from kernels.quant_tiled import REDUCE_KERNEL, TILED_KERNELS, TILED_MACROS, split_counters
    from tests.kernels.helpers import run_threads_on_host

    sources = {
        "quant_tiled": HOST_HEADER + TILED_MACROS + HOST_PTX + TILED_KERNELS,
        "quant_tiled_reduce": HOST_HEADER + HOST_PTX + REDUCE_KERNEL,
    }
    launched: list[str] = []

    def launch(
        kernel: tuple[str, dict[str, int]],
        grid: tuple[int, ...],
        block: tuple[int],
        args: tuple[Any, ...],
        device: torch.device,
        shared_mem: int = 0,
    ) -> None:
        name, defines = kernel
        source = sources[name].replace(
            "extern __shared__ __align__(16) unsigned char smem[];",
            f"alignas(16) static unsigned char smem[{shared_mem}];",
        )
        launched.append(name)
        run_threads_on_host(source, name, defines, grid, block[0], args, tmp_path)

    monkeypatch.setattr(quant_tiled, "tiled_fits", lambda x, tiled: True)
    monkeypatch.setattr(_cuda, "num_sms", lambda index: 132)
    monkeypatch.setattr(_cuda, "function", lambda source, name, device, **defines: (name, defines))
    monkeypatch.setattr(_cuda, "set_max_dynamic_shared", lambda kernel, num_bytes: None)
    monkeypatch.setattr(_cuda, "launch", launch)
    generator = torch.Generator().manual_seed(49)
    scheme, n, k, group_size, num_rows = SPLIT_CASES[0]
    qweight, scale = _quantized(n, k, scheme, group_size, seed=k)
    deep = repack_tiles(qweight, scale, scheme)
    qweight, scale = _quantized(n, 128, scheme, 64, seed=1)
    shallow = repack_tiles(qweight, scale, scheme)  # two K tiles: no split
    bias = torch.randn(n, generator=generator).to(torch.bfloat16)
    cases: list[tuple[TiledWeight, SplitReduce | None, torch.Tensor | None, list[str]]] = [
        (deep, None, bias, ["quant_tiled", "quant_tiled_reduce"]),
        (deep, "last_block", None, ["quant_tiled"]),
        (shallow, None, bias, ["quant_tiled"]),
    ]
    for tiled, reduce, b, kernels_run in cases:
        x = torch.randn(num_rows, tiled.in_features, generator=generator).to(torch.bfloat16)
        launched.clear()
        out = quant_tiled.quant_tiled_cuda(x, tiled, b, reduce=reduce)
        expected = tiled_linear_ref(x.double(), tiled, b.double() if b is not None else None)
        case = f"{tiled.in_features} features, {reduce}"
        assert launched == kernels_run, case
        assert rel_error(out, expected) < TOLERANCE[torch.bfloat16], case
    assert not split_counters(1, torch.device("cpu")).any()


@needs_gxx
def test_candidate_block_shapes_run_on_the_host_match_reference(tmp_path) -> None:
    """The benchmark's other block shapes (eight warps by outputs or tile columns, wider warps)."""
    from kernels.quant_tiled import block_shape, candidate_shapes

    generator = torch.Generator().manual_seed(46)
    tiled = repack_tiles(*_quantized(150, 1024, "int4", 128, seed=1), "int4")
    for num_rows in (3, 12, 20, 40):
        x = torch.randn(num_rows, 1024, generator=generator).to(torch.bfloat16)
        expected = tiled_linear_ref(x.double(), tiled)
        for shape in candidate_shapes(num_rows)[1:]:
            assert shape != block_shape(num_rows)
            out = _run_tiled_on_host(x, tiled, None, 2, tmp_path, shape)
            assert rel_error(out, expected) < TOLERANCE[torch.bfloat16], f"{shape} {num_rows} rows"


# ---- GPU ----

SHAPES = [  # (out_features, in_features): odd ones, few outputs over a deep K, then Llama-1B and Qwen-7B projections
    (16, 64),
    (17, 200),
    (80, 384),
    (130, 1000),
    (48, 4096),
    (256, 14336),
    (1000, 768),
    (3072, 2048),
    (2048, 8192),
    (4608, 3584),
    (3584, 18944),
    (37888, 3584),
]
ROW_COUNTS = (1, 2, 5, 8, 9, 16, 17, 31, 32, 33, 64, 65, 100, 128, 200, 256)
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _cuda_tiled(
    n: int, k: int, scheme: str, group_size: int | None, seed: int
) -> tuple[TiledWeight, torch.Tensor]:
    """(the tiled weight on the GPU, its dequantized float64 matrix)."""
    qweight, scale = quantize_weight_ref(random_weight(n, k, seed).cuda(), scheme, group_size)
    return repack_tiles(qweight, scale, scheme), dequantize_weight_ref(qweight, scale, scheme, torch.float64)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_quant_tiled_matches_reference(scheme: str, dtype: torch.dtype) -> None:
    """quant_tiled against the float64 product with the dequantized weight over every shape, group
    size and row count class (block shapes, K splits, several row blocks); every failing case listed."""
    from kernels.quant_tiled import quant_tiled_cuda, tiled_config

    generator = torch.Generator().manual_seed(40)
    worst, failures = 0.0, []
    for n, k in SHAPES:
        for group_size in [g for g in TILED_GROUPS[scheme] if g is None or k % g == 0]:
            tiled, weight = _cuda_tiled(n, k, scheme, group_size, n + 3 * k)
            bias = torch.randn(n, generator=generator).to("cuda", dtype)
            for num_rows in ROW_COUNTS if n * k < 1e7 else (1, 3, 16, 17, 64, 256):
                x = torch.randn(num_rows, k, generator=generator).to("cuda", dtype)
                product = x.double() @ weight.t()
                for b in (None, bias):
                    poison_allocator((num_rows, n), dtype, x.device)
                    out = quant_tiled_cuda(x, tiled, b)
                    torch.cuda.synchronize()
                    expected = product + (b.double() if b is not None else 0)
                    error = rel_error(out, expected) if not torch.isnan(out).any() else float("nan")
                    if not error < TOLERANCE[dtype]:
                        config = tiled_config(num_rows, tiled, _cuda.num_sms(0))
                        failures.append(f"g{group_size} {num_rows}x{k}x{n} {config}: {error:.2e}")
                    elif error > worst:
                        worst = error
    print(
        f"\nquant_tiled {scheme} {dtype}: max relative error vs the dequantized float64 product {worst:.2e}"
    )
    assert not failures, f"{len(failures)} failing cases: " + "; ".join(failures[:12])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_both_ways_of_adding_k_splits_match_reference_and_each_other(
    scheme: str, dtype: torch.dtype
) -> None:
    """Few output tiles over a deep K (the products split widest) at 1-64 rows, with and without
    bias: the splits added by each tile's last block and by quant_tiled_reduce both give the
    reference's product, and the same bits (the same sum in the same order)."""
    from kernels.quant_tiled import quant_tiled_cuda, tiled_config

    generator = torch.Generator().manual_seed(48)
    failures = []
    for n, k in ((48, 4096), (256, 14336), (3584, 18944)):
        group_size = 128 if scheme == "int4" else None
        tiled, weight = _cuda_tiled(n, k, scheme, group_size, n + k)
        bias = torch.randn(n, generator=generator).to("cuda", dtype)
        for num_rows in (1, 16, 17, 32, 33, 64):
            config = tiled_config(num_rows, tiled, _cuda.num_sms(0))
            x = torch.randn(num_rows, k, generator=generator).to("cuda", dtype)
            for b in (None, bias):
                expected = x.double() @ weight.t() + (b.double() if b is not None else 0)
                poison_allocator((num_rows, n), dtype, x.device)
                last_block = quant_tiled_cuda(x, tiled, b, reduce="last_block")
                poison_allocator((num_rows, n), dtype, x.device)
                reduced = quant_tiled_cuda(x, tiled, b, reduce="reduce_kernel")
                torch.cuda.synchronize()
                case = f"{num_rows}x{k}x{n} {config.grid} bias={b is not None}"
                for label, out in (("last block", last_block), ("reduce kernel", reduced)):
                    error = rel_error(out, expected) if not torch.isnan(out).any() else float("nan")
                    if not error < TOLERANCE[dtype]:
                        failures.append(f"{label} {case}: {error:.2e}")
                if not torch.equal(last_block, reduced):
                    failures.append(f"{case}: the two ways differ")
    assert not failures, f"{len(failures)} failing cases: " + "; ".join(failures[:12])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_cuda_every_candidate_block_shape_matches_reference(scheme: str) -> None:
    """The shapes benchmarks.gpu_kernels times beside the default give the reference's product."""
    from kernels.quant_tiled import candidate_shapes, quant_tiled_cuda

    generator = torch.Generator().manual_seed(45)
    failures = []
    for n, k in ((130, 1000), (3072, 2048)):
        tiled, weight = _cuda_tiled(n, k, scheme, None if scheme == "int8" or k % 128 else 128, n)
        for num_rows in (1, 16, 32, 100, 256):
            x = torch.randn(num_rows, k, generator=generator).to("cuda", torch.bfloat16)
            for shape in candidate_shapes(num_rows):
                error = rel_error(quant_tiled_cuda(x, tiled, shape=shape), x.double() @ weight.t())
                if not error < TOLERANCE[torch.bfloat16]:
                    failures.append(f"{shape} {num_rows}x{k}x{n}: {error:.2e}")
    assert not failures, "; ".join(failures)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_cuda_quant_tiled_takes_strided_rows_and_replays_from_a_graph(scheme: str) -> None:
    """Batch 1 and 16 on a narrow, deep matrix (K split, partial sums added each way) and 40 / 256
    rows: strided x equals contiguous x, graph replays equal eager calls on the new input (after a
    larger need has replaced the workspace the graph captured), and the split counters are left
    zero."""
    from kernels.quant_tiled import quant_tiled_cuda, split_counters, split_partials, tiled_config

    generator = torch.Generator().manual_seed(41)
    n, k = 2048, 8192
    tiled, _ = _cuda_tiled(n, k, scheme, 128 if scheme == "int4" else None, 7)
    assert tiled_config(1, tiled, _cuda.num_sms(0)).splits > 1
    cases: list[tuple[int, SplitReduce | None]] = [
        (1, "last_block"),
        (1, "reduce_kernel"),
        (16, "reduce_kernel"),
        (40, None),
        (256, None),
    ]
    for num_rows, reduce in cases:
        wide = torch.randn(num_rows, k + 512, generator=generator).to("cuda", torch.bfloat16)
        x = wide[:, 256 : 256 + k]
        eager = quant_tiled_cuda(x, tiled, reduce=reduce)
        assert torch.equal(eager, quant_tiled_cuda(x.contiguous(), tiled, reduce=reduce))
        static = x.contiguous()
        quant_tiled_cuda(static, tiled, reduce=reduce)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = quant_tiled_cuda(static, tiled, reduce=reduce)
        if reduce == "last_block":  # a later product needing more replaces the buffers the graph captured
            floats = split_partials(1, 1, 1, x.device).untyped_storage().nbytes() // 4
            split_partials(1, 1, floats + 1, x.device)
            split_counters(split_counters(1, x.device).numel() + 1, x.device)
        fresh = torch.randn(num_rows, k, generator=generator).to("cuda", torch.bfloat16)
        static.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, quant_tiled_cuda(fresh, tiled, reduce=reduce)), (
            f"{num_rows} rows {reduce}"
        )
        assert not split_counters(1, x.device).any(), "every split launch leaves its counters zero"


@pytest.mark.gpu
@needs_cuda
def test_cuda_quant_linear_runs_tiled_unless_switched_to_mma(monkeypatch) -> None:
    """`kernels.quant_linear` with the tile layout of a wide enough matrix: TILED_MIN_ROWS-TILED_MAX_ROWS
    rows on the tiled kernel (bit-identical to calling it), and with SPECMESH_QUANT_KERNEL=mma on
    the older quant_mma; one row on the one-row kernel, fewer rows on quant_mma, more rows on
    dequantize + cuBLAS; all near the reference, 1..300 rows."""
    from kernels.quant_gemm import (
        MMA_MAX_ROWS,
        TILED_MAX_ROWS,
        TILED_MIN_ROWS,
        TILED_MIN_WIDTH,
        quant_gemv_cuda,
        quant_mma_cuda,
    )
    from kernels.quant_tiled import KERNEL_ENV, quant_tiled_cuda

    generator = torch.Generator().manual_seed(42)
    in_features = 1024
    qweight, scale = (
        t.cuda() for t in _quantized(max(1, TILED_MIN_WIDTH) * in_features, in_features, "int4", 128, 5)
    )
    tiled = repack_tiles(qweight, scale, "int4")
    for num_rows in (1, 4, TILED_MIN_ROWS, MMA_MAX_ROWS, TILED_MAX_ROWS, TILED_MAX_ROWS + 1, 300):
        x = torch.randn(num_rows, in_features, generator=generator).to("cuda", torch.bfloat16)
        out = kernels.quant_linear(x, qweight, scale, "int4", tiled=tiled)
        expected = tiled_linear_ref(x.double(), tiled)
        assert rel_error(out, expected) < 1e-2, f"{num_rows} rows"
        if num_rows == 1:
            assert torch.equal(out, quant_gemv_cuda(x, qweight, scale, "int4"))
        elif num_rows < TILED_MIN_ROWS:
            assert torch.equal(out, quant_mma_cuda(x, qweight, scale, "int4"))
        elif num_rows <= TILED_MAX_ROWS:
            assert torch.equal(out, quant_tiled_cuda(x, tiled))
            monkeypatch.setenv(KERNEL_ENV, "mma")
            switched = kernels.quant_linear(x, qweight, scale, "int4", tiled=tiled)
            monkeypatch.delenv(KERNEL_ENV)
            if num_rows <= MMA_MAX_ROWS:
                assert torch.equal(switched, quant_mma_cuda(x, qweight, scale, "int4"))
            assert rel_error(switched, expected) < 1e-2, f"{num_rows} rows, switched"


@pytest.mark.gpu
@needs_cuda
def test_cuda_quantized_layer_repacks_at_load_and_matches_reference() -> None:
    from shared.model.quant_config import QuantScheme
    from shared.model.quantization import QuantizedLinear, repack_layers

    generator = torch.Generator().manual_seed(43)
    for scheme, group_size in (("int4", 128), ("int8", None)):
        with torch.device("cuda"):
            layer = QuantizedLinear(
                1024, 384, True, QuantScheme(method=scheme, group_size=group_size), torch.bfloat16
            )
        qweight, scale = _quantized(384, 1024, scheme, group_size)
        layer.weight_packed.data.copy_(qweight)
        layer.weight_scale.data.copy_(scale)
        layer.bias.data.copy_(torch.randn(384, generator=generator))
        repack_layers(layer)
        assert layer.tiled is not None
        x = torch.randn(5, 1024, generator=generator).to("cuda", torch.bfloat16)
        expected = tiled_linear_ref(x.double(), layer.tiled, layer.bias.double())
        with torch.no_grad():  # the bias is a parameter: the reference product tracks its gradient
            assert rel_error(layer(x), expected.detach()) < 1e-2, scheme
