"""Fused kernels of the decode loop and their torch reference twins.

The engine calls kernels only through the names exported here. Each dispatches to the CUDA kernel
(CuPy RawKernel, compiled with NVRTC; `kernels/_cuda.py`) when its tensors are on a CUDA device and
CuPy works there, and to the torch reference (`*_ref`, same signature) otherwise; CuPy is imported
only then, so CPU-only machines and CI never import it. `SPECMESH_KERNELS=ref` forces the references.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kernels import _cuda
from kernels.attention_ref import AttentionMetadata, append_attention_ref, write_kv_ref
from kernels.fused_layers_ref import (
    embed_norm_concat_ref,
    fused_add_rms_norm_ref,
    gelu_tanh_and_mul_ref,
    rotary_embedding_ref,
    rotary_write_kv_ref,
    silu_and_mul_ref,
)
from kernels.ngram_ref import ngram_match_ref
from kernels.post_step_ref import post_step_update_ref, post_step_update_slots_ref
from kernels.quant_ref import dequantize_weight_ref, quant_linear_ref
from kernels.quant_tiled_ref import TiledWeight
from kernels.run_ahead_ref import SlotState, fill_ahead_ref
from kernels.tree_ref import (
    TreeForwardInputs,
    compact_path_kv_ref,
    graft_trees_ref,
    top_k_ids_ref,
    tree_forward_inputs_ref,
    verify_tree_ref,
)
from kernels.verify_ref import verify_sample_ref

POST_STEP_SLOTS_ENV = "SPECMESH_POST_STEP_SLOTS"
"""Set to `off` to run `post_step_update_slots` as the torch ops it folds (gathers, the update,
scatters) even on CUDA (A/B timing of the step's tail)."""


def compiled_variants() -> int:
    """CUDA kernel variants built so far in this process (0 without CuPy)."""
    return _cuda.compiled_variants()


def cuda_available(*tensors: torch.Tensor) -> bool:
    """True when the CUDA kernels run for these tensors (all on CUDA, CuPy importable)."""
    return _cuda.available(*tensors)


def append_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """`softcap`: attention-logit soft-capping (Gemma-2); the torch reference only: the CUDA
    kernel has no cap, so a capped call on CUDA is refused (`SPECMESH_KERNELS=ref` runs it exactly)."""
    if _cuda.available(query):
        if softcap is not None:
            raise ValueError(
                "the CUDA attention kernel has no attention-logit soft-capping (attn_logit_softcapping); "
                "set SPECMESH_KERNELS=ref to run the exact torch reference on the GPU"
            )
        from kernels.attention import append_attention_cuda

        return append_attention_cuda(query, key_cache, value_cache, meta, scale, sliding_window)
    return append_attention_ref(query, key_cache, value_cache, meta, scale, sliding_window, softcap)


def linear(
    x: torch.Tensor,  # [num_rows, in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None = None,  # [out_features]
    out_dtype: torch.dtype | None = None,  # None: x's dtype (or out's)
    out: torch.Tensor | None = None,  # [num_rows, out_features], contiguous: written in place
) -> torch.Tensor:  # [num_rows, out_features]
    """`F.linear(x, weight, bias)` in `out_dtype`: the skinny CUDA kernel (kernels/skinny_gemm.py) where
    it beats cuBLAS (one bf16 / fp16 row and a wide matrix, large or small: `preferred`), cuBLAS
    otherwise. With `out`, the result lands there (cast once, as `.to(out_dtype)` would). Not
    differentiable through the kernel: with autograd recording, cuBLAS runs."""
    if out is not None:
        out_dtype = out.dtype
    if _cuda.available(x) and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        from kernels import skinny_gemm

        if skinny_gemm.preferred(x, weight):
            return skinny_gemm.skinny_linear_cuda(x, weight, bias, out_dtype, out=out)
    result = F.linear(x, weight, bias)
    if out is not None:
        return out.copy_(result)
    return result if out_dtype is None else result.to(out_dtype)


def quant_linear(
    x: torch.Tensor,  # [num_rows, in_features]
    qweight: torch.Tensor,  # fp8 [out_features, in_features] or packed int32 (kernels/quant_ref.py)
    scale: torch.Tensor,  # [out_features, num_groups] float32
    scheme: str,  # fp8, int8 or int4
    bias: torch.Tensor | None = None,  # [out_features]
    out_dtype: torch.dtype | None = None,  # None: x's dtype
    tiled: TiledWeight | None = None,  # the same weight in the tile layout (kernels/quant_tiled_ref.py)
) -> torch.Tensor:  # [num_rows, out_features]
    """x @ dequantize(weight).T (+ bias) on CUDA through the kernel `quant_path` names (rows as
    kernels/quant_gemm.py `choose_path` deals them): int8 / int4 in the tile layout through
    `quant_tiled` (SPECMESH_QUANT_KERNEL=mma turns it off), one row through the one-row kernel, else
    on tensor cores dequantizing in registers (`quant_mma`, groups a multiple of its K step); fp8
    (and int8 / int4 groups quant_mma does not take) through the one-row kernel up to 16 rows, fp8
    past FP8_GEMV_MAX_ROWS on the FP8 tensor cores with per-token activation scales (bf16, sm_89+);
    else the weight dequantized for cuBLAS. Elsewhere (CPU, float32) the torch reference
    `quant_linear_ref`."""
    if _cuda.available(x) and x.dtype in (torch.bfloat16, torch.float16):
        from kernels import quant_gemm, quant_tiled

        path = quant_path(x, qweight, scale, scheme, tiled)
        if path == "tiled":
            assert tiled is not None
            result = quant_tiled.quant_tiled_cuda(x, tiled, bias)
        elif path == "mma":
            result = quant_gemm.quant_mma_cuda(x, qweight, scale, scheme, bias)
        elif path == "gemv":
            result = quant_gemm.quant_gemv_cuda(x, qweight, scale, scheme, bias)
        elif path == "scaled_mm":
            result = quant_gemm.fp8_scaled_mm_cuda(x, qweight, scale, bias)
        else:
            weight = quant_gemm.dequantize_weight_cuda(qweight, scale, scheme, x.dtype)
            result = F.linear(x, weight, bias)
        return result if out_dtype is None else result.to(out_dtype)
    return quant_linear_ref(x, qweight, scale, scheme, bias, out_dtype)


def quant_path(
    x: torch.Tensor,  # [num_rows, in_features] bf16 / fp16 on CUDA
    qweight: torch.Tensor,
    scale: torch.Tensor,
    scheme: str,
    tiled: TiledWeight | None = None,
) -> str:
    """The kernel `quant_linear` runs for these CUDA operands (`choose_path`'s names: tiled, gemv,
    mma, scaled_mm, dequantize)."""
    from kernels import quant_gemm, quant_tiled

    return quant_gemm.choose_path(
        x.shape[0],
        gemv_ok=quant_gemm.gemv_fits(x, qweight, scale, scheme),
        mma_ok=quant_gemm.mma_fits(x, qweight, scale, scheme),
        scaled_mm_ok=scheme == "fp8" and quant_gemm.scaled_mm_fits(x, qweight) and scale.shape[1] == 1,
        tiled_ok=tiled is not None and quant_tiled.kernel_enabled() and quant_tiled.tiled_fits(x, tiled),
        wide=qweight.shape[0] >= quant_gemm.TILED_MIN_WIDTH * x.shape[1],
    )


def dequantize_weight(
    qweight: torch.Tensor, scale: torch.Tensor, scheme: str, dtype: torch.dtype
) -> torch.Tensor:  # [out_features, in_features] in `dtype`
    """See `dequantize_weight_ref`; the CUDA kernel for bf16 / fp16 on a CUDA device."""
    if _cuda.available(qweight) and dtype in (torch.bfloat16, torch.float16):
        from kernels.quant_gemm import dequantize_weight_cuda

        return dequantize_weight_cuda(qweight, scale, scheme, dtype)
    return dequantize_weight_ref(qweight, scale, scheme, dtype)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if _cuda.available(key):
        from kernels.attention import write_kv_cuda

        write_kv_cuda(key, value, key_cache, value_cache, slot_mapping)
        return
    write_kv_ref(key, value, key_cache, value_cache, slot_mapping)


def fused_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden_size]
    residual: torch.Tensor | None,  # [num_tokens, hidden_size]
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, new_residual)
    if _cuda.available(x):
        from kernels.fused_layers import fused_add_rms_norm_cuda

        return fused_add_rms_norm_cuda(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def embed_norm_concat(
    input_ids: torch.Tensor,  # [num_tokens] int32 or int64
    embedding: torch.Tensor,  # [vocab_size, hidden_size]
    hidden: torch.Tensor,  # [num_tokens, hidden_size]
    embed_weight: torch.Tensor,  # [hidden_size]
    hidden_weight: torch.Tensor,  # [hidden_size]
    embed_eps: float,
    hidden_eps: float,
) -> torch.Tensor:  # [num_tokens, 2 * hidden_size]
    """See `embed_norm_concat_ref`; one kernel on CUDA where four ran (gather, two norms, cat)."""
    args = (input_ids, embedding, hidden, embed_weight, hidden_weight, embed_eps, hidden_eps)
    if _cuda.available(hidden):
        from kernels.fused_layers import embed_norm_concat_cuda

        return embed_norm_concat_cuda(*args)
    return embed_norm_concat_ref(*args)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [num_tokens, 2 * intermediate_size] -> [num_tokens, intermediate_size]
    if _cuda.available(gate_up):
        from kernels.fused_layers import silu_and_mul_cuda

        return silu_and_mul_cuda(gate_up)
    return silu_and_mul_ref(gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU's `gelu_tanh(gate) * up`; torch ops on every device (no fused kernel)."""
    # gate_up: [num_tokens, 2 * intermediate_size] -> [num_tokens, intermediate_size]
    return gelu_tanh_and_mul_ref(gate_up)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [max_positions, head_dim / 2] float32
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # rotated (query, key), new contiguous tensors
    if _cuda.available(query):
        from kernels.fused_layers import rotary_embedding_cuda

        return rotary_embedding_cuda(positions, query, key, cos, sin)
    return rotary_embedding_ref(positions, query, key, cos, sin)


def rotary_write_kv(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [max_positions, head_dim / 2] float32
    sin: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; negative: the token writes no KV
) -> torch.Tensor:  # the rotated query, a new contiguous tensor
    """See `rotary_write_kv_ref`; one kernel on CUDA where two ran (rotary, KV write)."""
    args = (positions, query, key, value, cos, sin, key_cache, value_cache, slot_mapping)
    if _cuda.available(query):
        from kernels.fused_layers import rotary_write_kv_cuda

        return rotary_write_kv_cuda(*args)
    return rotary_write_kv_ref(*args)


def ngram_match(
    history: torch.Tensor,
    lengths: torch.Tensor,
    min_n: int,
    max_n: int,
    k: int | torch.Tensor,
    budget: int | None = None,
    row_ids: torch.Tensor | None = None,
    max_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `ngram_match_ref`; `max_k` (the largest k, the drafts' width) spares a host read of `k`."""
    if _cuda.available(history):
        from kernels.ngram import ngram_match_cuda

        return ngram_match_cuda(history, lengths, min_n, max_n, k, budget, max_k, row_ids)
    return ngram_match_ref(history, lengths, min_n, max_n, k, budget, row_ids, max_k)


def verify_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    draft_ids: torch.Tensor,
    cu_num_rows: torch.Tensor,
    strategy: int,
    policy: int = 0,
    max_rows: int | None = None,
    request_of_row: torch.Tensor | None = None,
    bitmask: torch.Tensor | None = None,
    masked_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See `verify_sample_ref`; `max_rows` (the most rows of one request, the tokens' width) and
    `request_of_row` ([num_rows] int32) spare the CUDA kernel a host read of `cu_num_rows`;
    `bitmask` ([num_rows, num_words] int32) and `masked_rows` ([num_rows] int32) constrain the rows
    marked to their grammar's tokens (both or neither)."""
    rows = (temperature, top_k, top_p, min_p, seeds, positions, draft_ids, cu_num_rows)
    masks = (bitmask, masked_rows)
    if _cuda.available(logits):
        from kernels.verify import verify_sample_cuda

        return verify_sample_cuda(logits, *rows, strategy, policy, max_rows, request_of_row, *masks)
    return verify_sample_ref(logits, *rows, strategy, policy, max_rows, *masks)


def post_step_update(
    token_ids: torch.Tensor,
    row_ids: torch.Tensor | None,
    lengths: torch.Tensor,
    num_output: torch.Tensor,
    new_tokens: torch.Tensor,
    num_new: torch.Tensor,
    max_tokens: torch.Tensor,
    min_tokens: torch.Tensor,
    ignore_eos: torch.Tensor,
    eos_ids: torch.Tensor,
    stop_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See `post_step_update_ref` for the arguments."""
    update = post_step_update_ref
    if _cuda.available(token_ids):
        from kernels.post_step import post_step_update_cuda as update
    return update(
        token_ids,
        row_ids,
        lengths,
        num_output,
        new_tokens,
        num_new,
        max_tokens,
        min_tokens,
        ignore_eos,
        eos_ids,
        stop_ids,
    )


def post_step_update_slots(
    token_rows: torch.Tensor,
    slots: torch.Tensor,
    num_tokens: torch.Tensor,
    num_output: torch.Tensor,
    new_tokens: torch.Tensor,
    num_accepted: torch.Tensor,
    max_tokens: torch.Tensor,
    min_tokens: torch.Tensor,
    ignore_eos: torch.Tensor,
    eos_ids: torch.Tensor,
    stop_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See `post_step_update_slots_ref` for the arguments; one launch on CUDA (with
    SPECMESH_POST_STEP_SLOTS=off: the gathers, `post_step_update` and the scatters it folds)."""
    slot_state = (token_rows, slots, num_tokens, num_output)
    if not _cuda.available(token_rows) or os.environ.get(POST_STEP_SLOTS_ENV, "").lower() == "off":
        update = post_step_update if _cuda.available(token_rows) else post_step_update_ref
        return post_step_update_slots_ref(
            *slot_state,
            new_tokens,
            num_accepted,
            max_tokens,
            min_tokens,
            ignore_eos,
            eos_ids,
            stop_ids,
            update,
        )
    from kernels.post_step import post_step_update_slots_cuda

    return post_step_update_slots_cuda(
        *slot_state, new_tokens, num_accepted, max_tokens, min_tokens, ignore_eos, eos_ids, stop_ids
    )


def fill_ahead(
    num_filled: torch.Tensor | None,
    token_slots: torch.Tensor,
    request_of_token: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_tables: torch.Tensor,
    slots: SlotState,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    row_positions: torch.Tensor,
    draft_ids: torch.Tensor,
    block_size: int,
    tree_mask: torch.Tensor | None = None,
    tree_parents: torch.Tensor | None = None,
) -> None:
    """See `fill_ahead_ref` for the arguments; one launch on CUDA, which a CUDA graph can capture."""
    fill = fill_ahead_ref
    if _cuda.available(input_ids):
        from kernels.run_ahead import fill_ahead_cuda as fill
    fill(
        num_filled,
        token_slots,
        request_of_token,
        query_start_loc,
        block_tables,
        slots,
        input_ids,
        positions,
        slot_mapping,
        seq_lens,
        row_positions,
        draft_ids,
        block_size,
        tree_mask,
        tree_parents,
    )


def verify_tree(
    target_ids: torch.Tensor,
    draft_ids: torch.Tensor,
    cu_num_rows: torch.Tensor,
    parents: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See `verify_tree_ref`: (token_ids, num_accepted, path); one launch on CUDA."""
    if _cuda.available(target_ids):
        from kernels.tree import verify_tree_cuda

        return verify_tree_cuda(target_ids, draft_ids, cu_num_rows, parents)
    return verify_tree_ref(target_ids, draft_ids, cu_num_rows, parents)


def compact_path_kv(
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    path: torch.Tensor,
    num_accepted: torch.Tensor,
    root_positions: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
) -> None:
    """See `compact_path_kv_ref`; on CUDA one launch for every layer of `caches` (allocated as one
    tensor, as the engine does), for paths up to 32 deep."""
    if _cuda.available(path):
        from kernels.tree import MAX_PATH_DEPTH, compact_path_kv_cuda

        if path.shape[1] - 1 <= MAX_PATH_DEPTH:
            compact_path_kv_cuda(caches, path, num_accepted, root_positions, block_tables, block_size)
            return
    compact_path_kv_ref(caches, path, num_accepted, root_positions, block_tables, block_size)


def graft_trees(
    head_parents: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, num_branch: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See `graft_trees_ref`: (token_ids, parents, num_drafts); one launch on CUDA."""
    if _cuda.available(drafts):
        from kernels.tree import graft_trees_cuda

        return graft_trees_cuda(head_parents, drafts, num_drafts, num_branch)
    return graft_trees_ref(head_parents, drafts, num_drafts, num_branch)


def top_k_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """See `top_k_ids_ref`: [num_rows, k] int64 columns of each row's k largest logits; one launch on
    CUDA for k up to 16 (torch's top-k beyond)."""
    if _cuda.available(logits):
        from kernels.tree import MAX_TOP_K, top_k_ids_cuda

        if k <= MAX_TOP_K and logits.dtype == torch.float32 and logits.stride(1) == 1:
            return top_k_ids_cuda(logits, k)
    return top_k_ids_ref(logits, k)


def tree_forward_inputs(
    positions: torch.Tensor,
    newest_rows: torch.Tensor,
    num_wanted: torch.Tensor,
    block_tables: torch.Tensor,
    seq_rows: torch.Tensor,
    node_depths: torch.Tensor,
    node_masks: torch.Tensor,
    num_nodes: int,
    block_size: int,
) -> TreeForwardInputs:
    """See `tree_forward_inputs_ref`: a head's forward inputs over a tree's first `num_nodes`
    nodes; one launch on CUDA."""
    args = (positions, newest_rows, num_wanted, block_tables, seq_rows, node_depths, node_masks)
    if _cuda.available(positions):
        from kernels.tree import tree_forward_inputs_cuda

        return tree_forward_inputs_cuda(*args, num_nodes, block_size)
    return tree_forward_inputs_ref(*args, num_nodes, block_size)


__all__ = [
    "compiled_variants",
    "AttentionMetadata",
    "compact_path_kv",
    "append_attention",
    "cuda_available",
    "dequantize_weight",
    "embed_norm_concat",
    "fill_ahead",
    "fused_add_rms_norm",
    "gelu_tanh_and_mul",
    "graft_trees",
    "linear",
    "ngram_match",
    "post_step_update",
    "post_step_update_slots",
    "quant_linear",
    "quant_path",
    "rotary_embedding",
    "rotary_write_kv",
    "silu_and_mul",
    "top_k_ids",
    "tree_forward_inputs",
    "TreeForwardInputs",
    "verify_sample",
    "verify_tree",
    "write_kv",
]
