"""Llama-family decoder (Llama 2/3, Qwen2/3, Mistral, Phi-3, Gemma-2/3) over a paged KV cache.

The model is pure: it takes flat token ids of every sequence in the step, their positions, the
attention metadata and the per-layer KV caches, and returns hidden states. Only the rows that need
logits go through `compute_logits`.

The serving path (`forward`) carries the residual stream as vLLM does: a layer returns its MLP
output and the stream *before* that output is added (`(hidden, residual)`), and the next norm adds
the two in the same kernel that normalises them (`kernels.fused_add_rms_norm`). SiLU-and-mul and
the rotary embedding are fused kernels too, and a decode step's few rows go through the skinny
matrix kernel (`kernels.linear`) instead of cuBLAS. On CPU the kernels' torch twins run, with the rounding
of the plain formulas, so outputs are bit-identical to an unfused model. `forward_dense` (training,
scoring) runs the same twins directly: they are differentiable, the CUDA kernels are not.

Under tensor parallelism (`tp`, shared/model/parallel.py) each rank builds the same modules over its
slices: its attention heads and MLP columns, its vocabulary rows; one all-reduce joins each
attention's and each MLP's output, and every rank ends with the same hidden states and logits.

The architectures differ only in config-driven details (shared/model/config.py lists them). Those
without a fused CUDA kernel run as torch ops on every device: Gemma's offset-weight RMSNorm, GeGLU,
the q/k head norms; attention-logit soft-capping has no CUDA kernel and is refused there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels import AttentionMetadata
from kernels.attention_ref import softcapped_attention
from kernels.fused_layers_ref import (
    fused_add_rms_norm_ref,
    gelu_tanh_and_mul_ref,
    offset_add_rms_norm_ref,
    silu_and_mul_ref,
)
from shared.model.config import ModelConfig
from shared.model.parallel import (
    SINGLE,
    TensorParallel,
    num_local_heads,
    num_local_kv_heads,
    vocab_shard,
)
from shared.model.quantization import QuantizedLinear
from shared.model.rope import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]
"""(key_cache, value_cache) of one layer, each [num_blocks, block_size, num_kv_heads, head_dim]."""


def linear(
    layer: nn.Linear | QuantizedLinear,
    x: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    with_bias: bool = True,
) -> torch.Tensor:
    """`layer(x)` (in `out_dtype`, or into `out`) through `kernels.linear`: the skinny CUDA kernel
    where it beats cuBLAS, cuBLAS otherwise (and always when training); a quantized layer through
    `kernels.quant_linear`."""
    bias = layer.bias if with_bias else None
    if isinstance(layer, QuantizedLinear):
        result = layer.matmul(x, with_bias, out_dtype)
        return result if out is None else out.copy_(result)
    return kernels.linear(x, layer.weight, bias, out_dtype, out)


def row_parallel(layer: nn.Linear | QuantizedLinear, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """`layer(x)` for a layer whose input features are split over the ranks: each rank's partial
    product, summed by one all-reduce, the bias added once after it."""
    if tp.size == 1:
        return linear(layer, x)
    out = tp.all_reduce(linear(layer, x, with_bias=False))
    return out if layer.bias is None else out + layer.bias


class VocabParallelEmbedding(nn.Embedding):
    """`nn.Embedding` over the rank's rows of the vocabulary: a token outside them embeds to zeros
    here, and the all-reduce brings its row from the rank that holds it."""

    def __init__(
        self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE, multiplier: float | None = None
    ):
        """`multiplier`: every embedding is scaled by it (rounded to the weights' dtype first, as
        Gemma does); None: not scaled."""
        start, num_rows = vocab_shard(vocab_size, tp)
        super().__init__(num_rows, hidden_size)
        self.vocab_start = start
        self.tp = tp
        self.multiplier = multiplier

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = super().forward(input_ids) if self.tp.size == 1 else self._forward_split(input_ids)
        if self.multiplier is None:
            return hidden
        return hidden * hidden.new_tensor(self.multiplier)

    def _forward_split(self, input_ids: torch.Tensor) -> torch.Tensor:
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.num_embeddings)
        hidden = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(hidden.masked_fill(outside[..., None], 0.0))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, weight_offset: float = 0.0):
        """`weight_offset`: the scale is weight_offset + weight (Gemma stores weight - 1)."""
        super().__init__()
        self.weight = nn.Parameter(torch.full((size,), 1.0 - weight_offset))
        self.eps = eps
        self.weight_offset = weight_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """weight * RMSNorm(x) over the last dimension: plain torch ops while autograd records
        (training) or for other than [num_tokens, hidden_size] input, else the fused kernel."""
        if self.weight_offset:
            return offset_add_rms_norm_ref(x, None, self.weight, self.eps, self.weight_offset)[0]
        if x.dim() == 2 and not torch.is_grad_enabled():
            return kernels.fused_add_rms_norm(x.contiguous(), None, self.weight, self.eps)[0]
        return fused_add_rms_norm_ref(x, None, self.weight, self.eps)[0]

    def add_and_norm(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size]
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]; None: x starts the stream
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, new_residual)
        """new_residual = x + residual, normed = weight * RMSNorm(new_residual); one kernel on CUDA
        (torch ops for an offset weight)."""
        if self.weight_offset:
            return offset_add_rms_norm_ref(x, residual, self.weight, self.eps, self.weight_offset)
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)


def embed_norm_concat(
    embedding: nn.Embedding,
    input_ids: torch.Tensor,  # [num_tokens] int32 or int64
    embed_norm: RMSNorm,
    hidden: torch.Tensor,  # [num_tokens, hidden_size] (training: [batch, seq, hidden_size])
    hidden_norm: RMSNorm,
) -> torch.Tensor:  # [..., 2 * hidden_size]
    """concat(embed_norm(embedding(input_ids)), hidden_norm(hidden)): what a draft head's first
    projection reads (the MTP head's eh_proj, EAGLE-3's attention). One kernel in serving
    (`kernels.embed_norm_concat`) over a whole-vocabulary embedding without a multiplier and plain
    norms; the modules one by one otherwise (training, a vocabulary split over ranks, Gemma's norms)."""
    whole = not isinstance(embedding, VocabParallelEmbedding) or (
        embedding.tp.size == 1 and embedding.multiplier is None
    )
    plain = not embed_norm.weight_offset and not hidden_norm.weight_offset
    if not (whole and plain and hidden.dim() == 2 and not torch.is_grad_enabled()):
        return torch.cat((embed_norm(embedding(input_ids)), hidden_norm(hidden)), dim=-1)
    return kernels.embed_norm_concat(
        input_ids.contiguous(),
        embedding.weight,
        hidden.contiguous(),
        embed_norm.weight,
        hidden_norm.weight,
        embed_norm.eps,
        hidden_norm.eps,
    )


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        sliding_window: int | None,
        tp: TensorParallel = SINGLE,
    ):
        """Column-parallel q/k/v (this rank's heads), row-parallel o_proj."""
        super().__init__()
        self.tp = tp
        self.num_heads = num_local_heads(config, tp)
        self.num_kv_heads = num_local_kv_heads(config, tp)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.attention_scale
        self.softcap = config.attn_logit_softcapping
        self.sliding_window = sliding_window
        self.rotary = rotary
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.norm_weight_offset)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.norm_weight_offset)

    def _norm_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [..., num_heads, head_dim], k: [..., num_kv_heads, head_dim]; each head normed on its own
        if self.q_norm is None or self.k_norm is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = linear(self.qkv_proj, hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self._norm_heads(q, k)
        key_cache, value_cache = kv_cache
        q = self.rotary.forward_and_write_kv(positions, q, k, v, key_cache, value_cache, meta.slot_mapping)
        out = kernels.append_attention(
            q, key_cache, value_cache, meta, self.scale, self.sliding_window, self.softcap
        )
        return row_parallel(self.o_proj, out.flatten(1), self.tp)

    def forward_dense(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Training / scoring path without a KV cache: hidden [batch, seq, hidden], causal."""
        batch, seq_len, _ = hidden.shape
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(batch * seq_len, self.num_heads, self.head_dim)
        k = k.view(batch * seq_len, self.num_kv_heads, self.head_dim)
        q, k = self.rotary.forward_dense(positions.repeat(batch), *self._norm_heads(q, k))
        q = q.view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        mask = None
        if self.sliding_window is not None or self.softcap is not None:
            pos = torch.arange(seq_len, device=hidden.device)
            distance = pos[:, None] - pos[None, :]
            mask = (distance >= 0) & (distance < (self.sliding_window or seq_len))
        if self.softcap is not None:
            assert mask is not None
            bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
            out = softcapped_attention(q, k, v, bias, self.scale, self.softcap)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True
            )
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        """Column-parallel gate_up_proj (this rank's columns), row-parallel down_proj."""
        super().__init__()
        self.tp = tp
        self.intermediate_size = config.intermediate_size // tp.size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.geglu = config.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden_size]; gate_up_proj gives the gate half, then the up half
        gate_up = linear(self.gate_up_proj, x)
        act_and_mul = kernels.gelu_tanh_and_mul if self.geglu else kernels.silu_and_mul
        return row_parallel(self.down_proj, act_and_mul(gate_up), self.tp)

    def forward_dense(self, x: torch.Tensor) -> torch.Tensor:
        act_and_mul = gelu_tanh_and_mul_ref if self.geglu else silu_and_mul_ref
        return self.down_proj(act_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        sliding_window: int | None,
        tp: TensorParallel = SINGLE,
    ):
        super().__init__()
        size, eps, offset = config.hidden_size, config.rms_norm_eps, config.norm_weight_offset
        self.input_layernorm = RMSNorm(size, eps, offset)
        self.self_attn = Attention(config, rotary, sliding_window, tp)
        self.post_attention_layernorm = RMSNorm(size, eps, offset)
        self.mlp = MLP(config, tp)
        self.sandwich_norm = config.sandwich_norm
        if config.sandwich_norm:
            self.pre_feedforward_layernorm = RMSNorm(size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(size, eps, offset)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden_size]: the previous layer's MLP output
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]: the stream before it; None: first layer
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's MLP output, the stream before it)
        """The layer's output stream is the sum of the two returned tensors; the next norm adds them."""
        hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        if self.sandwich_norm:
            hidden = self.post_attention_layernorm(hidden)
            hidden, residual = self.pre_feedforward_layernorm.add_and_norm(hidden, residual)
            return self.post_feedforward_layernorm(self.mlp(hidden)), residual
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual

    def forward_dense(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        attended = self.self_attn.forward_dense(positions, self.input_layernorm(hidden))
        if self.sandwich_norm:
            hidden = hidden + self.post_attention_layernorm(attended)
            mlp_out = self.mlp.forward_dense(self.pre_feedforward_layernorm(hidden))
            return hidden + self.post_feedforward_layernorm(mlp_out)
        hidden = hidden + attended
        return hidden + self.mlp.forward_dense(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(nn.Module):
    """One class for every supported architecture: they differ only in config-driven details
    (qkv bias, q/k norms, sliding windows, RoPE scaling, tied embeddings, Gemma's norms,
    activation and soft-capping)."""

    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallel = SINGLE):
        """`tp`: this rank's place in a tensor-parallel group (its slices of every layer)."""
        super().__init__()
        self.config = config
        self.tp = tp
        self.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)
        # Gemma-3's sliding-window layers rotate with a RoPE base of their own
        self.local_rotary = self.rotary
        if config.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(
                config.head_dim, max_positions, config.local_rope_theta, config.local_rope_scaling
            )
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp, config.embedding_multiplier
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.rotary if window is None else self.local_rotary, window, tp)
            for window in config.sliding_windows
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_offset)
        self.lm_head = nn.Linear(config.hidden_size, self.embed_tokens.num_embeddings, bias=False)
        self.tie_weights()

    def build_rotary(self, device: torch.device) -> None:
        """(Re)computes every RoPE table on `device` (after materialising from meta and casting)."""
        self.rotary.build(device)
        if self.local_rotary is not self.rotary:
            self.local_rotary.build(device)

    def tie_weights(self) -> None:
        """Shares the embedding with the LM head when the checkpoint ties them (again after
        materialising from meta, which unties parameters)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden_size], after the final norm
        """`after_layer(i)`, where given, runs once layer i is queued (its KV written, on the CPU)."""
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
            if after_layer is not None:
                after_layer(index)
        return self.norm.add_and_norm(hidden, residual)[0]

    def forward_with_aux(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        aux_layers: tuple[int, ...],
        after_layer: Callable[[int], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, and the residual stream entering each layer of `aux_layers` (layer 0's is the
        embedding), concatenated: [num_tokens, len(aux_layers) * hidden_size]. What an EAGLE-3
        head reads (shared/model/eagle3.py); the same pass, not a second one."""
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        streams: dict[int, torch.Tensor] = {}
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if index in aux_layers:
                streams[index] = hidden if residual is None else hidden + residual
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
            if after_layer is not None:
                after_layer(index)
        aux = torch.cat([streams[index] for index in aux_layers], dim=-1)
        return self.norm.add_and_norm(hidden, residual)[0], aux

    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [batch, seq] -> final-normed hidden [batch, seq, hidden]; for training and scoring."""
        return self.forward_dense_with_aux(input_ids, ())[0]

    def forward_dense_with_aux(
        self, input_ids: torch.Tensor, aux_layers: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_dense` and, as `forward_with_aux`, the streams entering `aux_layers`
        ([batch, seq, len(aux_layers) * hidden]; empty for none)."""
        if self.tp.size > 1:
            raise NotImplementedError("the dense (training / scoring) forward runs on one rank only")
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.embed_tokens(input_ids)
        streams: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(cast(list[DecoderLayer], self.layers)):
            if index in aux_layers:
                streams[index] = hidden
            hidden = layer.forward_dense(positions, hidden)
        aux = torch.cat([streams[index] for index in aux_layers], dim=-1) if aux_layers else hidden[..., :0]
        return self.norm(hidden), aux

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [num_rows, hidden_size] (or [batch, seq, hidden_size] in training) -> float32
        logits, written into `out` ([num_rows, vocab_size] float32) when given. Under tensor
        parallelism every rank's vocabulary columns are gathered: each rank gets all the logits."""
        if self.tp.size == 1:
            logits = linear(self.lm_head, hidden, torch.float32, out)
        else:
            gathered = self.tp.gather_columns(
                linear(self.lm_head, hidden, torch.float32), self.config.vocab_size
            )
            logits = gathered.contiguous() if out is None else out.copy_(gathered)
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits
        if torch.is_grad_enabled() and logits.requires_grad:
            return torch.tanh(logits / cap) * cap
        # in place: `out` (a CUDA graph's logits buffer) receives the capped logits
        return logits.div_(cap).tanh_().mul_(cap)
