"""CUDA residual add + RMSNorm, a draft head's two input norms, SiLU-and-mul, rotary embedding and
rotary with the KV write (CuPy RawKernel, NVRTC); twins of `fused_layers_ref`.

Each replaces a chain of small torch kernels of every decoder layer (the residual add and the
RMSNorm's eight ops, the SiLU and the product, the rotary's gather / split / four products / cat /
casts, then the KV write), or of every draft of an MTP / EAGLE-3 chain (the embedding gather, two
norms and the cat of `embed_norm_concat`), with one launch that reads its inputs once. They round where the references round (the
residual sum, the normalised row before the weight, SiLU's output, the rotated values), so they
differ from them only by float32 summation order and `exp`/`rsqrt` ulps; the rotary kernel does
the references' float32 products and sums unfused (`__fmul_rn`), so it matches them bit for bit.

Rows are read and written 16 bytes at a time (`W = VEC` elements) when their length and
addresses allow it, else one element at a time (`W = 1`); the choice depends on shapes and
strides only, so a CUDA-graph warm-up compiles every variant its capture needs. No kernel reads
anything back to the host: all are capture-safe and run on torch's current stream.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels import _cuda

MAX_THREADS = 1024
MAX_CHUNKS_PER_THREAD = 8
"""Row chunks one thread of the norm kernel keeps in registers (rows up to 64k bf16 elements)."""
ROTARY_THREADS = 256

COMMON = (
    _cuda.CONVERSIONS
    + r"""
/* W elements of scalar_t <-> floats: 16-byte accesses when W == VEC (address 16-byte aligned) */
__device__ __forceinline__ void load_w(const scalar_t* p, float* out) {
#if W == VEC
    load_vec(p, out);
#else
#pragma unroll
    for (int i = 0; i < W; ++i) out[i] = to_float(p[i]);
#endif
}
__device__ __forceinline__ void store_w(scalar_t* p, const float* v) {
#if W == VEC
    store_vec(p, v);
#else
#pragma unroll
    for (int i = 0; i < W; ++i) p[i] = from_float(v[i]);
#endif
}
__device__ __forceinline__ void load_f32_w(const float* p, float* out) {
#if W % 4 == 0
#pragma unroll
    for (int i = 0; i < W; i += 4) {
        const float4 f = __ldg(reinterpret_cast<const float4*>(p + i));
        out[i] = f.x; out[i + 1] = f.y; out[i + 2] = f.z; out[i + 3] = f.w;
    }
#else
#pragma unroll
    for (int i = 0; i < W; ++i) out[i] = __ldg(p + i);
#endif
}
/* the value a float takes once stored in the model dtype */
__device__ __forceinline__ float round_to_dtype(float x) { return to_float(from_float(x)); }

"""
)

NORM_ROW = (
    COMMON
    + r"""
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* One row by the whole block. Pass 1 forms the residual sum (rounded to the dtype, stored), keeps
   it in registers and sums its squares; the block reduces the sum; pass 2 scales, rounds,
   multiplies by the weight and rounds again, as `weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)`
   does. `warp_sums`: 32 floats of shared memory. */
__device__ __forceinline__ void norm_row(
    const scalar_t* __restrict__ x,          /* [hidden] */
    const scalar_t* __restrict__ residual,   /* [hidden]; unused without HAS_RESIDUAL */
    const scalar_t* __restrict__ weight,     /* [hidden] */
    scalar_t* __restrict__ normed,           /* [hidden] */
    scalar_t* __restrict__ new_residual,     /* [hidden]; unused without HAS_RESIDUAL */
    int hidden, float eps, float* warp_sums)
{
    const int chunks = hidden / W;
    float vals[CPT][W];
    float sumsq = 0.f;
#pragma unroll
    for (int j = 0; j < CPT; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c < chunks) {
            load_w(x + c * W, vals[j]);
#if HAS_RESIDUAL
            float r[W];
            load_w(residual + c * W, r);
#pragma unroll
            for (int i = 0; i < W; ++i) vals[j][i] = round_to_dtype(vals[j][i] + r[i]);
            store_w(new_residual + c * W, vals[j]);
#endif
#pragma unroll
            for (int i = 0; i < W; ++i) sumsq += vals[j][i] * vals[j][i];
        }
    }
    sumsq = warp_sum(sumsq);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_sums[warp] = sumsq;
    __syncthreads();
    if (warp == 0) {
        float s = lane < (int)(blockDim.x >> 5) ? warp_sums[lane] : 0.f;
        s = warp_sum(s);
        if (lane == 0) warp_sums[0] = s;
    }
    __syncthreads();
    const float inv_rms = rsqrtf(warp_sums[0] / (float)hidden + eps);
