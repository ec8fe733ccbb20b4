"""DeepSeek-V3-style multi-token prediction (MTP) head, the draft model of the `mtp` method.

DeepSeek-V3 (arXiv 2412.19437, §2.2) chains MTP modules after the main model; module k combines
the previous depth's hidden state of token i with the embedding of token i + k and runs one
Transformer block, so it predicts token i + k + 1. specmesh ships one module (depth 1):

    x_i  = eh_proj(concat(enorm(embed(t_{i+1})), hnorm(h_i)))     # [hidden_size]
    h'_i = DecoderLayer(x_i)                                      # attends to x_0 .. x_i
    logits_i = target.lm_head(target.norm(h'_i))                  # a draft of t_{i+2}

Terms: the *target* is the model being served; h_i is its *final-normed* hidden state at position
i (what `LlamaForCausalLM.forward` returns); the head's row i pairs h_i with the next token
t_{i+1} and sits at position i, as in vLLM's DeepSeek MTP. Embedding, final norm and LM head are
the target's, shared, never copied: the head only owns `enorm`, `hnorm`, `eh_proj` and `layer`.

Under tensor parallelism the head's layer is split like the target's layers (it has their shape, so
it splits wherever the target does, and its KV cache shares the target's per-rank layout); the
small eh_proj and the norms are replicated.

Checkpoint (its own directory, like FastDeploy's MTP checkpoint beside the main model):
`config.json` with `architectures: ["SpecmeshMTPHead"]`, the target's architecture and shape, and
`model.safetensors` with `enorm.weight`, `hnorm.weight`, `eh_proj.weight` and `layer.*` under
Hugging Face (unfused) Llama names.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kernels import AttentionMetadata
from shared.model.config import GEMMA_ARCHITECTURES, ModelConfig, ModelConfigError, read_config_json
from shared.model.llama import DecoderLayer, KVCache, LlamaForCausalLM, RMSNorm, embed_norm_concat
from shared.model.loader import iter_checkpoint_slices, load_named_tensors, save_head
from shared.model.quant_config import parse_quantization_config, resolve_quantization
from shared.model.quantization import quantize_linears
from shared.model.rope import RotaryEmbedding

MTP_ARCHITECTURE = "SpecmeshMTPHead"
NUM_NEXTN_PREDICT_LAYERS = 1
"""Depth of the MTP chain specmesh trains and serves (DeepSeek-V3's name for it)."""
TARGET_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "qkv_bias",
    "o_bias",
    "mlp_bias",
)
"""Target config fields a head's config.json records and must match at load time."""


