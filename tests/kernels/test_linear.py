"""The skinny matrix kernel of decode steps (`kernels.linear`).

On CPU: `kernels.linear` is `F.linear` (what the model called before), the kernel's eligibility
rules (`preferred` on the decode matrices it was measured faster on), and clear errors for inputs
it cannot take. On a GPU: the kernel against float64 over many shapes, row counts, dtypes, with and
without bias and float32 output (outputs poisoned with NaN), strided rows of x, replay from a CUDA
graph, and the dispatch (cuBLAS past one row, for mid-size or tall matrices, in fp32, with
autograd).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import _cuda
from kernels.skinny_gemm import MAX_ROWS, fits, skinny_linear_cuda
from tests.kernels.helpers import needs_cuda, rel_error

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


def test_kernel_is_preferred_for_one_row_of_a_large_or_small_wide_matrix() -> None:
    from kernels.skinny_gemm import PREFERRED_MAX_SMALL_BYTES, PREFERRED_MIN_WEIGHT_BYTES, preferred

    large = torch.empty(PREFERRED_MIN_WEIGHT_BYTES // (2 * 64), 64, dtype=torch.bfloat16)
    one = torch.randn(1, 64, dtype=torch.bfloat16)
    assert preferred(one, large)
    assert not preferred(torch.randn(2, 64, dtype=torch.bfloat16), large)
    assert not preferred(one, large[:-1])  # mid-size: cuBLAS
    small = large[: PREFERRED_MAX_SMALL_BYTES // (2 * 64)]
    assert preferred(one, small)
    assert not preferred(one, large[: small.shape[0] + 1])
    assert not preferred(torch.randn(2, 64, dtype=torch.bfloat16), small)
    tall = torch.empty(64, PREFERRED_MIN_WEIGHT_BYTES // (2 * 64), dtype=torch.bfloat16)
    assert not preferred(torch.randn(1, tall.shape[1], dtype=torch.bfloat16), tall)  # down projections
    assert not preferred(torch.randn(1, 256), torch.empty(512, 256))  # float32 stays on cuBLAS


DECODE_SHAPES = {  # (out_features, in_features) of Llama-3.2-1B and Qwen2.5-7B
    "1b_qkv": (3072, 2048),
    "1b_o": (2048, 2048),
    "1b_gate_up": (16384, 2048),
    "1b_down": (2048, 8192),
    "1b_lm_head": (128256, 2048),
    "7b_qkv": (4608, 3584),
    "7b_o": (3584, 3584),
    "7b_gate_up": (37888, 3584),
    "7b_down": (3584, 18944),
    "7b_lm_head": (152064, 3584),
}
ONE_ROW_KERNEL = {"1b_qkv", "1b_o", "1b_lm_head", "7b_o", "7b_gate_up", "7b_lm_head"}
"""The matrices the one-row kernel beat cuBLAS on at batch 1 (kernels/NOTES.md); the rest stay on
cuBLAS (7B qkv: 33.0 MB, just past PREFERRED_MAX_SMALL_BYTES)."""


def test_kernel_is_preferred_for_the_decode_matrices_it_was_measured_faster_on() -> None:
    from kernels.skinny_gemm import preferred

    for name, (n, k) in DECODE_SHAPES.items():
        weight = torch.empty(n, k, dtype=torch.bfloat16)  # not touched: no pages committed
        assert preferred(torch.randn(1, k, dtype=torch.bfloat16), weight) == (name in ONE_ROW_KERNEL), name
        assert not preferred(torch.randn(2, k, dtype=torch.bfloat16), weight), name


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
    tall = weight.t().contiguous()
    one_tall = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(kernels.linear(one, weight), skinny_linear_cuda(one, weight))  # small matrix
        assert torch.equal(kernels.linear(two, weight), F.linear(two, weight))
        assert torch.equal(kernels.linear(one_tall, tall), F.linear(one_tall, tall))  # a down projection
        monkeypatch.setattr(skinny_gemm, "PREFERRED_MAX_SMALL_BYTES", 0)
        assert torch.equal(kernels.linear(one, weight), F.linear(one, weight))  # mid-size: cuBLAS
        monkeypatch.setattr(skinny_gemm, "PREFERRED_MIN_WEIGHT_BYTES", 0)
        assert torch.equal(kernels.linear(one, weight), skinny_linear_cuda(one, weight))  # large
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