#pragma unroll
    for (int j = 0; j < CPT; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c < chunks) {
            float w[W];
            load_w(weight + c * W, w);
#pragma unroll
            for (int i = 0; i < W; ++i) vals[j][i] = __fmul_rn(w[i], round_to_dtype(__fmul_rn(vals[j][i], inv_rms)));
            store_w(normed + c * W, vals[j]);
        }
    }
}
"""
)

NORM_SOURCE = (
    NORM_ROW
    + r"""
/* One block per row. */
extern "C" __global__ void __launch_bounds__(1024) fused_add_rms_norm(
    const scalar_t* __restrict__ x,          /* [num_tokens, hidden] */
    const scalar_t* __restrict__ residual,   /* [num_tokens, hidden]; unused without HAS_RESIDUAL */
    const scalar_t* __restrict__ weight,     /* [hidden] */
    scalar_t* __restrict__ normed,           /* [num_tokens, hidden] */
    scalar_t* __restrict__ new_residual,     /* [num_tokens, hidden]; unused without HAS_RESIDUAL */
    int hidden, float eps)
{
    __shared__ float warp_sums[32];
    const long long row = (long long)blockIdx.x * hidden;
    norm_row(x + row, residual + row, weight, normed + row, new_residual + row, hidden, eps, warp_sums);
}
"""
)

EMBED_NORM_SOURCE = (
    NORM_ROW
    + r"""
#if IDS_64
typedef long long token_id_t;
#else
typedef int token_id_t;
#endif
/* Blocks (token, half): half 0 normalises the embedding row of the token's id, half 1 the token's
   hidden row, each into its half of the token's output row [normed embedding | normed hidden],
   rounded as `norm_row` rounds. An id outside the table gives a NaN half, never a stray read. */
extern "C" __global__ void __launch_bounds__(1024) embed_norm_concat(
    const token_id_t* __restrict__ input_ids,          /* [num_tokens] */
    const scalar_t* __restrict__ embedding,      /* [vocab_size, hidden] */
    const scalar_t* __restrict__ hidden_states,  /* [num_tokens, hidden] */
    const scalar_t* __restrict__ embed_weight,   /* [hidden] */
    const scalar_t* __restrict__ hidden_weight,  /* [hidden] */
    scalar_t* __restrict__ out,                  /* [num_tokens, 2 * hidden] */
    int hidden, long long vocab_size, float embed_eps, float hidden_eps)
{
    __shared__ float warp_sums[32];
    const long long token = blockIdx.x;
    scalar_t* dst = out + token * 2 * hidden + blockIdx.y * hidden;
    if (blockIdx.y == 1) {
        norm_row(hidden_states + token * hidden, nullptr, hidden_weight, dst, nullptr, hidden, hidden_eps,
                 warp_sums);
        return;
    }
    const long long id = input_ids[token];
    if (id < 0 || id >= vocab_size) {
        float nan[W];
#pragma unroll
        for (int i = 0; i < W; ++i) nan[i] = __int_as_float(0x7fc00000);
        for (int c = threadIdx.x; c < hidden / W; c += blockDim.x) store_w(dst + c * W, nan);
        return;
    }
    norm_row(embedding + id * hidden, nullptr, embed_weight, dst, nullptr, hidden, embed_eps, warp_sums);
}
"""
)

SILU_SOURCE = (
    COMMON
    + r"""
/* One thread per W-element chunk of a token's intermediate row: out = silu(gate) * up, silu's
   result rounded to the dtype first, as `F.silu(gate) * up` does. */
