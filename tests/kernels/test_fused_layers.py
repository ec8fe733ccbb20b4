"""Fused residual add + RMSNorm, a draft head's input norms, SiLU-and-mul, rotary embedding and
rotary with the KV write.

On CPU: the torch twins are bit-identical to the plain formulas the model used before, and so is
the whole serving forward (layers returning (hidden, residual)) and the MTP head (its chained
drafts' `forward_with_logits` too). On a GPU: the
CUDA kernels against float64 references over many shapes (outputs poisoned with NaN first), the
rotary kernel bit-identical to its twin, and all three replayed from a CUDA graph.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import AttentionMetadata, _cuda
from kernels.fused_layers_ref import (
    embed_norm_concat_ref,
    fused_add_rms_norm_ref,
    rotary_embedding_ref,
    rotary_write_kv_ref,
    silu_and_mul_ref,
)
from shared.model import LlamaForCausalLM, load_model
from shared.model.llama import DecoderLayer, KVCache, RMSNorm
from shared.model.mtp import MTPHead
from shared.model.rope import RotaryEmbedding
from tests.kernels.helpers import needs_cuda, rel_error
from tests.paged import two_chunks

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


# ---- the formulas the model used before the fused kernels (copied, not imported) ----


def old_rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * x32.to(x.dtype)


def old_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)


def old_layer(
    layer: DecoderLayer,
    positions: torch.Tensor,
    hidden: torch.Tensor,
    kv_cache: KVCache,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """`DecoderLayer.forward` as it read before: residual adds, RMSNorm, SiLU and RoPE unfused."""
    attn = layer.self_attn
    q, k, v = attn.qkv_proj(old_rms_norm(layer.input_layernorm, hidden)).split(
        [attn.q_size, attn.kv_size, attn.kv_size], dim=-1
    )
    q = q.view(-1, attn.num_heads, attn.head_dim)
    k = k.view(-1, attn.num_kv_heads, attn.head_dim)
    v = v.view(-1, attn.num_kv_heads, attn.head_dim)
    cos, sin = attn.rotary.cos[positions].unsqueeze(1), attn.rotary.sin[positions].unsqueeze(1)
    q, k = old_rotate(q, cos, sin), old_rotate(k, cos, sin)
    kernels.write_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
    out = kernels.append_attention(q, kv_cache[0], kv_cache[1], meta, attn.scale, attn.sliding_window)
    hidden = hidden + attn.o_proj(out.flatten(1))
    mlp = layer.mlp
    gate, up = mlp.gate_up_proj(old_rms_norm(layer.post_attention_layernorm, hidden)).split(
        mlp.intermediate_size, dim=-1
    )
    return hidden + mlp.down_proj(F.silu(gate) * up)


def old_forward(
    model: LlamaForCausalLM,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list[KVCache],
    meta: AttentionMetadata,
) -> torch.Tensor:
    hidden = model.embed_tokens(input_ids)
    for layer, kv_cache in zip(model.layers, kv_caches):
        hidden = old_layer(layer, positions, hidden, kv_cache, meta)
    return old_rms_norm(model.norm, hidden)


def zero_caches(
    num_layers: int,
    num_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str = "cpu",
) -> list[KVCache]:
    shape = (-(-num_tokens // 4) + 2, 4, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]


# ---- CPU: the twins are the old formulas, bit for bit ----


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_reference_is_the_old_residual_add_and_rms_norm(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    for num_tokens, hidden_size in [(1, 64), (7, 96), (33, 896), (5, 1536)]:
        norm = RMSNorm(hidden_size, 1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(hidden_size, generator=generator) * 0.3 + 1)
        x = (torch.randn(num_tokens, hidden_size, generator=generator) * 2).to(dtype)
        residual = (torch.randn(num_tokens, hidden_size, generator=generator) * 5).to(dtype)
        normed, new_residual = fused_add_rms_norm_ref(x, residual, norm.weight, norm.eps)
        # the model added the layer's output to the stream: hidden + attn_out
        assert torch.equal(new_residual, residual + x)
        assert torch.equal(normed, old_rms_norm(norm, residual + x))
        normed, same = fused_add_rms_norm_ref(x, None, norm.weight, norm.eps)
        assert same is x and torch.equal(normed, old_rms_norm(norm, x))
        assert torch.equal(norm(x), old_rms_norm(norm, x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_reference_is_the_old_formula(dtype: torch.dtype) -> None:
    gate_up = (torch.randn(37, 2 * 160, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    gate, up = gate_up.split(160, dim=-1)
    out = silu_and_mul_ref(gate_up)
    assert torch.equal(out, F.silu(gate) * up)
    # the rounding the CUDA kernel reproduces: silu in float32 rounded to the dtype, then the product
    # in float32 rounded again
    silu = F.silu(gate.float()).to(dtype)
    assert torch.equal(out, (silu.float() * up.float()).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_reference_is_the_old_rotation_of_fused_qkv_views(dtype: torch.dtype) -> None:
    num_tokens, num_heads, num_kv_heads, head_dim = 19, 6, 3, 16
    rotary = RotaryEmbedding(head_dim, 64, 10000.0, None)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    query = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    key = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 64, (num_tokens,))
    out_q, out_k = rotary_embedding_ref(positions, query, key, rotary.cos, rotary.sin)
    cos, sin = rotary.cos[positions].unsqueeze(1), rotary.sin[positions].unsqueeze(1)
    assert torch.equal(out_q, old_rotate(query, cos, sin))
    assert torch.equal(out_k, old_rotate(key, cos, sin))
    assert torch.equal(rotary(positions, query, key)[0], out_q)


def test_rotary_write_kv_reference_is_the_rotation_then_the_kv_write() -> None:
    num_tokens, num_heads, num_kv_heads, head_dim = 11, 4, 2, 16
    rotary = RotaryEmbedding(head_dim, 64, 10000.0, None)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    query, key, value = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
    )
    query = query.view(num_tokens, num_heads, head_dim)
    key, value = key.view(num_tokens, num_kv_heads, head_dim), value.view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 64, (num_tokens,))
    slots = torch.randperm(24)[:num_tokens]
    slots[3] = -1  # a padding token: no KV written
    caches = [torch.randn(6, 4, num_kv_heads, head_dim) for _ in range(2)]
    fused = [c.clone() for c in caches]
    out_q = rotary_write_kv_ref(positions, query, key, value, rotary.cos, rotary.sin, *fused, slots)
    expected_q, expected_k = rotary_embedding_ref(positions, query, key, rotary.cos, rotary.sin)
    kernels.write_kv(expected_k, value, *caches, slots)
    assert torch.equal(out_q, expected_q)
    assert torch.equal(fused[0], caches[0]) and torch.equal(fused[1], caches[1])


MODEL_CASES = {
    "llama": ("llama", {}),
    "qwen2-bias": ("qwen2", {}),
    "mistral-window-head24": ("mistral", {"head_dim": 24, "sliding_window": 7}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(MODEL_CASES))
@torch.inference_mode()
def test_model_forward_is_bit_identical_to_the_unfused_model(
    make_checkpoint, case: str, dtype: torch.dtype
) -> None:
    arch, overrides = MODEL_CASES[case]
    model = load_model(make_checkpoint(arch, **overrides), dtype, torch.device("cpu"), max_positions=512)
    c = model.config
    token_ids = torch.randint(0, 384, (29,), generator=torch.Generator().manual_seed(4))
    caches = [
        zero_caches(c.num_hidden_layers, len(token_ids), c.num_key_value_heads, c.head_dim, dtype)
        for _ in range(2)
    ]
    for chunk in two_chunks(len(token_ids), 4):
        ids = token_ids[chunk.start : chunk.end]
        new = model(ids, chunk.positions, caches[0], chunk.meta)
        old = old_forward(model, ids, chunk.positions, caches[1], chunk.meta)
        assert torch.equal(new, old)


def old_combine(head: MTPHead, input_ids: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """The MTP head's eh_proj input as it read before `embed_norm_concat`."""
    embeds = head.target.embed_tokens(input_ids)
    return head.eh_proj(
        torch.cat((old_rms_norm(head.enorm, embeds), old_rms_norm(head.hnorm, previous)), dim=-1)
    )


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mtp_head_forward_is_bit_identical_to_the_unfused_layer(make_checkpoint, dtype: torch.dtype) -> None:
    """`forward` and `forward_with_logits` (what a chained draft runs: the norms of its inputs in one
    kernel, the last residual add in the final norm's) against the unfused formulas."""
    target = load_model(make_checkpoint("llama"), dtype, torch.device("cpu"), max_positions=512)
    torch.manual_seed(0)
    head = MTPHead(target).to(dtype)
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(torch.randn_like(param) * 0.2 + (1.0 if param.dim() == 1 else 0.0))
    c = head.config
    token_ids = torch.randint(0, 384, (21,), generator=torch.Generator().manual_seed(5))
    previous = torch.randn(21, c.hidden_size).to(dtype)
    caches = [zero_caches(1, 21, c.num_key_value_heads, c.head_dim, dtype)[0] for _ in range(3)]
    for chunk in two_chunks(21, 4):
        ids, prev = token_ids[chunk.start : chunk.end], previous[chunk.start : chunk.end]
        new = head(ids, chunk.positions, prev, caches[0], chunk.meta)
        old = old_layer(head.layer, chunk.positions, old_combine(head, ids, prev), caches[1], chunk.meta)
        assert torch.equal(new, old)
        logits, chained = head.forward_with_logits(ids.int(), chunk.positions, prev, caches[2], chunk.meta)
        assert torch.equal(chained, old)
        assert torch.equal(logits, target.compute_logits(old_rms_norm(target.norm, old)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_embed_norm_concat_reference_is_the_old_gather_norms_and_cat(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    embedding = torch.randn(50, 96, generator=generator).to(dtype)
    hidden = (torch.randn(7, 96, generator=generator) * 3).to(dtype)
    embed_norm, hidden_norm = RMSNorm(96, 1e-5), RMSNorm(96, 1e-6)
    with torch.no_grad():
        embed_norm.weight.copy_(torch.rand(96, generator=generator) + 0.5)
        hidden_norm.weight.copy_(torch.rand(96, generator=generator) + 0.5)
    embed_norm, hidden_norm = embed_norm.to(dtype), hidden_norm.to(dtype)
    ids = torch.randint(0, 50, (7,), generator=generator)
    expected = torch.cat(
        (old_rms_norm(embed_norm, embedding[ids]), old_rms_norm(hidden_norm, hidden)), dim=-1
    )
    for id_dtype in (torch.int64, torch.int32):
        out = embed_norm_concat_ref(
            ids.to(id_dtype), embedding, hidden, embed_norm.weight, hidden_norm.weight, 1e-5, 1e-6
        )
        assert out.shape == (7, 192) and torch.equal(out, expected)


def test_launch_wrappers_refuse_bad_inputs_with_a_clear_message() -> None:
    from kernels.fused_layers import (
        embed_norm_concat_cuda,
        fused_add_rms_norm_cuda,
        rotary_embedding_cuda,
        rotary_write_kv_cuda,
        silu_and_mul_cuda,
    )

    x = torch.randn(4, 64)
    with pytest.raises(_cuda.KernelError, match="residual shape"):
        fused_add_rms_norm_cuda(x, torch.randn(4, 32), torch.ones(64), 1e-6)
    with pytest.raises(_cuda.KernelError, match="weight has dtype"):
        fused_add_rms_norm_cuda(x, None, torch.ones(64, dtype=torch.float16), 1e-6)
    with pytest.raises(_cuda.KernelError, match="x and weight must be contiguous"):
        fused_add_rms_norm_cuda(torch.randn(64, 4).t(), None, torch.ones(64), 1e-6)
    with pytest.raises(_cuda.KernelError, match="gate and up halves"):
        silu_and_mul_cuda(torch.randn(4, 63))
    with pytest.raises(_cuda.KernelError, match="expected one of"):
        silu_and_mul_cuda(torch.randn(4, 64, dtype=torch.float64))
    query, key = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    cos = torch.randn(10, 8)
    positions = torch.arange(3)
    with pytest.raises(_cuda.KernelError, match="positions has dtype"):
        rotary_embedding_cuda(positions.int(), query, key, cos, cos)
    with pytest.raises(_cuda.KernelError, match="cos has dtype"):
        rotary_embedding_cuda(positions, query, key, cos.half(), cos.half())
    with pytest.raises(_cuda.KernelError, match="contiguous in head_dim"):
        rotary_embedding_cuda(positions, query.transpose(0, 2).contiguous().transpose(0, 2), key, cos, cos)
    with pytest.raises(_cuda.KernelError, match="does not match query"):
        rotary_embedding_cuda(positions, query, torch.randn(3, 2, 8), cos, cos)
    ids, table, weight = torch.arange(4), torch.randn(10, 64), torch.ones(64)
    with pytest.raises(_cuda.KernelError, match="input_ids has dtype"):
        embed_norm_concat_cuda(ids.float(), table, x, weight, weight, 1e-6, 1e-6)
    with pytest.raises(_cuda.KernelError, match="3 ids for 4 hidden rows"):
        embed_norm_concat_cuda(ids[:3], table, x, weight, weight, 1e-6, 1e-6)
    with pytest.raises(_cuda.KernelError, match="embedding has shape"):
        embed_norm_concat_cuda(ids, torch.randn(10, 32), x, weight, weight, 1e-6, 1e-6)
    with pytest.raises(_cuda.KernelError, match="hidden_weight has dtype"):
        embed_norm_concat_cuda(ids, table, x, weight, weight.half(), 1e-6, 1e-6)
    with pytest.raises(_cuda.KernelError, match="must be contiguous"):
        embed_norm_concat_cuda(ids, table, torch.randn(64, 4).t(), weight, weight, 1e-6, 1e-6)
    value, cache = torch.randn(3, 2, 16), torch.randn(2, 4, 2, 16)
    with pytest.raises(_cuda.KernelError, match="value shape"):
        rotary_write_kv_cuda(positions, query, key, torch.randn(3, 1, 16), cos, cos, cache, cache, positions)
    with pytest.raises(_cuda.KernelError, match="caches"):
        rotary_write_kv_cuda(positions, query, key, value, cos, cos, cache[..., :8], cache, positions)
    with pytest.raises(_cuda.KernelError, match="slot_mapping has dtype"):
        rotary_write_kv_cuda(positions, query, key, value, cos, cos, cache, cache, positions.int())
    with pytest.raises(_cuda.KernelError, match="one slot per token"):
        rotary_write_kv_cuda(positions, query, key, value, cos, cos, cache, cache, positions[:2])


# ---- GPU: the kernels against float64 ----

NORM_HIDDEN = [64, 96, 100, 128, 896, 1536, 2048, 3584, 4096, 5120, 8192, 16384]
TOKENS = [1, 7, 64, 300]


def poison(count: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """NaN in the next `count` blocks the caching allocator hands out for this shape."""
    blocks = [torch.full(shape, float("nan"), dtype=dtype, device="cuda") for _ in range(count)]
    del blocks


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first-layer"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_fused_add_rms_norm_matches_float64(dtype: torch.dtype, with_residual: bool) -> None:
    from kernels.fused_layers import fused_add_rms_norm_cuda

    generator = torch.Generator().manual_seed(10)
    worst = 0.0
    for hidden_size in NORM_HIDDEN:
        weight = (torch.randn(hidden_size, generator=generator) * 0.3 + 1).to("cuda", dtype)
        for num_tokens in TOKENS:
            x = (torch.randn(num_tokens, hidden_size, generator=generator) * 2).to("cuda", dtype)
            residual = (torch.randn(num_tokens, hidden_size, generator=generator) * 5).to("cuda", dtype)
            res = residual if with_residual else None
            poison(2, (num_tokens, hidden_size), dtype)
            normed, new_residual = fused_add_rms_norm_cuda(x, res, weight, 1e-5)
            torch.cuda.synchronize()
            stream64 = x.double() + residual.double() if with_residual else x.double()
            rms = stream64.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()
            error = rel_error(normed, weight.double() * stream64 / rms)
            assert error < TOLERANCE[dtype], f"hidden {hidden_size}, {num_tokens} tokens: {error:.2e}"
            worst = max(worst, error)
            # the stream is rounded to the dtype exactly as the plain add rounds it
            assert torch.equal(new_residual, x + residual if with_residual else x)
    print(f"\nfused_add_rms_norm {dtype}: max relative error vs float64 {worst:.2e}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_embed_norm_concat_is_the_gather_norms_and_cat_bit_for_bit(
    dtype: torch.dtype, id_dtype: torch.dtype
) -> None:
    """One launch for what four did: equal to the gather, the two norm kernels and the cat (same
    rounding, same reduction order), within tolerance of float64; an id outside the table gives a
    NaN embedding half and leaves the hidden half alone."""
    from kernels.fused_layers import embed_norm_concat_cuda, fused_add_rms_norm_cuda

    generator = torch.Generator().manual_seed(12)
    vocab_size, worst = 300, 0.0
    for hidden_size in [64, 100, 896, 2048, 3584, 8192]:
        embedding = torch.randn(vocab_size, hidden_size, generator=generator).to("cuda", dtype)
        embed_weight = (torch.randn(hidden_size, generator=generator) * 0.3 + 1).to("cuda", dtype)
        hidden_weight = (torch.randn(hidden_size, generator=generator) * 0.3 + 1).to("cuda", dtype)
        for num_tokens in TOKENS:
            ids = torch.randint(0, vocab_size, (num_tokens,), generator=generator).to("cuda", id_dtype)
            hidden = (torch.randn(num_tokens, hidden_size, generator=generator) * 4).to("cuda", dtype)
            poison(1, (num_tokens, 2 * hidden_size), dtype)
            out = embed_norm_concat_cuda(ids, embedding, hidden, embed_weight, hidden_weight, 1e-5, 1e-6)
            embeds = embedding[ids.long()]
            unfused = torch.cat(
                (
                    fused_add_rms_norm_cuda(embeds, None, embed_weight, 1e-5)[0],
                    fused_add_rms_norm_cuda(hidden, None, hidden_weight, 1e-6)[0],
                ),
                dim=-1,
            )
            assert torch.equal(out, unfused), f"hidden {hidden_size}, {num_tokens} tokens"
            for half, (rows, weight, eps) in enumerate(
                [(embeds, embed_weight, 1e-5), (hidden, hidden_weight, 1e-6)]
            ):
                rows64 = rows.double()
                expected = weight.double() * rows64 / rows64.pow(2).mean(-1, keepdim=True).add(eps).sqrt()
                error = rel_error(out[:, half * hidden_size : (half + 1) * hidden_size], expected)
                assert error < TOLERANCE[dtype], f"hidden {hidden_size}, {num_tokens} tokens: {error:.2e}"
                worst = max(worst, error)
        ids[0] = vocab_size
        out = embed_norm_concat_cuda(ids, embedding, hidden, embed_weight, hidden_weight, 1e-5, 1e-6)
        assert torch.isnan(out[0, :hidden_size]).all() and torch.equal(
            out[0, hidden_size:], unfused[0, hidden_size:]
        )
    print(f"\nembed_norm_concat {dtype}: max relative error vs float64 {worst:.2e}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_silu_and_mul_matches_float64(dtype: torch.dtype) -> None:
    from kernels.fused_layers import silu_and_mul_cuda

    generator = torch.Generator().manual_seed(11)
    worst, worst_vs_torch = 0.0, 0.0
    for inter in [64, 100, 160, 896, 4864, 8960, 14336, 18944]:
        for num_tokens in [1, 33, 300]:
            gate_up = (torch.randn(num_tokens, 2 * inter, generator=generator) * 3).to("cuda", dtype)
            poison(1, (num_tokens, inter), dtype)
            out = silu_and_mul_cuda(gate_up)
            torch.cuda.synchronize()
            gate, up = gate_up.double().chunk(2, dim=-1)
            error = rel_error(out, gate * torch.sigmoid(gate) * up)
            assert error < TOLERANCE[dtype], f"inter {inter}, {num_tokens} tokens: {error:.2e}"
            worst = max(worst, error)
            worst_vs_torch = max(worst_vs_torch, rel_error(out, silu_and_mul_ref(gate_up)))
    print(f"\nsilu_and_mul {dtype}: max relative error vs float64 {worst:.2e}, vs torch {worst_vs_torch:.2e}")


ROTARY_HEADS = [(32, 8, 64), (28, 4, 128), (14, 2, 64), (6, 3, 16), (8, 8, 128), (4, 2, 24), (40, 8, 128)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_rotary_matches_float64_and_its_twin_exactly(dtype: torch.dtype) -> None:
    from kernels.fused_layers import rotary_embedding_cuda

    generator = torch.Generator().manual_seed(12)
    max_positions = 4096
    worst = 0.0
    for num_heads, num_kv_heads, head_dim in ROTARY_HEADS:
        rotary = RotaryEmbedding(head_dim, max_positions, 500000.0, None)
        rotary.build(torch.device("cuda"))
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        for num_tokens in [1, 37, 300]:
            positions = torch.randint(0, max_positions, (num_tokens,), generator=generator).cuda()
            qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=generator).to("cuda", dtype)
            views = (  # the q / k slices of a fused QKV output, as Attention.forward passes them
                qkv[:, :q_size].view(num_tokens, num_heads, head_dim),
                qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim),
            )
            for query, key in (views, (views[0].contiguous(), views[1].contiguous())):
                poison(2, (num_tokens, num_heads, head_dim), dtype)
                out_q, out_k = rotary_embedding_cuda(positions, query, key, rotary.cos, rotary.sin)
                torch.cuda.synchronize()
                cos = rotary.cos[positions].double().unsqueeze(1)
                sin = rotary.sin[positions].double().unsqueeze(1)
                for out, x in ((out_q, query), (out_k, key)):
                    x1, x2 = x.double().chunk(2, dim=-1)
                    expected = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
                    error = rel_error(out, expected)
                    assert error < TOLERANCE[dtype], f"{num_heads}/{num_kv_heads}x{head_dim}: {error:.2e}"
                    worst = max(worst, error)
                ref_q, ref_k = rotary_embedding_ref(positions, query, key, rotary.cos, rotary.sin)
                assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    print(f"\nrotary_embedding {dtype}: max relative error vs float64 {worst:.2e}; bit-identical to torch")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_rotary_write_kv_is_the_rotation_and_the_kv_write_bit_for_bit(dtype: torch.dtype) -> None:
    """One launch for the rotary kernel and the KV write: the same rotated query and the same cache
    contents (padding tokens, slot -1, write nothing), from fused-QKV views and contiguous heads."""
    from kernels.fused_layers import rotary_write_kv_cuda

    generator = torch.Generator().manual_seed(13)
    block_size = 16
    for num_heads, num_kv_heads, head_dim in ROTARY_HEADS:
        rotary = RotaryEmbedding(head_dim, 4096, 500000.0, None)
        rotary.build(torch.device("cuda"))
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        for num_tokens in [1, 37, 300]:
            positions = torch.randint(0, 4096, (num_tokens,), generator=generator).cuda()
            slots = torch.randperm(num_tokens + 40, generator=generator)[:num_tokens]
            slots[::5] = -1
            slots = slots.cuda()
            qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=generator).to("cuda", dtype)
            views = (
                qkv[:, :q_size].view(num_tokens, num_heads, head_dim),
                qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim),
                qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim),
            )
            num_blocks = -(-(num_tokens + 40) // block_size)
            for query, key, value in (views, tuple(v.contiguous() for v in views)):
                caches = [
                    torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(
                        "cuda", dtype
                    )
                    for _ in range(2)
                ]
                expected_caches = [c.clone() for c in caches]
                poison(1, (num_tokens, num_heads, head_dim), dtype)
                out_q = rotary_write_kv_cuda(
                    positions, query, key, value, rotary.cos, rotary.sin, *caches, slots
                )
                expected_q = rotary_write_kv_ref(
                    positions, query, key, value, rotary.cos, rotary.sin, *expected_caches, slots
                )
                shape = f"{num_heads}/{num_kv_heads}x{head_dim}, {num_tokens} tokens"
                assert torch.equal(out_q, expected_q), shape
                assert torch.equal(caches[0], expected_caches[0]) and torch.equal(
                    caches[1], expected_caches[1]
                ), shape


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernels_take_misaligned_rows(dtype: torch.dtype) -> None:
    """Rows not starting on 16 bytes take the one-element path; results match the aligned path."""
    from kernels.fused_layers import fused_add_rms_norm_cuda, rotary_embedding_cuda, silu_and_mul_cuda

    num_tokens, hidden_size = 9, 256

    def shifted(t: torch.Tensor) -> torch.Tensor:
        buffer = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")
        view = buffer[1:].view(t.shape)
        view.copy_(t)
        return view

    x = torch.randn(num_tokens, hidden_size, device="cuda").to(dtype)
    residual = torch.randn(num_tokens, hidden_size, device="cuda").to(dtype)
    weight = torch.rand(hidden_size, device="cuda").to(dtype)
    aligned = fused_add_rms_norm_cuda(x, residual, weight, 1e-6)
    odd = fused_add_rms_norm_cuda(shifted(x), shifted(residual), shifted(weight), 1e-6)
    # the one-element path sums the squares in another order: the norm may move by an ulp
    assert rel_error(odd[0], aligned[0]) < TOLERANCE[dtype] and torch.equal(odd[1], aligned[1])
    assert torch.equal(silu_and_mul_cuda(shifted(x)), silu_and_mul_cuda(x))
    rotary = RotaryEmbedding(64, 128, 10000.0, None)
    rotary.build(torch.device("cuda"))
    positions = torch.arange(num_tokens, device="cuda")
    query, key = x.view(num_tokens, 4, 64), residual[:, :128].reshape(num_tokens, 2, 64)
    expected = rotary_embedding_cuda(positions, query, key, rotary.cos, rotary.sin)
    got = rotary_embedding_cuda(positions, shifted(query), shifted(key), rotary.cos, rotary.sin)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.gpu
@needs_cuda
def test_cuda_kernels_replay_from_a_cuda_graph() -> None:
    """Captured once, replayed on new inputs: the same outputs as eager calls (no host sync inside)."""
    from kernels.fused_layers import (
        embed_norm_concat_cuda,
        fused_add_rms_norm_cuda,
        rotary_embedding_cuda,
        rotary_write_kv_cuda,
        silu_and_mul_cuda,
    )

    dtype, num_tokens, hidden_size, inter = torch.bfloat16, 24, 896, 4864
    rotary = RotaryEmbedding(64, 1024, 1e6, None)
    rotary.build(torch.device("cuda"))
    weight = torch.rand(hidden_size, device="cuda").to(dtype)
    static = dict(
        x=torch.randn(num_tokens, hidden_size, device="cuda").to(dtype),
        residual=torch.randn(num_tokens, hidden_size, device="cuda").to(dtype),
        gate_up=torch.randn(num_tokens, 2 * inter, device="cuda").to(dtype),
        qkv=torch.randn(num_tokens, (14 + 4) * 64, device="cuda").to(dtype),
        positions=torch.randint(0, 1024, (num_tokens,), device="cuda"),
        ids=torch.randint(0, 1024, (num_tokens,), device="cuda", dtype=torch.int32),
        slots=torch.randperm(64, device="cuda")[:num_tokens],
    )
    embedding = torch.randn(1024, hidden_size, device="cuda").to(dtype)
    caches = [torch.zeros(4, 16, 2, 64, device="cuda", dtype=dtype) for _ in range(2)]

    def step() -> list[torch.Tensor]:
        qkv = static["qkv"]
        query = qkv[:, : 14 * 64].view(num_tokens, 14, 64)
        key = qkv[:, 14 * 64 : 16 * 64].view(num_tokens, 2, 64)
        value = qkv[:, 16 * 64 :].view(num_tokens, 2, 64)
        return [
            *fused_add_rms_norm_cuda(static["x"], static["residual"], weight, 1e-6),
            silu_and_mul_cuda(static["gate_up"]),
            *rotary_embedding_cuda(static["positions"], query, key, rotary.cos, rotary.sin),
            embed_norm_concat_cuda(static["ids"], embedding, static["x"], weight, weight, 1e-6, 1e-6),
            rotary_write_kv_cuda(
                static["positions"], query, key, value, rotary.cos, rotary.sin, *caches, static["slots"]
            ),
            *caches,
        ]

    step()  # compiles every variant before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for name, t in static.items():
        if name == "slots":
            t.copy_(torch.randperm(64, device="cuda")[:num_tokens])
        else:
            t.copy_(torch.randint_like(t, 0, 1024) if name in ("positions", "ids") else torch.randn_like(t))
    for cache in caches:  # the warm-up call wrote its own slots: only the replay's may be there
        cache.zero_()
    graph.replay()
    torch.cuda.synchronize()
    replayed = [t.clone() for t in captured]  # the caches among them are written again below
    for cache in caches:
        cache.zero_()
    for got, expected in zip(replayed, step()):
        assert torch.equal(got, expected)


@pytest.mark.gpu
@needs_cuda
@torch.inference_mode()
def test_cuda_model_forward_matches_the_reference_path(make_checkpoint, monkeypatch) -> None:
    """The model on CUDA with every kernel vs with every torch twin, float32 logits."""
    path: Path = make_checkpoint("qwen2", num_hidden_layers=3)
    model = load_model(path, torch.float32, torch.device("cuda"), max_positions=512)
    c = model.config
    token_ids = torch.randint(0, 384, (45,), generator=torch.Generator().manual_seed(6)).cuda()

    def logits() -> torch.Tensor:
        caches = zero_caches(
            c.num_hidden_layers, 45, c.num_key_value_heads, c.head_dim, torch.float32, "cuda"
        )
        out = []
        for chunk in two_chunks(45, 4):
            meta = dataclasses.replace(
                chunk.meta,
                **{
                    name: getattr(chunk.meta, name).cuda()
                    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")
                },
            )
            hidden = model(token_ids[chunk.start : chunk.end], chunk.positions.cuda(), caches, meta)
            out.append(model.compute_logits(hidden))
        return torch.cat(out)

    fused = logits()
    monkeypatch.setattr(_cuda, "available", lambda *tensors: False)
    reference = logits()
    error = rel_error(fused, reference.double())
    assert error < 1e-4
