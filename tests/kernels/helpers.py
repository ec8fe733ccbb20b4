"""Helpers shared by the kernel tests: relative error against float64, output poisoning, and
assembling a kernel's source for sm_90 where nvcc is installed (no GPU needed)."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from kernels import _cuda

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (no GPU needed)")


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere fails."""
    out64, ref64 = out.double(), ref.double()
    assert not torch.isnan(out64).any(), "output has NaN (an element was never written?)"
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-300))


def poison_allocator(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """Fills the block the caching allocator will hand out next for this shape with NaN (floats)
    or a sentinel (integers), so an output element the kernel never writes shows up."""
    fill = float("nan") if dtype.is_floating_point else -777
    block = torch.full(shape, fill, dtype=dtype, device=device)
    del block


def assemble_sm90(source: str, defines: Mapping[str, int], tmp_path: Path) -> dict[str, int]:
    """The registers each kernel of `source` uses (by name), assembled by nvcc for sm_90 with the
    -D macros of one launched variant (as `_cuda.function` compiles it); fails the test where nvcc
    fails or any kernel spills registers to local memory."""
    source_path, cubin_path = tmp_path / "kernel.cu", tmp_path / "kernel.cubin"
    source_path.write_text(source)
    command = ["nvcc", "-cubin", "-arch=sm_90", *_cuda.NVRTC_OPTIONS, "-Xptxas=-v", "-o", str(cubin_path)]
    command += [str(source_path)] + [f"-D{name}={value}" for name, value in defines.items()]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    registers: dict[str, int] = {}
    for kernel, report in _kernel_reports(result.stderr).items():
        spilled = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
        assert spilled and not any(spilled), f"{kernel} spills registers:\n{report}"
        used = re.search(r"Used (\d+) registers", report)
        assert used is not None, report
        registers[kernel] = int(used.group(1))
    return registers


def _kernel_reports(ptxas_log: str) -> dict[str, str]:
    """ptxas -v's report of each entry function (kernel), by name."""
    chunks = ptxas_log.split("Compiling entry function '")[1:]
    return {chunk.split("'", 1)[0]: chunk for chunk in chunks}