class MTPHead(nn.Module):
    """One MTP module over `target`; see the module docstring for the computation."""

    target: LlamaForCausalLM
    """The served model, held by reference (not a submodule, so its weights are neither saved
    with the head nor moved, cast or switched to train mode with it)."""

    def __init__(self, target: LlamaForCausalLM):
        super().__init__()
        if target.config.architecture in GEMMA_ARCHITECTURES:
            raise ModelConfigError(
                f"MTP heads are not supported for {target.config.architecture} targets (Llama, Qwen2/3, "
                "Mistral and Phi-3 layers only); pick another speculative method"
            )
        object.__setattr__(self, "target", target)
        self.config = head_config(target.config)
        size, eps = self.config.hidden_size, self.config.rms_norm_eps
        self.enorm = RMSNorm(size, eps)
        self.hnorm = RMSNorm(size, eps)
        self.eh_proj = nn.Linear(2 * size, size, bias=False)
        # its own RoPE tables: casting the head must never cast the target's shared ones
        rotary = RotaryEmbedding(
            self.config.head_dim,
            target.rotary.max_positions,
            self.config.rope_theta,
            self.config.rope_scaling,
        )
        self.layer = DecoderLayer(self.config, rotary, self.config.sliding_windows[0], target.tp)

    @property
    def rotary(self) -> RotaryEmbedding:
        rotary: RotaryEmbedding = self.layer.self_attn.rotary
        return rotary

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]: t_{i+1}
        positions: torch.Tensor,  # [num_tokens]: i
        previous_hidden: torch.Tensor,  # [num_tokens, hidden_size]: the target's h_i
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]: h'_i, before the target's final norm
        hidden, residual = self.layer(
            positions, self._combine(input_ids, previous_hidden), None, kv_cache, meta
        )
        return hidden + residual

    def forward_with_logits(
        self,
        input_ids: torch.Tensor,  # [num_tokens]: t_{i+1}
        positions: torch.Tensor,  # [num_tokens]: i
        previous_hidden: torch.Tensor,  # [num_tokens, hidden_size]: h_i, or the previous draft's h'
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (logits [num_tokens, vocab_size] float32, h'_i)
        """`forward` and `logits` of its output at once, as a chained draft needs them: the layer's
        last residual add happens in the final norm's kernel (`add_and_norm`)."""
        hidden, residual = self.layer(
            positions, self._combine(input_ids, previous_hidden), None, kv_cache, meta
        )
        normed, stream = self.target.norm.add_and_norm(hidden, residual)
        return self.target.compute_logits(normed), stream

    def forward_dense(
        self,
        input_ids: torch.Tensor,  # [batch, seq]: t_{i+1}
        previous_hidden: torch.Tensor,  # [batch, seq, hidden_size]: h_i
    ) -> torch.Tensor:  # [batch, seq, hidden_size]
        """Causal pass without a KV cache, for training and scoring; row i sits at position i."""
        if self.target.tp.size > 1:
            raise NotImplementedError("the dense (training / scoring) forward runs on one rank only")
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.layer.forward_dense(positions, self._combine(input_ids, previous_hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [..., hidden_size] -> [..., vocab_size] float32, through the target's norm and LM head
        return self.target.compute_logits(self.target.norm(hidden))

    def _combine(self, input_ids: torch.Tensor, previous_hidden: torch.Tensor) -> torch.Tensor:
        normed = embed_norm_concat(
            self.target.embed_tokens, input_ids, self.enorm, previous_hidden, self.hnorm
        )
        return self.eh_proj(normed)


def head_config(target: ModelConfig) -> ModelConfig:
    """The config of the head's single layer: the target's shape, one layer, the target's last
    layer's attention window (the layer the head is initialised from)."""
    # the head's own checkpoint says whether its weights are stored quantized (load_mtp_head)
    return dataclasses.replace(
        target, num_hidden_layers=1, sliding_windows=target.sliding_windows[-1:], quantization=None
    )


def mtp_config_dict(head: MTPHead) -> dict[str, Any]:
    """The head's config.json: its architecture, the target's architecture and shape."""
    config = head.config
    return {
        "architectures": [MTP_ARCHITECTURE],
        "base_architecture": config.architecture,
        **{field: getattr(config, field) for field in TARGET_FIELDS},
        "sliding_window": config.sliding_windows[0],
        "max_position_embeddings": config.max_position_embeddings,
        "num_nextn_predict_layers": NUM_NEXTN_PREDICT_LAYERS,
        "torch_dtype": str(head.enorm.weight.dtype).removeprefix("torch."),
    }


def save_mtp_head(head: MTPHead, out_dir: str | Path) -> Path:
    """Writes `config.json` and `model.safetensors` into `out_dir` (created if needed)."""
    return save_head(head, head.config, mtp_config_dict(head), out_dir)


def load_mtp_head(
    mtp_dir: str | Path,
    target: LlamaForCausalLM,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
) -> MTPHead:
    """Loads a head saved by `save_mtp_head` for `target` (split as the target is); refuses one
    trained for another model. `quantization` as in `load_model` (the head's linear layers)."""
    mtp_dir = Path(mtp_dir)
    raw = read_mtp_config(mtp_dir)
    check_mtp_config(raw, target.config, mtp_dir)
    stored = parse_quantization_config(raw["quantization_config"]) if raw.get("quantization_config") else None
    scheme = resolve_quantization(quantization, stored, str(mtp_dir))
    with torch.device("meta"):
        head = MTPHead(target).to(dtype)
        if scheme is not None:
            quantize_linears(head, scheme, str(mtp_dir))
    head = head.to_empty(device=device)
    head.rotary.build(device)
    load_named_tensors(head, head.config, iter_checkpoint_slices(mtp_dir), str(mtp_dir), tp=target.tp)
    return head.eval()


def read_mtp_config(mtp_dir: Path) -> dict[str, Any]:
    return read_config_json(mtp_dir, "an MTP head directory written by `specmesh train-mtp`")


def check_mtp_config(raw: dict[str, Any], target: ModelConfig, mtp_dir: Path) -> None:
    """Raises ModelConfigError naming every field where the head does not fit the target."""
    architectures = raw.get("architectures") or []
    if architectures != [MTP_ARCHITECTURE]:
        raise ModelConfigError(
            f"{mtp_dir} holds architecture {architectures[0] if architectures else None!r}, "
            f"not an MTP head ({MTP_ARCHITECTURE!r}); pass the directory `specmesh train-mtp` wrote"
        )
    depth = raw.get("num_nextn_predict_layers", NUM_NEXTN_PREDICT_LAYERS)
    if depth != NUM_NEXTN_PREDICT_LAYERS:
        raise ModelConfigError(
            f"{mtp_dir}: num_nextn_predict_layers {depth} is not supported (only {NUM_NEXTN_PREDICT_LAYERS})"
        )
    expected = {"base_architecture": target.architecture, **{f: getattr(target, f) for f in TARGET_FIELDS}}
    mismatches = [
        f"{field} {raw.get(field)!r} != target's {value!r}"
        for field, value in expected.items()
        if raw.get(field) != value
    ]
    if mismatches:
        raise ModelConfigError(
            f"MTP head in {mtp_dir} was not trained for this target model: {'; '.join(mismatches)}"
        )
