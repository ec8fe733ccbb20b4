"""Helpers shared by the kernel tests: relative error against float64, output poisoning,
assembling a kernel's source for sm_90 where nvcc is installed, and running a kernel whose threads
never meet on the host through g++ (neither needs a GPU)."""

from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels import _cuda

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (no GPU needed)")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (no GPU needed)")


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


HOST_SHIM = r"""
#include <algorithm>
struct Dim3 { int x, y, z; };
static Dim3 blockIdx, blockDim, threadIdx;
#define __global__
#define __device__
#define __forceinline__ inline
using std::min; using std::max;
"""
"""What a CUDA source without shared memory, barriers, warp functions or atomics needs to compile
as C++: each thread then runs alone, one after another."""


def run_on_host(
    source: str,
    name: str,
    defines: Mapping[str, int],
    grid: Sequence[int],
    block: Sequence[int],
    args: Sequence[Any],
    tmp_path: Path,
) -> None:
    """Runs kernel `name` of `source` on the host over a 1-D `grid` of `block` threads, thread by
    thread, with the arguments a wrapper passes `_cuda.launch` (CPU tensors, numpy integers, None).
    Only for kernels whose threads never meet (no shared memory, barriers, warp functions, atomics)
    and take pointers and integers."""
    types = _parameter_types(source, name)
    assert len(types) == len(args), f"{name} takes {len(types)} arguments, {len(args)} given"
    casts = ", ".join(f"({t})a[{i}]" for i, t in enumerate(types))
    entry = f"""
extern "C" void run_grid(int grid, int block, const unsigned long long* a) {{
    blockDim = {{block, 1, 1}};
    for (int b = 0; b < grid; ++b) for (int t = 0; t < block; ++t) {{
        blockIdx = {{b, 0, 0}}; threadIdx = {{t, 0, 0}};
        {name}({casts});
    }}
}}"""
    macros = "".join(f"#define {key} ({value})\n" for key, value in defines.items())
    code = HOST_SHIM + macros + source + entry
    source_path, library = tmp_path / f"{name}.cpp", tmp_path / f"{name}.so"
    if not (library.exists() and source_path.read_text() == code):  # built once per test
        source_path.write_text(code)
        result = subprocess.run(
            ["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-o", str(library), str(source_path)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
    words = [_word(arg) for arg in args]
    ctypes.CDLL(str(library)).run_grid(
        ctypes.c_int(grid[0]), ctypes.c_int(block[0]), (ctypes.c_ulonglong * len(words))(*words)
    )


def _parameter_types(source: str, name: str) -> list[str]:
    """The C types of kernel `name`'s parameters (comments and __restrict__ dropped)."""
    match = re.search(
        rf"__global__ void (?:__launch_bounds__\([^)]*\)\s*)?{name}\((.*?)\)\s*\{{",
        re.sub(r"/\*.*?\*/", "", source, flags=re.S),
        re.S,
    )
    assert match is not None, f"no kernel {name} in the source"
    parameters = [p.replace("__restrict__", "").split() for p in match.group(1).split(",")]
    types = [" ".join(words[:-1]) for words in parameters]
    assert all("*" in t or ("float" not in t and "double" not in t) for t in types), (
        "integer and pointer parameters only"
    )
    return types


def _word(arg: Any) -> int:
    """A kernel argument as the 64-bit word the host entry casts back."""
    if isinstance(arg, torch.Tensor):
        assert arg.device.type == "cpu", "host runs take CPU tensors"
        return arg.data_ptr()
    if arg is None:
        return 0
    return int(arg) & 0xFFFFFFFFFFFFFFFF


THREADED_SHIM = r"""
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <math.h>
#include <cstring>
#include <thread>
#include <vector>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>
struct Dim3 { unsigned x, y, z; };
struct uint4 { unsigned int x, y, z, w; };
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
static thread_local Dim3 threadIdx;
static Dim3 blockIdx, blockDim, gridDim;
static std::barrier<>* block_barrier;
static std::vector<std::barrier<>*> warp_barriers;
static unsigned long long shuffle_slots[1024];
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __syncthreads() block_barrier->arrive_and_wait()
#define __nanosleep(ns) sched_yield()
#define __threadfence() std::atomic_thread_fence(std::memory_order_seq_cst)
using std::min; using std::max;
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
template <class T> static inline T __ldg(const T* p) { return *p; }
template <class T> static inline T __ldcg(const T* p) { return *p; }
template <class T> static inline T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline float atomicAdd(float* p, float v) {
    float old = *p, want;
    do { want = old + v; } while (!__atomic_compare_exchange(p, &old, &want, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
    return old;
}
template <class T> static inline T __shfl_xor_sync(unsigned, T v, int offset) {
    std::barrier<>* warp = warp_barriers[threadIdx.x / 32];
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    shuffle_slots[threadIdx.x] = bits;
    warp->arrive_and_wait();
    bits = shuffle_slots[threadIdx.x ^ offset];
    warp->arrive_and_wait();
    std::memcpy(&v, &bits, sizeof(T));
    return v;
}
"""
"""What a CUDA source with block barriers, warp shuffles, static shared memory and atomics needs to
run as C++ with one std::thread per CUDA thread: a block's threads side by side meeting at
std::barrier (a thread that returns drops out of its block's and warp's barriers); how blocks run
is `run_threads_on_host`'s choice."""


BLOCK_RUN = """
        blockIdx = {(unsigned)bx, (unsigned)by, (unsigned)bz};
        std::barrier<> bar(block);
        block_barrier = &bar;
        std::vector<std::barrier<>*> warps;
        for (int w = 0; w < (block + 31) / 32; ++w) warps.push_back(new std::barrier<>(std::min(32, block - 32 * w)));
        warp_barriers = warps;
        std::vector<std::thread> threads;
        for (int t = 0; t < block; ++t) threads.emplace_back([&, t] {
            threadIdx = {(unsigned)t, 0, 0};
            KERNEL_CALL;
            warps[t / 32]->arrive_and_drop();
            bar.arrive_and_drop();
        });
        for (auto& th : threads) th.join();
        for (auto* w : warps) delete w;
"""
"""One block of the grid on the host: its threads side by side, then joined."""

SEQUENTIAL_GRID = """
extern "C" int run_grid(int grid_x, int grid_y, int grid_z, int block, const unsigned long long* a) {
    blockDim = {(unsigned)block, 1, 1};
    gridDim = {(unsigned)grid_x, (unsigned)grid_y, (unsigned)grid_z};
    for (int bz = 0; bz < grid_z; ++bz) for (int by = 0; by < grid_y; ++by) for (int bx = 0; bx < grid_x; ++bx) {
        BLOCK_RUN
    }
    return 0;
}"""
"""Blocks one after another, in launch order."""

CONCURRENT_GRID = """
extern "C" int run_grid(int grid_x, int grid_y, int grid_z, int block, const unsigned long long* a) {
    blockDim = {(unsigned)block, 1, 1};
    gridDim = {(unsigned)grid_x, (unsigned)grid_y, (unsigned)grid_z};
    std::vector<pid_t> children;
    for (int bz = 0; bz < grid_z; ++bz) for (int by = 0; by < grid_y; ++by) for (int bx = 0; bx < grid_x; ++bx) {
        const pid_t pid = fork();
        if (pid != 0) { children.push_back(pid); continue; }
        alarm(300);  /* a block that never gets past a barrier fails the run instead of hanging it */
        BLOCK_RUN
        _exit(0);
    }
    int failed = 0;
    for (pid_t pid : children) { int status = 0; waitpid(pid, &status, 0); failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0); }
    return failed;
}"""
"""Every block at once, one forked process each (its own shared memory and barriers): what a
kernel whose blocks wait for each other needs; global memory must then be in shared memory."""


def run_threads_on_host(
    source: str,
    name: str,
    defines: Mapping[str, int],
    grid: Sequence[int],
    block: int,
    args: Sequence[Any],
    tmp_path: Path,
    concurrent_blocks: bool = False,
) -> None:
    """Runs kernel `name` of `source` on the host over a 1-D, 2-D or 3-D `grid` of `block` threads
    (at most 1024), one std::thread per CUDA thread (THREADED_SHIM), with the arguments a wrapper
    passes `_cuda.launch`. `source` must hold no inline PTX (`asm`). Blocks run one after another (so the
    last block of a last-block-reduces scheme is the last in launch order), or with
    `concurrent_blocks` all at once in forked processes, the tensors of `args` then in shared memory
    (`share_memory_()`) for the blocks' writes to meet."""
    types = _parameter_types(source, name)
    assert len(types) == len(args), f"{name} takes {len(types)} arguments, {len(args)} given"
    call = f"{name}(" + ", ".join(f"({t})a[{i}]" for i, t in enumerate(types)) + ")"
    grid_code = CONCURRENT_GRID if concurrent_blocks else SEQUENTIAL_GRID
    entry = grid_code.replace("BLOCK_RUN", BLOCK_RUN).replace("KERNEL_CALL", call)
    macros = "".join(f"#define {key} ({value})\n" for key, value in defines.items())
    code = THREADED_SHIM + macros + source + entry
    digest = hashlib.sha1(code.encode()).hexdigest()[:12]  # dlopen keeps one library per path
    source_path, library = tmp_path / f"{name}_{digest}.cpp", tmp_path / f"{name}_{digest}.so"
    if not library.exists():
        source_path.write_text(code)
        command = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-o", str(library)]
        result = subprocess.run([*command, str(source_path)], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    words = [_word(arg) for arg in args]
    grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
    failed = ctypes.CDLL(str(library)).run_grid(
        ctypes.c_int(grid_x),
        ctypes.c_int(grid_y),
        ctypes.c_int(grid_z),
        ctypes.c_int(block),
        (ctypes.c_ulonglong * len(words))(*words),
    )
    assert failed == 0, f"{failed} blocks failed (a barrier never passed?)"
