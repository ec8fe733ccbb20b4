"""The shared inline-PTX helpers (kernels/ptx.py): each kernel source that calls one defines it
exactly once, from the snippet, so no kernel carries its own copy."""

from __future__ import annotations

import re

import pytest

from kernels import ptx

HELPERS = {
    "smem_addr": ptx.SHARED_ADDRESS,
    "cp_async16": ptx.CP_ASYNC,
    "cp_async_commit": ptx.CP_ASYNC,
    "cp_async_wait": ptx.CP_ASYNC,
    "ldmatrix_x4": ptx.LDMATRIX,
    "mma16816": ptx.MMA_M16N8K16,
    "prmt": ptx.PRMT,
    "fma_x2": ptx.HALF_PAIRS,
    "pack_x2": ptx.HALF_PAIRS,
}


def _sources() -> dict[str, str]:
    from kernels.attention import SOURCE
    from kernels.quant_gemm import MMA_SOURCE
    from kernels.quant_tiled import TILED_SOURCE

    return {"attention": SOURCE, "quant_mma": MMA_SOURCE, "quant_tiled": TILED_SOURCE}


def _definitions(source: str, helper: str) -> int:
    return len(re.findall(rf"__device__ __forceinline__ \w+ {helper}\(", source))


@pytest.mark.parametrize("kernel", ["attention", "quant_mma", "quant_tiled"])
def test_each_helper_a_kernel_calls_is_defined_once_from_its_snippet(kernel: str) -> None:
    source = _sources()[kernel]
    called = [h for h in HELPERS if re.search(rf"\b{h}(<\d+>)?\(", source)]
    assert called, f"{kernel} calls none of the shared helpers"
    for helper in called:
        assert _definitions(source, helper) == 1, (
            f"{kernel} defines {helper} {_definitions(source, helper)} times"
        )
        assert HELPERS[helper] in source, f"{kernel} does not take {helper} from kernels/ptx.py"


def test_the_snippets_define_each_helper_once() -> None:
    snippets = ptx.SHARED_ADDRESS + ptx.CP_ASYNC + ptx.LDMATRIX + ptx.MMA_M16N8K16 + ptx.PRMT + ptx.HALF_PAIRS
    for helper in HELPERS:
        assert _definitions(snippets, helper) == 1, helper