extern "C" __global__ void silu_and_mul(
    const scalar_t* __restrict__ gate_up,    /* [num_tokens, 2 * inter] */
    scalar_t* __restrict__ out,              /* [num_tokens, inter] */
    int inter)
{
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= inter / W) return;
    const long long token = blockIdx.x;
    float g[W], u[W];
    load_w(gate_up + token * 2 * inter + c * W, g);
    load_w(gate_up + token * 2 * inter + inter + c * W, u);
#pragma unroll
    for (int i = 0; i < W; ++i) g[i] = __fmul_rn(round_to_dtype(g[i] / (1.f + expf(-g[i]))), u[i]);
    store_w(out + token * inter + c * W, g);
}
"""
)

ROTATE = r"""
/* Rotates chunk c (W elements) of one head's first half and its partner in the second half:
   element i pairs with i + HALF. A position outside the tables (`valid` false) gives NaNs. */
__device__ __forceinline__ void rotate_chunk(
    const scalar_t* src, scalar_t* dst, const float* cos_table, const float* sin_table,
    long long pos, bool valid, int c)
{
    float x1[W], x2[W], cs[W], sn[W], o1[W], o2[W];
    load_w(src + c * W, x1);
    load_w(src + HALF + c * W, x2);
    if (valid) {
        load_f32_w(cos_table + pos * HALF + c * W, cs);
        load_f32_w(sin_table + pos * HALF + c * W, sn);
    } else {
#pragma unroll
        for (int i = 0; i < W; ++i) cs[i] = sn[i] = __int_as_float(0x7fc00000);
    }
#pragma unroll
    for (int i = 0; i < W; ++i) {
        o1[i] = __fsub_rn(__fmul_rn(x1[i], cs[i]), __fmul_rn(x2[i], sn[i]));
        o2[i] = __fadd_rn(__fmul_rn(x2[i], cs[i]), __fmul_rn(x1[i], sn[i]));
    }
    store_w(dst + c * W, o1);
    store_w(dst + HALF + c * W, o2);
}
"""

ROTARY_SOURCE = (
    COMMON
    + ROTATE
    + r"""
/* One block per token, one thread per (head, W-element chunk of the first half) of the query and
   key heads: element i pairs with i + HALF. Inputs may be strided views (of a fused QKV output);
   outputs are contiguous. A position outside the tables gives NaN rows, never a stray read. */
extern "C" __global__ void rotary_embedding(
    const long long* __restrict__ positions, /* [num_tokens] */
    const scalar_t* __restrict__ query,      /* [num_tokens, num_heads, 2 * HALF], strided */
    const scalar_t* __restrict__ key,        /* [num_tokens, num_kv_heads, 2 * HALF], strided */
    const float* __restrict__ cos_table,     /* [max_positions, HALF] */
    const float* __restrict__ sin_table,
    scalar_t* __restrict__ query_out,        /* [num_tokens, num_heads, 2 * HALF] */
    scalar_t* __restrict__ key_out,          /* [num_tokens, num_kv_heads, 2 * HALF] */
    int num_heads, int num_kv_heads, long long max_positions,
    long long q_token_stride, long long q_head_stride, long long k_token_stride, long long k_head_stride)
{
    const long long token = blockIdx.x;
    const long long pos = positions[token];
    const bool valid = pos >= 0 && pos < max_positions;
    const int chunks = HALF / W;
    const int items = (num_heads + num_kv_heads) * chunks;
    for (int item = threadIdx.x; item < items; item += blockDim.x) {
        const int head = item / chunks, c = item - head * chunks;
        const scalar_t* src;
        scalar_t* dst;
        if (head < num_heads) {
            src = query + token * q_token_stride + head * q_head_stride;
            dst = query_out + (token * num_heads + head) * (2 * HALF);
        } else {
            const int kv_head = head - num_heads;
            src = key + token * k_token_stride + kv_head * k_head_stride;
            dst = key_out + (token * num_kv_heads + kv_head) * (2 * HALF);
        }
        rotate_chunk(src, dst, cos_table, sin_table, pos, valid, c);
    }
}
"""
)


ROTARY_KV_SOURCE = (
    COMMON
    + ROTATE
    + r"""
__device__ __forceinline__ void copy_w(scalar_t* dst, const scalar_t* src) {
#if W == VEC
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
#else
#pragma unroll
    for (int i = 0; i < W; ++i) dst[i] = src[i];
#endif
}

