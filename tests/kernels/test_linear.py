"""The skinny matrix kernel of decode steps (`kernels.linear`).

On CPU: `kernels.linear` is `F.linear` (what the model called before), the kernel's eligibility
rules, and clear errors for inputs it cannot take. On a GPU: the kernel against float64 over many
shapes, row counts, dtypes, with and without bias and float32 output (outputs poisoned with NaN),
strided rows of x, replay from a CUDA graph, and the dispatch (cuBLAS past MAX_ROWS, in fp32, with
autograd). The split-K path the same way (its plan and eligibility on CPU; against float64 for
every slice count, repeated graph replays that reuse its arrival counters on a GPU).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import _cuda
from kernels.skinny_gemm import (
    MAX_ROWS,
    SPLITK_MAX_ROWS,
    SPLITK_MIN_SLICE,
    fits,
    skinny_linear_cuda,
    skinny_linear_splitk_cuda,
    splitk_plan,
    splitk_preferred,
)
from tests.kernels.helpers import (
    assemble_sm90,
    host_conversions,
    needs_cuda,
    needs_gxx,
    needs_nvcc,
    rel_error,
    run_threads_on_host,
)

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_linear_on_cpu_is_f_linear(out_dtype: torch.dtype | None) -> None:
    x, weight, bias = torch.randn(5, 64), torch.randn(96, 64), torch.randn(96)
    out = kernels.linear(x, weight, bias, out_dtype)
    expected = F.linear(x, weight, bias)
    assert torch.equal(out, expected if out_dtype is None else expected.to(out_dtype))
    assert torch.equal(
        kernels.linear(x.bfloat16(), weight.bfloat16()), F.linear(x.bfloat16(), weight.bfloat16())
    )


def test_kernel_is_preferred_for_one_row_of_a_large_matrix_only() -> None:
    from kernels.skinny_gemm import PREFERRED_MIN_WEIGHT_BYTES, preferred

    large = torch.empty(PREFERRED_MIN_WEIGHT_BYTES // (2 * 64), 64, dtype=torch.bfloat16)
    one = torch.randn(1, 64, dtype=torch.bfloat16)
    assert preferred(one, large)
    assert not preferred(torch.randn(2, 64, dtype=torch.bfloat16), large)
    assert not preferred(one, large[:-1])
    tall = torch.empty(64, PREFERRED_MIN_WEIGHT_BYTES // (2 * 64), dtype=torch.bfloat16)
    assert not preferred(torch.randn(1, tall.shape[1], dtype=torch.bfloat16), tall)  # down projections


DECODE_SHAPES = {  # (out_features, in_features) of Llama-3.2-1B and Qwen2.5-7B
    "1b_qkv": (3072, 2048),
    "1b_o": (2048, 2048),
    "1b_down": (2048, 8192),
    "7b_qkv": (4608, 3584),
    "7b_o": (3584, 3584),
    "7b_down": (3584, 18944),
}


def test_splitk_is_preferred_for_few_rows_of_the_small_and_tall_projections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, (n, k) in DECODE_SHAPES.items():
        weight = torch.empty(n, k, dtype=torch.bfloat16)
        for rows in range(1, SPLITK_MAX_ROWS + 1):
            assert splitk_preferred(torch.empty(rows, k, dtype=torch.bfloat16), weight), (name, rows)
        assert not splitk_preferred(torch.empty(SPLITK_MAX_ROWS + 1, k, dtype=torch.bfloat16), weight)
    one = torch.empty(1, 2048, dtype=torch.bfloat16)
    assert not splitk_preferred(one, torch.empty(16384, 2048, dtype=torch.bfloat16))  # 1B gate_up: cuBLAS
    assert not splitk_preferred(one, torch.empty(128256, 2048, dtype=torch.bfloat16))  # LM head
    assert not splitk_preferred(one.float(), torch.empty(2048, 2048))  # float32 stays on cuBLAS
    monkeypatch.setenv("SPECMESH_SPLITK_GEMV", "off")
    assert not splitk_preferred(one, torch.empty(2048, 2048, dtype=torch.bfloat16))


@pytest.mark.parametrize("num_sms", [1, 78, 132])
@pytest.mark.parametrize("warps_per_sm", [8, 48, 64])
def test_splitk_plan_covers_k_with_nonempty_aligned_slices(num_sms: int, warps_per_sm: int) -> None:
    for n, k in [*DECODE_SHAPES.values(), (8, 64), (97, 264), (1000, 776), (64, 65536)]:
        slices, k_per_split = splitk_plan(n, k, num_sms, warps_per_sm)
        assert slices >= 1 and k_per_split % 256 == 0
        assert (slices - 1) * k_per_split < k <= slices * k_per_split  # the last slice is not empty
        assert slices == 1 or k_per_split >= SPLITK_MIN_SLICE
        splitk_sum = sum(  # the kernel's arithmetic: float32 slices summed in slice order
            (torch.arange(k, dtype=torch.float32)[s * k_per_split : (s + 1) * k_per_split]).sum()
            for s in range(slices)
        )
        assert float(splitk_sum) == pytest.approx(k * (k - 1) / 2, rel=1e-6)
    slices, _ = splitk_plan(2048, 8192, 132, 48)
    assert slices > 1  # the 1B down projection at batch 1 fills the card by splitting K


def test_kernel_takes_only_decode_sized_aligned_half_products() -> None:
    weight = torch.randn(96, 64, dtype=torch.bfloat16)
    assert fits(torch.randn(1, 64, dtype=torch.bfloat16), weight)
    assert fits(torch.randn(MAX_ROWS, 64, dtype=torch.bfloat16), weight)
    assert not fits(torch.randn(MAX_ROWS + 1, 64, dtype=torch.bfloat16), weight)
    assert not fits(torch.randn(4, 64), weight.float())  # float32 stays on cuBLAS
    assert not fits(torch.randn(4, 64, dtype=torch.float16), weight)  # mixed dtypes
    assert not fits(torch.randn(2, 4, 64, dtype=torch.bfloat16), weight)  # not 2-D
    assert not fits(torch.randn(4, 60, dtype=torch.bfloat16), torch.randn(96, 60, dtype=torch.bfloat16))
    assert not fits(torch.randn(64, 4, dtype=torch.bfloat16).t(), weight)  # rows not contiguous
    assert not fits(torch.randn(4, 65, dtype=torch.bfloat16)[:, 1:], weight)  # misaligned rows
    assert not fits(torch.randn(4, 64, dtype=torch.bfloat16), weight.t().contiguous().t())


def test_kernel_wrapper_refuses_bad_inputs_with_a_clear_message() -> None:
    x, weight = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(96, 64, dtype=torch.bfloat16)
    with pytest.raises(_cuda.KernelError, match="skinny_linear takes"):
        skinny_linear_cuda(torch.randn(4, 64), weight)
    with pytest.raises(_cuda.KernelError, match="out_dtype"):
        skinny_linear_cuda(x, weight, out_dtype=torch.float16)
    with pytest.raises(_cuda.KernelError, match="bias has dtype"):
        skinny_linear_cuda(x, weight, torch.randn(96))
    with pytest.raises(_cuda.KernelError, match="bias has shape"):
        skinny_linear_cuda(x, weight, torch.randn(95, dtype=torch.bfloat16))
    with pytest.raises(_cuda.KernelError, match="rows_per_warp"):
        skinny_linear_cuda(x, weight, rows_per_warp=3)
    with pytest.raises(_cuda.KernelError, match="skinny_linear_splitk takes"):
        skinny_linear_splitk_cuda(torch.randn(SPLITK_MAX_ROWS + 1, 64, dtype=torch.bfloat16), weight)
    with pytest.raises(_cuda.KernelError, match="out_dtype"):
        skinny_linear_splitk_cuda(x, weight, out_dtype=torch.float16)


# ---- GPU ----

SHAPES = [  # (out_features, in_features): odd sizes, then the decode shapes of Llama-1B and Qwen-7B
    (8, 64),
    (97, 264),
    (1000, 776),
    (3072, 2048),
    (2048, 8192),
    (16384, 2048),
    (4608, 3584),
    (3584, 18944),
    (128256, 2048),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_skinny_linear_matches_float64(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(20)
    worst = 0.0
    for n, k in SHAPES:
        weight = (torch.randn(n, k, generator=generator) * k**-0.5).to("cuda", dtype)
        bias = torch.randn(n, generator=generator).to("cuda", dtype)
        for num_rows in range(1, MAX_ROWS + 1) if n * k < 1e7 else (1, 3, 6, 16):
            x = torch.randn(num_rows, k, generator=generator).to("cuda", dtype)
            for with_bias, out_dtype, rows_per_warp in (
                (False, None, 1),
                (True, torch.float32, 2),
                (True, None, None),
            ):
                b = bias if with_bias else None
                blocks = [
                    torch.full((num_rows, n), float("nan"), device="cuda", dtype=d)
                    for d in (dtype, torch.float32)
                ]
                del blocks
                out = skinny_linear_cuda(x, weight, b, out_dtype, rows_per_warp)
                torch.cuda.synchronize()
                assert out.dtype == (out_dtype or dtype) and out.shape == (num_rows, n)
                expected = x.double() @ weight.double().t() + (b.double() if b is not None else 0)
                error = rel_error(out, expected)
                assert error < TOLERANCE[dtype], f"{num_rows} x {k} x {n}, bias {with_bias}: {error:.2e}"
                worst = max(worst, error)
    print(f"\nskinny_linear {dtype}: max relative error vs float64 {worst:.2e}")


@pytest.mark.gpu
@needs_cuda
def test_cuda_skinny_linear_takes_strided_rows_and_replays_from_a_graph() -> None:
    generator = torch.Generator().manual_seed(21)
    weight = torch.randn(3072, 2048, generator=generator).to("cuda", torch.bfloat16)
    wide = torch.randn(6, 2048 + 512, generator=generator).to("cuda", torch.bfloat16)
    x = wide[:, 256 : 256 + 2048]  # rows 2560 elements apart, 16-byte aligned
    assert fits(x, weight)
    eager = skinny_linear_cuda(x, weight)
    assert torch.equal(eager, skinny_linear_cuda(x.contiguous(), weight))
    static = torch.zeros(6, 2048, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    static.copy_(x)
    skinny_linear_cuda(static, weight)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        replayed = skinny_linear_cuda(static, weight)
    fresh = torch.randn(6, 2048, generator=generator).to("cuda", torch.bfloat16)
    static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, skinny_linear_cuda(fresh, weight))


@pytest.mark.gpu
@needs_cuda
def test_cuda_dispatch_uses_the_kernel_only_where_preferred(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels import skinny_gemm

    weight = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    one = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
    two = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setenv("SPECMESH_SPLITK_GEMV", "off")
    with torch.inference_mode():
        assert torch.equal(kernels.linear(one, weight), F.linear(one, weight))  # small matrix: cuBLAS
        monkeypatch.setattr(skinny_gemm, "PREFERRED_MIN_WEIGHT_BYTES", 0)
        assert torch.equal(kernels.linear(one, weight), skinny_linear_cuda(one, weight))
        assert torch.equal(kernels.linear(two, weight), F.linear(two, weight))
        logits = kernels.linear(one, weight, out_dtype=torch.float32)
        assert logits.dtype == torch.float32
        assert torch.equal(logits, skinny_linear_cuda(one, weight, out_dtype=torch.float32))
        buffer = torch.full((4, 512), float("nan"), device="cuda")
        assert kernels.linear(one, weight, out=buffer[:1]).data_ptr() == buffer.data_ptr()
        assert torch.equal(buffer[:1], logits) and buffer[1:].isnan().all()
    trainable = weight.clone().requires_grad_()
    out = kernels.linear(one, trainable)
    out.float().sum().backward()  # cuBLAS ran: the product is differentiable
    assert trainable.grad is not None


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_splitk_linear_matches_float64(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(22)
    worst = 0.0
    for n, k in [(8, 64), (97, 264), (1000, 776), (130, 4104), *DECODE_SHAPES.values()]:
        weight = (torch.randn(n, k, generator=generator) * k**-0.5).to("cuda", dtype)
        bias = torch.randn(n, generator=generator).to("cuda", dtype)
        weight64, bias64 = weight.double(), bias.double()
        for num_rows in range(1, SPLITK_MAX_ROWS + 1):
            x = torch.randn(num_rows, k, generator=generator).to("cuda", dtype)
            for slices in (None, 1, 2, 3, 64):
                for b, out_dtype in ((None, None), (bias, torch.float32), (bias, None)):
                    poison = torch.full((num_rows, n), float("nan"), device="cuda", dtype=out_dtype or dtype)
                    out = skinny_linear_splitk_cuda(x, weight, b, out_dtype, out=poison, slices=slices)
                    torch.cuda.synchronize()
                    expected = x.double() @ weight64.t() + (bias64 if b is not None else 0)
                    error = rel_error(out, expected)
                    assert error < TOLERANCE[dtype], f"{num_rows} x {k} x {n}, {slices} slices: {error:.2e}"
                    worst = max(worst, error)
            assert torch.equal(  # deterministic: the slices are summed in slice order
                skinny_linear_splitk_cuda(x, weight, bias, slices=3),
                skinny_linear_splitk_cuda(x, weight, bias, slices=3),
            )
    print(f"\nskinny_linear_splitk {dtype}: max relative error vs float64 {worst:.2e}")


@pytest.mark.gpu
@needs_cuda
def test_cuda_splitk_linear_replays_from_a_graph_many_times() -> None:
    """The arrival counters are reset by each tile's last block, so replay after replay (and eager
    calls in between, on the same stream's workspace) stays correct."""
    generator = torch.Generator().manual_seed(23)
    weight = torch.randn(2048, 8192, generator=generator).to("cuda", torch.bfloat16)
    bias = torch.randn(2048, generator=generator).to("cuda", torch.bfloat16)
    wide = torch.randn(3, 8192 + 512, generator=generator).to("cuda", torch.bfloat16)
    x = wide[:, 256 : 256 + 8192]  # strided rows
    assert torch.equal(
        skinny_linear_splitk_cuda(x, weight, bias), skinny_linear_splitk_cuda(x.contiguous(), weight, bias)
    )
    static = torch.zeros(3, 8192, device="cuda", dtype=torch.bfloat16)
    skinny_linear_splitk_cuda(static, weight, bias)  # warm-up: the workspace exists before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = skinny_linear_splitk_cuda(static, weight, bias)
    assert splitk_plan(2048, 8192, _cuda.num_sms(0))[0] > 1  # the captured product is split
    for step in range(5):
        fresh = torch.randn(3, 8192, generator=generator).to("cuda", torch.bfloat16)
        static.copy_(fresh)
        graph.replay()
        eager = skinny_linear_splitk_cuda(fresh, weight, bias)
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager), step
        expected = fresh.double() @ weight.double().t() + bias.double()
        assert rel_error(replayed, expected) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@needs_cuda
