"""Inline-PTX helpers the tensor-core kernels share, as CUDA source snippets.

A kernel's source is the concatenation of snippets (`_cuda.CONVERSIONS` first, which defines DTYPE's
DT_* names), so each helper is written once here and pasted ahead of the code that calls it. The
dtype-dependent ones read DTYPE (DT_BF16 or DT_F16) at compile time. `SHARED_ADDRESS` must come
before `CP_ASYNC` and `LDMATRIX`, which take shared-memory addresses. A host test may swap a kernel's
helpers for C++ twins (tests/kernels/test_quant_tiled.py `HOST_PTX`), which is why they stay apart
from the kernels' own code.
"""

from __future__ import annotations

SHARED_ADDRESS = r"""
/* a generic pointer into shared memory -> the 32-bit shared-window address PTX operands take */
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
"""
"""`smem_addr`: the shared-window address of a generic pointer (what cp.async and ldmatrix take)."""

CP_ASYNC = r"""
/* 16 bytes global -> shared, or 16 zero bytes where !valid (src is then not read) */
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0));
}
/* closes the group of copies issued since the last commit */
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
/* waits until at most N committed groups are still in flight (this thread's copies only) */
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}
"""
"""`cp_async16` (a 16-byte global -> shared copy that bypasses registers and L1, zero-filled where not
valid), `cp_async_commit` (closes a group of copies) and `cp_async_wait<N>` (until at most N groups
are in flight): the pieces of a multi-stage load pipeline (sm_80+)."""

LDMATRIX = r"""
/* four 8x8 b16 matrices from shared memory: lane l gives row l % 8 of matrix l / 8 */
__device__ __forceinline__ void ldmatrix_x4(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
/* the same, each matrix transposed */
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
"""
"""`ldmatrix_x4` / `ldmatrix_x4_trans`: a warp's four 8x8 16-bit matrices from shared memory into
mma fragments (one register a matrix a lane), as stored or transposed."""

MMA_M16N8K16 = r"""
#if DTYPE == DT_BF16
#define MMA_TYPE "bf16"
#else
#define MMA_TYPE "f16"
#endif
/* d += a @ b on the tensor cores, float32 accumulators (fragments as the PTX ISA places them) */
__device__ __forceinline__ void mma16816(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
"""
"""`mma16816`: one warp-wide mma.sync m16n8k16 in x's dtype (bf16 or fp16) with float32
accumulators: A 16 x 16 (four registers a lane), B 16 x 8 (two), D 16 x 8 (four floats)."""

PRMT = r"""
/* bytes of (hi:lo) picked by the selector's nibbles (PTX prmt; CUDA's __byte_perm) */
__device__ __forceinline__ unsigned prmt(unsigned lo, unsigned hi, unsigned selector) {
    unsigned d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(lo), "r"(hi), "r"(selector));
    return d;
}
"""
"""`prmt`: byte i of the result is byte (selector >> 4i) & 7 of the eight bytes hi:lo."""

HALF_PAIRS = r"""
#if DTYPE == DT_BF16
#define FMA_X2 "fma.rn.bf16x2"
#define CVT_X2 "cvt.rn.bf16x2.f32"
#else
#define FMA_X2 "fma.rn.f16x2"
#define CVT_X2 "cvt.rn.f16x2.f32"
#endif
/* a * b + c on both halves of x's dtype, one rounding each */
__device__ __forceinline__ unsigned fma_x2(unsigned a, unsigned b, unsigned c) {
    unsigned d;
    asm(FMA_X2 " %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
/* (lo, hi) floats -> one register of two x-dtype halves, lo in the low half */
__device__ __forceinline__ unsigned pack_x2(float lo, float hi) {
    unsigned d;
    asm(CVT_X2 " %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
"""
"""`fma_x2` (a * b + c on two bf16 / fp16 halves of a register) and `pack_x2` (two floats rounded
to nearest into one register of two halves, the first in the low half), in x's dtype."""