/* `rotary_embedding` whose key heads go, rotated, straight into the paged key cache at the
   token's slot, its value heads copied into the value cache there (a slot < 0 writes neither), as
   `write_kv` would write them: one block per token, the rotation's items (query and key heads x
   W-element chunks of their first half), then the values' (kv heads x W-element chunks). The
   rounding is the rotary kernel's; the values are copied bit for bit. */
extern "C" __global__ void rotary_write_kv(
    const long long* __restrict__ positions, /* [num_tokens] */
    const scalar_t* __restrict__ query,      /* [num_tokens, num_heads, 2 * HALF], strided */
    const scalar_t* __restrict__ key,        /* [num_tokens, num_kv_heads, 2 * HALF], strided */
    const scalar_t* __restrict__ value,      /* [num_tokens, num_kv_heads, 2 * HALF], strided */
    const float* __restrict__ cos_table,     /* [max_positions, HALF] */
    const float* __restrict__ sin_table,
    const long long* __restrict__ slot_mapping, /* [num_tokens] */
    scalar_t* __restrict__ query_out,        /* [num_tokens, num_heads, 2 * HALF] */
    scalar_t* __restrict__ key_cache,        /* [num_slots, num_kv_heads, 2 * HALF] */
    scalar_t* __restrict__ value_cache,      /* [num_slots, num_kv_heads, 2 * HALF] */
    int num_heads, int num_kv_heads, long long max_positions,
    long long q_token_stride, long long q_head_stride, long long k_token_stride, long long k_head_stride,
    long long v_token_stride, long long v_head_stride)
{
    const long long token = blockIdx.x;
    const long long pos = positions[token];
    const long long slot = slot_mapping[token];
    const bool valid = pos >= 0 && pos < max_positions;
    const int chunks = HALF / W;
    const int items = (num_heads + (slot >= 0 ? num_kv_heads : 0)) * chunks;
    for (int item = threadIdx.x; item < items; item += blockDim.x) {
        const int head = item / chunks, c = item - head * chunks;
        const scalar_t* src;
        scalar_t* dst;
        if (head < num_heads) {
            src = query + token * q_token_stride + head * q_head_stride;
            dst = query_out + (token * num_heads + head) * (2 * HALF);
        } else {
            const int kv_head = head - num_heads;
            src = key + token * k_token_stride + kv_head * k_head_stride;
            dst = key_cache + (slot * num_kv_heads + kv_head) * (2 * HALF);
        }
        rotate_chunk(src, dst, cos_table, sin_table, pos, valid, c);
    }
    if (slot < 0) return;
    const int value_chunks = 2 * HALF / W;
    for (int item = threadIdx.x; item < num_kv_heads * value_chunks; item += blockDim.x) {
        const int head = item / value_chunks, c = item - head * value_chunks;
        copy_w(value_cache + (slot * num_kv_heads + head) * (2 * HALF) + c * W,
               value + token * v_token_stride + head * v_head_stride + c * W);
    }
}
"""
)


def fused_add_rms_norm_cuda(
    x: torch.Tensor,  # [num_tokens, hidden_size]
    residual: torch.Tensor | None,  # [num_tokens, hidden_size]
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, new_residual)
    """Same contract as `fused_add_rms_norm_ref`; out of place (x and residual are only read).
    Without a residual, new_residual is x itself."""
    device = x.device
    _cuda.check_cuda_tensor("x", x, list(_cuda.DTYPE_IDS), 2, device)
    _cuda.check_cuda_tensor("weight", weight, [x.dtype], 1, device)
    num_tokens, hidden = x.shape
    _cuda.check(weight.shape[0] == hidden, f"weight has {weight.shape[0]} elements, x rows {hidden}")
    _cuda.check(x.is_contiguous() and weight.is_contiguous(), "x and weight must be contiguous")
    tensors = [x, weight]
    if residual is not None:
        _cuda.check_cuda_tensor("residual", residual, [x.dtype], 2, device)
        _cuda.check(
            residual.shape == x.shape, f"residual shape {tuple(residual.shape)} != x {tuple(x.shape)}"
        )
        _cuda.check(residual.is_contiguous(), "residual must be contiguous")
        tensors.append(residual)
    w = _vector_width(hidden, x.element_size(), tensors)
    threads, chunks_per_thread = _norm_threads(hidden, w)
    normed = torch.empty_like(x)
    new_residual = torch.empty_like(x) if residual is not None else x
    if num_tokens == 0:
        return normed, new_residual
    kernel = _cuda.function(
        NORM_SOURCE,
        "fused_add_rms_norm",
        device,
        DTYPE=_cuda.DTYPE_IDS[x.dtype],
        W=w,
        CPT=chunks_per_thread,
        HAS_RESIDUAL=int(residual is not None),
    )
    _cuda.launch(
        kernel,
        (num_tokens,),
        (threads,),
        (
            x,
            x if residual is None else residual,
            weight,
            normed,
            new_residual,
            np.int32(hidden),
            np.float32(eps),
        ),
        device,
    )
    return normed, new_residual


def embed_norm_concat_cuda(
    input_ids: torch.Tensor,  # [num_tokens] int32 or int64
    embedding: torch.Tensor,  # [vocab_size, hidden_size]
    hidden: torch.Tensor,  # [num_tokens, hidden_size]
    embed_weight: torch.Tensor,  # [hidden_size]
    hidden_weight: torch.Tensor,  # [hidden_size]
    embed_eps: float,
    hidden_eps: float,
) -> torch.Tensor:  # [num_tokens, 2 * hidden_size]
    """Same contract as `embed_norm_concat_ref`, in one launch; each half is rounded as
    `fused_add_rms_norm_cuda` (no residual) rounds its row, with the same reduction order, so the
    result equals the embedding gather, the two norms and the concatenation bit for bit. An id
    outside the table gives a NaN half."""
    device = hidden.device
    _cuda.check_cuda_tensor("input_ids", input_ids, [torch.int32, torch.int64], 1, device)
    _cuda.check_cuda_tensor("hidden", hidden, list(_cuda.DTYPE_IDS), 2, device)
    num_tokens, size = hidden.shape
    for name, tensor, ndim in (
        ("embedding", embedding, 2),
        ("embed_weight", embed_weight, 1),
        ("hidden_weight", hidden_weight, 1),
    ):
        _cuda.check_cuda_tensor(name, tensor, [hidden.dtype], ndim, device)
        _cuda.check(tensor.shape[-1] == size, f"{name} has shape {tuple(tensor.shape)}, hidden rows {size}")
    _cuda.check(input_ids.shape[0] == num_tokens, f"{input_ids.shape[0]} ids for {num_tokens} hidden rows")
    tensors = [input_ids, embedding, hidden, embed_weight, hidden_weight]
    _cuda.check(
        all(t.is_contiguous() for t in tensors), "input_ids, embedding, hidden and weights must be contiguous"
    )
    out = torch.empty(num_tokens, 2 * size, dtype=hidden.dtype, device=device)
    if num_tokens == 0:
        return out
    w = _vector_width(size, hidden.element_size(), tensors[1:] + [out])
    threads, chunks_per_thread = _norm_threads(size, w)
    kernel = _cuda.function(
        EMBED_NORM_SOURCE,
        "embed_norm_concat",
        device,
        DTYPE=_cuda.DTYPE_IDS[hidden.dtype],
        W=w,
        CPT=chunks_per_thread,
        HAS_RESIDUAL=0,
        IDS_64=int(input_ids.dtype == torch.int64),
    )
    args = (
        input_ids,
        embedding,
        hidden,
        embed_weight,
        hidden_weight,
        out,
        np.int32(size),
        np.int64(embedding.shape[0]),
        np.float32(embed_eps),
        np.float32(hidden_eps),
    )
    _cuda.launch(kernel, (num_tokens, 2), (threads,), args, device)
    return out


def silu_and_mul_cuda(gate_up: torch.Tensor) -> torch.Tensor:  # [num_tokens, intermediate_size]
    """Same contract as `silu_and_mul_ref` for gate_up [num_tokens, 2 * intermediate_size]."""
    device = gate_up.device
    _cuda.check_cuda_tensor("gate_up", gate_up, list(_cuda.DTYPE_IDS), 2, device)
    _cuda.check(gate_up.is_contiguous(), "gate_up must be contiguous")
    num_tokens, width = gate_up.shape
    _cuda.check(width % 2 == 0, f"gate_up has {width} columns; expected gate and up halves")
    inter = width // 2
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=device)
    if num_tokens == 0 or inter == 0:
        return out
    w = _vector_width(inter, gate_up.element_size(), [gate_up])
    chunks = inter // w
    threads = min(256, _round_up(chunks, 32))
    kernel = _cuda.function(SILU_SOURCE, "silu_and_mul", device, DTYPE=_cuda.DTYPE_IDS[gate_up.dtype], W=w)
    _cuda.launch(
        kernel, (num_tokens, -(-chunks // threads)), (threads,), (gate_up, out, np.int32(inter)), device
    )
    return out


def rotary_embedding_cuda(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rows may be strided
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rows may be strided
    cos: torch.Tensor,  # [max_positions, head_dim / 2] float32
    sin: torch.Tensor,  # [max_positions, head_dim / 2] float32
) -> tuple[torch.Tensor, torch.Tensor]:  # rotated (query, key), new contiguous tensors
    """Same contract as `rotary_embedding_ref`, out of place: query and key may be any views whose
    last dimension is contiguous (the q and k slices of a fused QKV projection); the outputs are
    new contiguous tensors, so a captured graph never writes into its inputs."""
    device = query.device
    query_out, (num_heads, num_kv_heads, head_dim) = _rotary_launch_checks(positions, query, key, cos, sin)
    num_tokens, half = query.shape[0], head_dim // 2
    key_out = torch.empty(num_tokens, num_kv_heads, head_dim, dtype=query.dtype, device=device)
    if num_tokens == 0:
        return query_out, key_out
    es = query.element_size()
    strides = [query.stride(0), query.stride(1), key.stride(0), key.stride(1)]
    w = _vector_width(half, es, [query, key, query_out, key_out], strides)
    if w > 1 and (cos.data_ptr() % 16 or sin.data_ptr() % 16):
        w = 1
    chunks = half // w
    threads = min(ROTARY_THREADS, _round_up((num_heads + num_kv_heads) * chunks, 32))
    kernel = _cuda.function(
        ROTARY_SOURCE, "rotary_embedding", device, DTYPE=_cuda.DTYPE_IDS[query.dtype], W=w, HALF=half
    )
    i64 = np.int64
    _cuda.launch(
        kernel,
        (num_tokens,),
        (threads,),
        (
            positions,
            query,
            key,
            cos,
            sin,
            query_out,
            key_out,
            np.int32(num_heads),
            np.int32(num_kv_heads),
            i64(cos.shape[0]),
            *(i64(s) for s in strides),
        ),
        device,
    )
    return query_out, key_out


def _rotary_launch_checks(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Checks a rotary launch's inputs; (the rotated query's new contiguous tensor, (num_heads,
    num_kv_heads, head_dim))."""
    device = query.device
    _cuda.check_cuda_tensor("query", query, list(_cuda.DTYPE_IDS), 3, device)
    _cuda.check_cuda_tensor("key", key, [query.dtype], 3, device)
    _cuda.check_cuda_tensor("positions", positions, [torch.int64], 1, device)
    _cuda.check_cuda_tensor("cos", cos, [torch.float32], 2, device)
    _cuda.check_cuda_tensor("sin", sin, [torch.float32], 2, device)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    _cuda.check(
        key.shape[0] == num_tokens and key.shape[2] == head_dim,
        f"key shape {tuple(key.shape)} does not match query {tuple(query.shape)}",
    )
    _cuda.check(positions.shape[0] == num_tokens, f"{positions.shape[0]} positions for {num_tokens} tokens")
    _cuda.check(head_dim % 2 == 0, f"head_dim {head_dim} must be even")
    half = head_dim // 2
    _cuda.check(
        cos.shape == sin.shape and cos.shape[1] == half and cos.is_contiguous() and sin.is_contiguous(),
        f"cos / sin must be contiguous [max_positions, {half}] tables (float32: build them after casting)",
    )
    _cuda.check(query.stride(2) == 1 and key.stride(2) == 1, "query and key must be contiguous in head_dim")
    _cuda.check(positions.is_contiguous(), "positions must be contiguous")
    query_out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=device)
    return query_out, (num_heads, num_kv_heads, head_dim)