def test_cuda_dispatch_takes_splitk_for_few_rows_of_small_and_tall_matrices() -> None:
    weight = torch.randn(2048, 8192, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        for rows in range(1, SPLITK_MAX_ROWS + 1):
            x = torch.randn(rows, 8192, device="cuda", dtype=torch.bfloat16)
            assert torch.equal(kernels.linear(x, weight), skinny_linear_splitk_cuda(x, weight))
        five = torch.randn(SPLITK_MAX_ROWS + 1, 8192, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(kernels.linear(five, weight), F.linear(five, weight))


@needs_nvcc
@pytest.mark.parametrize("mrows", [1, 2, 4])
def test_splitk_kernel_assembles_for_sm90_without_spills(mrows: int, tmp_path) -> None:
    from kernels.skinny_gemm import SOURCE, UNROLL, WARPS_PER_BLOCK

    for dtype, bias, out_f32 in ((1, 0, 0), (2, 1, 1)):
        defines = dict(DTYPE=dtype, MROWS=mrows, ROWS=1, WARPS=WARPS_PER_BLOCK, UNROLL=UNROLL)
        defines.update(HAS_BIAS=bias, OUT_F32=out_f32)
        assert "skinny_linear_splitk" in assemble_sm90(SOURCE, defines, tmp_path)


@needs_gxx
@pytest.mark.parametrize("num_rows", [1, 3, 4])
def test_splitk_kernel_on_the_host_matches_f_linear(num_rows: int, tmp_path) -> None:
    """The split-K kernel's CUDA source run on the host, one thread per CUDA thread (bf16, strided x,
    bias, float32 and bf16 outputs): every slice count gives F.linear's result up to summation
    order, the arrival counters are left zero, and a second launch on the same counters agrees."""
    from kernels.skinny_gemm import SOURCE, UNROLL, WARPS_PER_BLOCK, _slices

    source = SOURCE.replace(_cuda.CONVERSIONS, host_conversions(_cuda.CONVERSIONS))
    generator = torch.Generator().manual_seed(24)
    n, k = 37, 1320
    weight = (torch.randn(n, k, generator=generator) * k**-0.5).bfloat16()
    bias = torch.randn(n, generator=generator).bfloat16()
    wide = torch.randn(num_rows, k + 64, generator=generator).bfloat16()
    x = wide[:, 32 : 32 + k]
    expected = x.double() @ weight.double().t() + bias.double()
    tiles = -(-n // WARPS_PER_BLOCK)
    counters = torch.zeros(tiles, dtype=torch.int32)
    mrows = next(v for v in (1, 2, 4) if v >= num_rows)
    for wanted in (1, 2, 3, 6):
        slices, k_per_split = _slices(k, wanted)
        partial = torch.full((slices * num_rows * n,), float("nan"))
        for out_f32 in (1, 0):
            out = torch.full((num_rows, n), float("nan"), dtype=torch.float32 if out_f32 else torch.bfloat16)
            defines = dict(DTYPE=1, MROWS=mrows, ROWS=1, WARPS=WARPS_PER_BLOCK, UNROLL=UNROLL)
            defines.update(HAS_BIAS=1, OUT_F32=out_f32)
            args = (x, weight, bias, out, partial, counters, np.int32(num_rows), np.int32(n), np.int32(k))
            args += (np.int64(x.stride(0)), np.int32(k_per_split))
            grid = (tiles, slices)
            run_threads_on_host(
                source, "skinny_linear_splitk", defines, grid, 32 * WARPS_PER_BLOCK, args, tmp_path
            )
            assert not counters.any(), "the last blocks leave the counters zero"
            assert rel_error(out, expected) < (2e-6 if out_f32 else 1e-2), (wanted, out_f32)
