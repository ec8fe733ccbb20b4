"""CUDA kernels of quantized linear layers (weight formats: kernels/quant_ref.py).

A decode step's few rows are bound by reading the weights, so the one-row product reads the
quantized bytes and dequantizes them in registers (`quant_gemv`): a quarter (int4) or half (fp8,
int8) of a bf16 weight's bytes. Layout as kernels/skinny_gemm.py: one warp per ROWS output
features, lanes striding the input features 16 weight bytes at a time (16 fp8 / int8 values, 32 int4
values), UNROLL loads in flight, float32 accumulation, each 16-byte chunk's dot product multiplied
by its group's scale, a warp-shuffle reduction, one rounding to x's dtype.

Steps of more rows (prefill chunks, large verify batches) are compute-bound enough for tensor
cores: FP8 quantizes the activations per token (`fp8_quantize_rows`) and multiplies on the FP8
tensor cores (`torch._scaled_mm`, row-wise scales; sm_89 and later); int8 / int4 dequantize the
weight into a temporary bf16 / fp16 matrix (`dequantize_weight`) for cuBLAS. That costs one more
write and read of the dequantized matrix; a GEMM that dequantizes tiles into shared memory would
spare it.

fp8 values are decoded without the hardware conversion: e4m3's sign, 4 exponent and 3 mantissa
bits placed into an fp16's (exponent bits 10-13, mantissa 7-9) read as 2^-8 times the e4m3 value
for normals and subnormals alike, so the decode is two masks and a shift and the 256 goes into the
scale.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels import _cuda
from kernels.quant_ref import FP8_DTYPE, FP8_MAX, MIN_SCALE, SCHEMES

MAX_ROWS = 16
"""Most rows `quant_gemv` takes; variants are compiled for 1, 2, 4, 8 and 16."""
ROW_VARIANTS = (1, 2, 4, 8, 16)
WARPS_PER_BLOCK = 4
UNROLL = 2
WIDE_OUTPUTS = 16384
"""From this many outputs up a warp computes two of them, below one (as in skinny_gemm)."""
SCHEME_IDS = {"fp8": 0, "int8": 1, "int4": 2}
VALUES_PER_CHUNK = {"fp8": 16, "int8": 16, "int4": 32}
"""Weight values in the 16 bytes one lane loads at a time."""
SCALED_MM_MIN_CAPABILITY = (8, 9)
QUANTIZE_THREADS = 256

_DECODE = r"""
#define SCH_FP8 0
#define SCH_INT8 1
#define SCH_INT4 2
#if SCHEME == SCH_INT4
#define VALS 32
#else
#define VALS 16
#endif
__device__ __forceinline__ float half_bits_to_float(unsigned short h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
/* 16 stored bytes -> VALS float values (fp8: 2^-8 times the e4m3 value; the caller scales by 256) */
__device__ __forceinline__ void decode_chunk(const uint4& raw, float* out) {
    const unsigned char* b = reinterpret_cast<const unsigned char*>(&raw);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
#if SCHEME == SCH_FP8
        out[i] = half_bits_to_float((unsigned short)(((b[i] & 0x80) << 8) | ((b[i] & 0x7f) << 7)));
#elif SCHEME == SCH_INT8
        out[i] = (float)((int)b[i] - 128);
#else
        out[2 * i] = (float)((int)(b[i] & 15) - 8);
        out[2 * i + 1] = (float)((int)(b[i] >> 4) - 8);
#endif
    }
}
#if SCHEME == SCH_FP8
#define DECODE_SCALE 256.f
#else
#define DECODE_SCALE 1.f
#endif
"""

GEMV_SOURCE = (
    _cuda.CONVERSIONS
    + _DECODE
    + r"""