def rotary_write_kv_cuda(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rows may be strided
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rows may be strided
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rows may be strided
    cos: torch.Tensor,  # [max_positions, head_dim / 2] float32
    sin: torch.Tensor,  # [max_positions, head_dim / 2] float32
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; negative: the token writes no KV
) -> torch.Tensor:  # the rotated query, a new contiguous tensor
    """Same contract as `rotary_write_kv_ref`: `rotary_embedding_cuda` and `write_kv` of the rotated
    key and the value in one launch, bit for bit what the two write."""
    device = query.device
    query_out, (num_heads, num_kv_heads, head_dim) = _rotary_launch_checks(positions, query, key, cos, sin)
    _cuda.check_cuda_tensor("value", value, [query.dtype], 3, device)
    _cuda.check_cuda_tensor("key_cache", key_cache, [query.dtype], 4, device)
    _cuda.check_cuda_tensor("value_cache", value_cache, [query.dtype], 4, device)
    _cuda.check_cuda_tensor("slot_mapping", slot_mapping, [torch.int64], 1, device)
    num_tokens = query.shape[0]
    _cuda.check(value.shape == key.shape, f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    _cuda.check(value.stride(2) == 1, "value must be contiguous in head_dim")
    _cuda.check(
        key_cache.shape == value_cache.shape and key_cache.shape[2:] == key.shape[1:],
        f"caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)} must be [.., {num_kv_heads}, {head_dim}]",
    )
    _cuda.check(key_cache.is_contiguous() and value_cache.is_contiguous(), "KV caches must be contiguous")
    _cuda.check(
        slot_mapping.shape[0] == num_tokens and slot_mapping.is_contiguous(),
        "slot_mapping must be contiguous with one slot per token",
    )
    if num_tokens == 0:
        return query_out
    es, half = query.element_size(), head_dim // 2
    strides = [
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
    ]
    tensors = [query, key, value, query_out, key_cache, value_cache]
    w = _vector_width(half, es, tensors, strides)
    if w > 1 and (cos.data_ptr() % 16 or sin.data_ptr() % 16):
        w = 1
    items = max((num_heads + num_kv_heads) * (half // w), num_kv_heads * (head_dim // w))
    threads = min(ROTARY_THREADS, _round_up(items, 32))
    kernel = _cuda.function(
        ROTARY_KV_SOURCE, "rotary_write_kv", device, DTYPE=_cuda.DTYPE_IDS[query.dtype], W=w, HALF=half
    )
    i64 = np.int64
    args = (
        positions,
        query,
        key,
        value,
        cos,
        sin,
        slot_mapping,
        query_out,
        key_cache,
        value_cache,
        np.int32(num_heads),
        np.int32(num_kv_heads),
        i64(cos.shape[0]),
        *(i64(s) for s in strides),
    )
    _cuda.launch(kernel, (num_tokens,), (threads,), args, device)
    return query_out


def _norm_threads(hidden: int, w: int) -> tuple[int, int]:
    """(threads, chunks each keeps in registers) of a block normalising a row of `hidden` elements
    `w` at a time."""
    chunks = hidden // w
    threads = min(MAX_THREADS, _round_up(chunks, 32))
    per_thread = -(-chunks // threads)
    _cuda.check(
        per_thread <= MAX_CHUNKS_PER_THREAD, f"hidden size {hidden} too large for one thread block per row"
    )
    return threads, _round_up_pow2(per_thread)


def _vector_width(
    row_len: int, elem_size: int, tensors: list[torch.Tensor], strides: list[int] | None = None
) -> int:
    """VEC (16-byte accesses) when rows split into whole chunks and every row start is 16-byte
    aligned, else 1. `strides` (in elements) default to contiguous rows of `row_len`."""
    vec = 16 // elem_size
    aligned = all(t.data_ptr() % 16 == 0 for t in tensors)
    aligned &= all(s * elem_size % 16 == 0 for s in strides or [])
    return vec if row_len % vec == 0 and aligned else 1


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _round_up_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