/* y[m, n] = sum_k x[m, k] * q[n, k] * scale[n, k / group_size] (+ bias[n]) for m < num_rows <= MROWS */
extern "C" __global__ void __launch_bounds__(32 * WARPS) quant_gemv(
    const scalar_t* __restrict__ x,        /* [num_rows, K], rows x_stride elements apart */
    const unsigned char* __restrict__ w,   /* [N, row_bytes] stored weight */
    const float* __restrict__ scale,       /* [N, K / group_size] */
    const scalar_t* __restrict__ bias,     /* [N]; unused without HAS_BIAS */
    scalar_t* __restrict__ y,              /* [num_rows, N] contiguous */
    int num_rows, int N, int K, int group_size, long long x_stride)
{
    const int lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * ROWS;
    if (n0 >= N) return;
    const int num_chunks = K / VALS;
    const long long row_bytes = (long long)num_chunks * 16;
    const int num_groups = K / group_size;
    const uint4* wr[ROWS];
    const float* sr[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int n = min(n0 + r, N - 1);
        wr[r] = reinterpret_cast<const uint4*>(w + n * row_bytes);
        sr[r] = scale + (long long)n * num_groups;
    }
    float acc[ROWS][MROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int m = 0; m < MROWS; ++m) acc[r][m] = 0.f;

    for (int c0 = lane; c0 < num_chunks; c0 += 32 * UNROLL) {
        uint4 raw[UNROLL][ROWS];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + u * 32;
#pragma unroll
            for (int r = 0; r < ROWS; ++r) raw[u][r] = c < num_chunks ? __ldg(wr[r] + c) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + u * 32;
            if (c >= num_chunks) break;
            const int k = c * VALS;
            float wv[ROWS][VALS];
            float s[ROWS];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                decode_chunk(raw[u][r], wv[r]);
                s[r] = __ldg(sr[r] + k / group_size) * DECODE_SCALE;
            }
#pragma unroll
            for (int m = 0; m < MROWS; ++m) {
                if (m < num_rows) {
                    float dot[ROWS];
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) dot[r] = 0.f;
#pragma unroll
                    for (int v = 0; v < VALS; v += VEC) {
                        float xv[VEC];
                        load_vec(x + m * x_stride + k + v, xv);
#pragma unroll
                        for (int r = 0; r < ROWS; ++r)
#pragma unroll
                            for (int i = 0; i < VEC; ++i) dot[r] = fmaf(xv[i], wv[r][v + i], dot[r]);
                    }
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) acc[r][m] = fmaf(dot[r], s[r], acc[r][m]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int n = n0 + r;
#pragma unroll
        for (int m = 0; m < MROWS; ++m) {
            float v = acc[r][m];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0 && m < num_rows && n < N) {
#if HAS_BIAS
                v += to_float(bias[n]);
#endif
                y[(long long)m * N + n] = from_float(v);
            }
        }
    }
}

/* out[n, k] = q[n, k] * scale[n, k / group_size], one 16-byte chunk per thread */
extern "C" __global__ void dequantize_weight(
    const unsigned char* __restrict__ w, const float* __restrict__ scale, scalar_t* __restrict__ out,
    int N, int K, int group_size)
{
    const long long chunk = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int num_chunks = K / VALS;
    if (chunk >= (long long)N * num_chunks) return;
    const long long n = chunk / num_chunks;
    const int k = (int)(chunk % num_chunks) * VALS;
    float v[VALS];
    decode_chunk(__ldg(reinterpret_cast<const uint4*>(w) + chunk), v);
    const float s = scale[n * (K / group_size) + k / group_size] * DECODE_SCALE;
    scalar_t* dst = out + n * K + k;
#pragma unroll
    for (int i = 0; i < VALS; ++i) dst[i] = from_float(v[i] * s);
}
"""
)

QUANTIZE_SOURCE = (
    _cuda.CONVERSIONS
    + f"#define FP8_MAX {FP8_MAX!r}f\n#define MIN_SCALE {MIN_SCALE!r}f\n"
    + r"""
/* Per row: scale = max(amax / FP8_MAX, MIN_SCALE), q = e4m3(x / scale) (round to nearest, saturated). */
extern "C" __global__ void __launch_bounds__(THREADS) fp8_quantize_rows(
    const scalar_t* __restrict__ x,       /* [num_rows, K], rows x_stride elements apart */
    unsigned short* __restrict__ q,       /* [num_rows, K] e4m3, two a 16-bit word */
    float* __restrict__ scale,            /* [num_rows] */
    int K, long long x_stride)
{
    __shared__ float warp_max[THREADS / 32];
    const scalar_t* row = x + blockIdx.x * x_stride;
    float amax = 0.f;
    for (int k = threadIdx.x; k < K; k += THREADS) amax = fmaxf(amax, fabsf(to_float(row[k])));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
    __syncthreads();
    amax = 0.f;
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) amax = fmaxf(amax, warp_max[w]);
    const float s = fmaxf(amax / FP8_MAX, MIN_SCALE);
    if (threadIdx.x == 0) scale[blockIdx.x] = s;
    unsigned short* out = q + (long long)blockIdx.x * (K / 2);
    for (int k = 2 * threadIdx.x; k < K; k += 2 * THREADS) {
        const float lo = to_float(row[k]) / s, hi = to_float(row[k + 1]) / s;
        unsigned short pair;
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
        out[k / 2] = pair;
    }
}
"""
)


def stored_in_features(qweight: torch.Tensor, scheme: str) -> int:
    """Input features of a stored weight: its bytes a row, times two for int4."""
    return qweight.shape[1] * qweight.element_size() * (2 if scheme == "int4" else 1)


def gemv_fits(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, scheme: str) -> bool:
    """True when `quant_gemv` takes this product: 1..MAX_ROWS bf16 / fp16 rows, 16-byte aligned, a
    weight of the scheme's storage and x's input features, those and the group size whole 16-byte
    chunks of the stored weight."""
    if scheme not in SCHEMES or x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if qweight.dim() != 2 or qweight.dtype != (FP8_DTYPE if scheme == "fp8" else torch.int32):
        return False
    num_rows, k = x.shape
    vals = VALUES_PER_CHUNK[scheme]
    num_groups = scale.shape[1] if scale.dim() == 2 else 0
    return (
        0 < num_rows <= MAX_ROWS
        and k % vals == 0
        and stored_in_features(qweight, scheme) == k
        and num_groups > 0
        and k % num_groups == 0
        and (k // num_groups) % vals == 0
        and x.stride(1) == 1
        and x.stride(0) % 8 == 0
        and x.data_ptr() % 16 == 0
        and qweight.is_contiguous()
        and qweight.data_ptr() % 16 == 0
        and qweight.shape[0] == scale.shape[0]
        and scale.dtype == torch.float32
        and scale.is_contiguous()
    )


def scaled_mm_fits(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """True when the FP8 tensor-core path takes x @ qweight.T: an sm_89+ card, bf16 activations
    (`_scaled_mm`'s row-wise scaling writes bf16 only), 16-multiple sizes."""
    return (
        qweight.dtype == FP8_DTYPE
        and x.dim() == 2
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= SCALED_MM_MIN_CAPABILITY
        and x.shape[-1] % 16 == 0
        and qweight.shape[0] % 16 == 0
    )


def _weight_bytes(qweight: torch.Tensor) -> torch.Tensor:
    return qweight.view(torch.uint8)


def quant_gemv_cuda(
    x: torch.Tensor,  # [num_rows, K], num_rows <= MAX_ROWS
    qweight: torch.Tensor,  # fp8 [N, K] or packed int32 [N, K * bits / 32]
    scale: torch.Tensor,  # [N, num_groups] float32
    scheme: str,
    bias: torch.Tensor | None = None,  # [N]
    rows_per_warp: int | None = None,  # 1 or 2; None: by the number of outputs
) -> torch.Tensor:  # [num_rows, N] in x's dtype
    """Same result as `quant_linear_ref` up to float32 summation order."""
    device = x.device
    _cuda.check(
        gemv_fits(x, qweight, scale, scheme),
        f"quant_gemv takes {scheme} {tuple(x.shape)} x "
        f"{tuple(qweight.shape)} (scale {tuple(scale.shape)}): see gemv_fits()",
    )
    _cuda.check(qweight.device == device and scale.device == device, "weight and scale must be on x's device")
    num_rows, k = x.shape
    n = qweight.shape[0]
    if bias is not None:
        _cuda.check_cuda_tensor("bias", bias, [x.dtype], 1, device)
        _cuda.check(bias.shape[0] == n and bias.is_contiguous(), f"bias has shape {tuple(bias.shape)}")
    rows = rows_per_warp or (2 if n >= WIDE_OUTPUTS else 1)
    _cuda.check(rows in (1, 2), f"rows_per_warp {rows}: 1 or 2")
    kernel = _cuda.function(
        GEMV_SOURCE,
        "quant_gemv",
        device,
        DTYPE=_cuda.DTYPE_IDS[x.dtype],
        SCHEME=SCHEME_IDS[scheme],
        MROWS=next(v for v in ROW_VARIANTS if v >= num_rows),
        ROWS=rows,
        WARPS=WARPS_PER_BLOCK,
        UNROLL=UNROLL,
        HAS_BIAS=int(bias is not None),
    )
    out = torch.empty(num_rows, n, dtype=x.dtype, device=device)
    warps = -(-n // rows)
    args = (x, _weight_bytes(qweight), scale, bias if bias is not None else x, out)
    sizes = (
        np.int32(num_rows),
        np.int32(n),
        np.int32(k),
        np.int32(k // scale.shape[1]),
        np.int64(x.stride(0)),
    )
    _cuda.launch(kernel, (-(-warps // WARPS_PER_BLOCK),), (32 * WARPS_PER_BLOCK,), args + sizes, device)
    return out


def dequantize_weight_cuda(
    qweight: torch.Tensor,  # fp8 [N, K] or packed int32 [N, K * bits / 32]
    scale: torch.Tensor,  # [N, num_groups] float32
    scheme: str,
    dtype: torch.dtype,  # bfloat16 or float16
) -> torch.Tensor:  # [N, K]
    """Same result as `dequantize_weight_ref` (q * scale in float32, rounded once)."""
    device = qweight.device
    n = qweight.shape[0]
    k = stored_in_features(qweight, scheme)
    vals = VALUES_PER_CHUNK[scheme]
    _cuda.check(
        dtype in (torch.bfloat16, torch.float16), f"dequantize_weight writes bf16 / fp16, not {dtype}"
    )
    _cuda.check(
        qweight.is_contiguous() and k % vals == 0,
        f"weight {tuple(qweight.shape)}: contiguous, {vals}-value chunks",
    )
    _cuda.check(
        scale.dtype == torch.float32
        and scale.is_contiguous()
        and scale.shape[0] == n
        and (k // scale.shape[1]) % vals == 0,
        f"scale {tuple(scale.shape)} does not fit the weight",
    )
    kernel = _cuda.function(
        GEMV_SOURCE,
        "dequantize_weight",
        device,
        DTYPE=_cuda.DTYPE_IDS[dtype],
        SCHEME=SCHEME_IDS[scheme],
        MROWS=1,
        ROWS=1,
        WARPS=1,
        UNROLL=1,
        HAS_BIAS=0,
    )
    out = torch.empty(n, k, dtype=dtype, device=device)
    num_chunks = n * k // vals
    threads = 256
    args = (_weight_bytes(qweight), scale, out, np.int32(n), np.int32(k), np.int32(k // scale.shape[1]))
    _cuda.launch(kernel, (-(-num_chunks // threads),), (threads,), args, device)
    return out


def fp8_quantize_rows_cuda(
    x: torch.Tensor,  # [num_rows, K] bf16 / fp16, K even
) -> tuple[torch.Tensor, torch.Tensor]:  # (float8_e4m3fn [num_rows, K], scale float32 [num_rows, 1])
    """Same result as `quantize_fp8_per_token_ref`; sm_89 and later (the e4m3 conversion)."""
    device = x.device
    _cuda.check_cuda_tensor("x", x, [torch.bfloat16, torch.float16], 2, device)
    num_rows, k = x.shape
    _cuda.check(k % 2 == 0 and x.stride(1) == 1, f"x {tuple(x.shape)}: an even number of contiguous columns")
    kernel = _cuda.function(
        QUANTIZE_SOURCE, "fp8_quantize_rows", device, DTYPE=_cuda.DTYPE_IDS[x.dtype], THREADS=QUANTIZE_THREADS
    )
    q = torch.empty(num_rows, k, dtype=FP8_DTYPE, device=device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=device)
    if num_rows:
        args = (x, q.view(torch.uint8), scale, np.int32(k), np.int64(x.stride(0)))
        _cuda.launch(kernel, (num_rows,), (QUANTIZE_THREADS,), args, device)
    return q, scale


def fp8_scaled_mm_cuda(
    x: torch.Tensor,  # [num_rows, K] bf16
    qweight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N, 1] float32
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [num_rows, N] bf16
    """Same result as `fp8_scaled_mm_ref` up to float32 summation order: x quantized per token,
    the product on the FP8 tensor cores with row-wise scales."""
    _cuda.check(
        scaled_mm_fits(x, qweight),
        f"fp8 _scaled_mm takes {tuple(x.shape)} x {tuple(qweight.shape)}: see scaled_mm_fits()",
    )
    x_q, x_scale = fp8_quantize_rows_cuda(x)
    out = torch._scaled_mm(x_q, qweight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype)
    return out if bias is None else out.add_(bias)
