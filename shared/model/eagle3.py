"""EAGLE-3 draft head, the draft model of the `eagle3` method.

EAGLE-3 (Li et al., arXiv 2503.01840) drafts from features of the target: the residual streams
entering three of its layers (low, mid, high) at position i, concatenated and projected by `fc`,
fused with the embedding of the next token in one decoder layer whose attention reads both:

    g_i      = fc(concat(a_i^low, a_i^mid, a_i^high))                      # [hidden_size]
    x_i      = concat(input_layernorm(embed(t_{i+1})), hidden_norm(g_i))   # [2 * hidden_size]
    h_i      = g_i + attn(x_i) + mlp(post_attention_layernorm(g_i + attn(x_i)))
    logits_i = lm_head(norm(h_i))                                          # a draft of t_{i+2}

Terms: the *target* is the model being served; h_i is the head's *pre-norm* output. Later drafts
of a chain feed the head its own h_i in place of g_i (no fc), one position further each, as EAGLE
does. `lm_head` scores a *draft vocabulary* (often smaller than the target's): draft id d is
target id d + d2t[d]; `t2d` marks the target ids the draft vocabulary holds. The embedding is the
target's unless the checkpoint stores its own.

The head is replicated under tensor parallelism: every rank has the target's whole hidden states,
so every rank drafts the same tokens; its KV cache is its own (one layer, the target's block tables).

Checkpoint, the layout public EAGLE-3 releases use: `config.json` with architecture
`LlamaForCausalLMEagle3`, the head's shape, `draft_vocab_size` and optionally the target layers it
reads (`eagle_config.eagle_aux_hidden_state_layer_ids`); weights `fc.weight`, `midlayer.*` (Hugging
Face Llama names; q/k/v_proj take 2 x hidden_size inputs), `norm.weight`, `lm_head.weight`, `d2t`,
`t2d` and optionally `embed_tokens.weight`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kernels import AttentionMetadata
from shared.model.config import ModelConfig, ModelConfigError, read_config_json
from shared.model.llama import MLP, Attention, KVCache, LlamaForCausalLM, RMSNorm, embed_norm_concat, linear
from shared.model.loader import (
    TensorSlices,
    iter_checkpoint_slices,
    load_named_tensors,
    save_head,
)
from shared.model.rope import RotaryEmbedding

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
"""Architectures of public EAGLE-3 heads (the first is what specmesh writes)."""
NUM_AUX_LAYERS = 3
VOCAB_MAP_TENSORS = ("d2t", "t2d")
EMBEDDING = "embed_tokens.weight"
KVTensors = tuple[torch.Tensor, torch.Tensor]
"""(key, value) of one unrolled step in training: [batch, kv_heads, seq, head_dim] each."""


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's choice of target layers: the streams entering layers 2, L / 2 and L - 3 (clamped
    into the model for shallow targets)."""
    last = num_layers - 1
    return min(2, last), min(num_layers // 2, last), max(0, min(num_layers - 3, last))


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over [normed embedding | normed features]."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps)
        self.hidden_norm = RMSNorm(size, eps)
        self.self_attn = Attention(config, rotary, None)
        q_size, kv_size = self.self_attn.q_size, self.self_attn.kv_size
        self.self_attn.qkv_proj = nn.Linear(2 * size, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.post_attention_layernorm = RMSNorm(size, eps)
        self.mlp = MLP(config)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        inputs: torch.Tensor,  # [num_tokens, 2 * hidden_size]: [normed embedding | normed hidden]
        hidden: torch.Tensor,  # [num_tokens, hidden_size]: g_i, or the previous draft's h
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (the MLP's output, the stream before it): h_i is their sum
        attended = self.self_attn(positions, inputs, kv_cache, meta)
        normed, residual = self.post_attention_layernorm.add_and_norm(attended, hidden)
        return self.mlp(normed), residual

    def forward_unrolled(
        self,
        positions: torch.Tensor,  # [seq]: row i's position at this step (i + step)
        embeds: torch.Tensor,  # [batch, seq, hidden_size]
        hidden: torch.Tensor,  # [batch, seq, hidden_size]
        past: list[KVTensors],
    ) -> tuple[torch.Tensor, KVTensors]:  # h [batch, seq, hidden_size], this step's (key, value)
        """One step of training-time test (EAGLE-3 §3.2), differentiable, without a KV cache.
        Row i of step 0 attends causally to step 0's rows 0..i; row i of a later step, a draft
        of the chain that started at row i, attends to step 0's rows 0..i and to row i of every
        step since (`past`: the earlier steps' keys and values, step 0 first)."""
        attn = self.self_attn
        batch, seq_len, _ = embeds.shape
        q, k, v = attn.qkv_proj(self._inputs(embeds, hidden)).split(
            [attn.q_size, attn.kv_size, attn.kv_size], dim=-1
        )
        q = q.reshape(batch * seq_len, attn.num_heads, attn.head_dim)
        k = k.reshape(batch * seq_len, attn.num_kv_heads, attn.head_dim)
        q, k = attn.rotary.forward_dense(positions.repeat(batch), q, k)
        q = q.view(batch, seq_len, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = k.view(batch, seq_len, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        v = v.reshape(batch, seq_len, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        out = _unrolled_attention(q, past + [(k, v)], attn.scale)
        attended = attn.o_proj(out.transpose(1, 2).reshape(batch, seq_len, attn.q_size))
        residual = hidden + attended
        return residual + self.mlp.forward_dense(self.post_attention_layernorm(residual)), (k, v)

    def _inputs(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)


def _unrolled_attention(
    q: torch.Tensor,  # [batch, heads, seq, head_dim]
    steps: list[KVTensors],  # step 0 first, this step last: [batch, kv_heads, seq, head_dim] each
    scale: float,
) -> torch.Tensor:  # [batch, heads, seq, head_dim]
    group = q.shape[1] // steps[0][0].shape[1]
    keys = [k.repeat_interleave(group, dim=1) for k, _ in steps]
    values = [v.repeat_interleave(group, dim=1) for _, v in steps]
    seq_len = q.shape[2]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).tril()
    first = (q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
    diagonal = [(q * k).sum(-1, keepdim=True) * scale for k in keys[1:]]  # [batch, heads, seq, 1] each
    weights = torch.cat([first, *diagonal], dim=-1).softmax(dim=-1)
    out = weights[..., :seq_len] @ values[0]
    for index, v in enumerate(values[1:]):
        out = out + weights[..., seq_len + index, None] * v
    return out


class Eagle3Head(nn.Module):
    """An EAGLE-3 head over `target`; see the module docstring for the computation."""

    target: LlamaForCausalLM
    """The served model, held by reference (not a submodule: never saved, moved or cast with the head)."""
    d2t: torch.Tensor  # [draft_vocab_size] int64: draft id d is target id d + d2t[d]
    t2d: torch.Tensor  # [vocab_size] bool: the target ids the draft vocabulary holds

    def __init__(
        self,
        target: LlamaForCausalLM,
        config: ModelConfig,
        draft_vocab_size: int,
        aux_layers: tuple[int, ...],
        own_embedding: bool = False,
    ):
        """`config`: the head's layer (one layer, the head's hidden size); `own_embedding`: the
        checkpoint stores `embed_tokens` (else the target's is used)."""
        super().__init__()
        object.__setattr__(self, "target", target)
        self.config = config
        self.aux_layers = aux_layers
        size = config.hidden_size
        self.fc = nn.Linear(len(aux_layers) * target.config.hidden_size, size, bias=False)
        rotary = RotaryEmbedding(
            config.head_dim, target.rotary.max_positions, config.rope_theta, config.rope_scaling
        )
        self.midlayer = Eagle3Layer(config, rotary)
        self.norm = RMSNorm(size, config.rms_norm_eps)
        self.lm_head = nn.Linear(size, draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, size) if own_embedding else None
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    @property
    def rotary(self) -> RotaryEmbedding:
        rotary: RotaryEmbedding = self.midlayer.self_attn.rotary
        return rotary

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.out_features

    def set_vocab_map(self, draft_to_target: torch.Tensor) -> None:
        """Sets d2t and t2d from each draft id's target id ([draft_vocab_size] int64, distinct)."""
        ids = draft_to_target.to(self.d2t.device)
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def target_ids(self) -> torch.Tensor:  # [draft_vocab_size] int64 each draft id's target id
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        # [..., 3 * target hidden_size] -> [..., hidden_size]: g, from the target's three streams
        return linear(self.fc, aux_hidden) if aux_hidden.dim() == 2 else self.fc(aux_hidden)

    @property
    def embedding(self) -> nn.Embedding:
        """The head's own embedding where the checkpoint stores one, else the target's."""
        return self.target.embed_tokens if self.embed_tokens is None else self.embed_tokens

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds: torch.Tensor = self.embedding(input_ids)
        return embeds

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]: t_{i+1}
        positions: torch.Tensor,  # [num_tokens]: i
        hidden: torch.Tensor,  # [num_tokens, hidden_size]: g_i (`project`), or the previous draft's h
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]: h_i, pre-norm
        mlp_out, residual = self.midlayer(positions, self._inputs(input_ids, hidden), hidden, kv_cache, meta)
        return mlp_out + residual

    def forward_with_logits(
        self,
        input_ids: torch.Tensor,  # [num_tokens]: t_{i+1}
        positions: torch.Tensor,  # [num_tokens]: i
        hidden: torch.Tensor,  # [num_tokens, hidden_size]: g_i, or the previous draft's h
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (logits [num_tokens, vocab_size] float32, h_i)
        """`forward` and `logits` of its output at once, as a chained draft needs them: the layer's
        last residual add happens in the final norm's kernel (`add_and_norm`)."""
        mlp_out, residual = self.midlayer(positions, self._inputs(input_ids, hidden), hidden, kv_cache, meta)
        normed, stream = self.norm.add_and_norm(mlp_out, residual)
        return self._target_logits(linear(self.lm_head, normed, torch.float32)), stream

    def _inputs(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        layer = self.midlayer
        return embed_norm_concat(self.embedding, input_ids, layer.input_layernorm, hidden, layer.hidden_norm)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # h [..., hidden_size] -> [..., draft_vocab_size] float32
        normed = self.norm(hidden)
        if normed.dim() == 2:
            return linear(self.lm_head, normed, torch.float32)
        return self.lm_head(normed).float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """h [num_rows, hidden_size] -> [num_rows, vocab_size] float32 over the target's vocabulary:
        -inf where the draft vocabulary has no token (a distribution the verifier can check)."""
        return self._target_logits(self.draft_logits(hidden))

    def _target_logits(self, draft: torch.Tensor) -> torch.Tensor:
        # [num_rows, draft_vocab_size] -> [num_rows, vocab_size] float32, -inf outside the draft vocabulary
        if self.draft_vocab_size == self.config.vocab_size:
            return draft
        full = draft.new_full((draft.shape[0], self.config.vocab_size), float("-inf"))
        return full.index_copy_(1, self.target_ids, draft)


def head_layer_config(raw: dict[str, Any], target: ModelConfig) -> ModelConfig:
    """The config of the head's layer from its config.json: a Llama layer of the head's shape."""
    layer = ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1})
    return dataclasses.replace(
        layer, sliding_windows=(None,), quantization=None, eos_token_ids=target.eos_token_ids
    )


def eagle3_config_dict(head: Eagle3Head) -> dict[str, Any]:
    """The head's config.json, in the public EAGLE-3 layout."""
    config = head.config
    return {
        "architectures": [EAGLE3_ARCHITECTURES[0]],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": head.draft_vocab_size,
        "target_hidden_size": head.target.config.hidden_size,
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(head.aux_layers)},
        "torch_dtype": str(head.fc.weight.dtype).removeprefix("torch."),
    }


def save_eagle3_head(head: Eagle3Head, out_dir: str | Path) -> Path:
    """Writes `config.json` and `model.safetensors` (public EAGLE-3 names) into `out_dir`."""
    return save_head(head, head.config, eagle3_config_dict(head), out_dir)


def load_eagle3_head(
    head_dir: str | Path,
    target: LlamaForCausalLM,
    dtype: torch.dtype,
    device: torch.device,
    aux_layers: tuple[int, ...] | None = None,
) -> Eagle3Head:
    """Loads an EAGLE-3 head (specmesh's or a public release's) for `target`, replicated on every
    rank. `aux_layers`: the target layers it reads; None: the checkpoint's, else EAGLE-3's default."""
    head_dir = Path(head_dir)
    raw = read_eagle3_config(head_dir)
    layers = resolve_aux_layers(raw, target.config, aux_layers, head_dir)
    layer_config = head_layer_config(raw, target.config)
    check_eagle3_config(raw, layer_config, target.config, head_dir)
    tensors = dict(iter_checkpoint_slices(head_dir))
    draft_vocab_size = int(raw.get("draft_vocab_size") or layer_config.vocab_size)
    with torch.device("meta"):
        head = Eagle3Head(target, layer_config, draft_vocab_size, layers, EMBEDDING in tensors).to(dtype)
    head = head.to_empty(device=device)
    head.rotary.build(device)
    weights = ((name, t) for name, t in tensors.items() if name not in VOCAB_MAP_TENSORS)
    load_named_tensors(head, layer_config, weights, str(head_dir))
    head.set_vocab_map(_draft_to_target(tensors, draft_vocab_size, layer_config.vocab_size, head_dir))
    return head.eval()


def read_eagle3_config(head_dir: Path) -> dict[str, Any]:
    return read_config_json(
        head_dir, "an EAGLE-3 head directory (`specmesh train-eagle3` or a public EAGLE-3 release)"
    )


def resolve_aux_layers(
    raw: dict[str, Any], target: ModelConfig, chosen: tuple[int, ...] | None, head_dir: Path
) -> tuple[int, ...]:
    """The target layers the head reads: `chosen`, else the checkpoint's, else EAGLE-3's default;
    refuses a count other than three or a layer the target does not have."""
    stored = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    layers = chosen or (
        tuple(int(i) for i in stored) if stored else default_aux_layers(target.num_hidden_layers)
    )
    if len(layers) != NUM_AUX_LAYERS:
        raise ModelConfigError(
            f"{head_dir}: an EAGLE-3 head reads {NUM_AUX_LAYERS} target layers, not {list(layers)}"
        )
    outside = [i for i in layers if not 0 <= i < target.num_hidden_layers]
    if outside:
        raise ModelConfigError(
            f"eagle3_layers {list(layers)}: the target has layers 0..{target.num_hidden_layers - 1}, not {outside}"
        )
    return tuple(layers)


def check_eagle3_config(raw: dict[str, Any], layer: ModelConfig, target: ModelConfig, head_dir: Path) -> None:
    """Raises ModelConfigError naming every field where the head does not fit the target."""
    architectures = raw.get("architectures") or []
    if not architectures or architectures[0] not in EAGLE3_ARCHITECTURES:
        raise ModelConfigError(
            f"{head_dir} holds architecture {architectures[0] if architectures else None!r}, not an EAGLE-3 "
            f"head ({' or '.join(map(repr, EAGLE3_ARCHITECTURES))}); pass the directory `specmesh train-eagle3` wrote"
        )
    num_layers = int(raw.get("num_hidden_layers", 1))
    if num_layers != 1:
        raise ModelConfigError(
            f"{head_dir}: num_hidden_layers {num_layers} is not supported (one draft layer)"
        )
    draft_vocab_size = int(raw.get("draft_vocab_size") or layer.vocab_size)
    expected = {
        "vocab_size": (layer.vocab_size, target.vocab_size),
        "target_hidden_size": (int(raw.get("target_hidden_size") or layer.hidden_size), target.hidden_size),
        "hidden_size": (layer.hidden_size, target.hidden_size),
    }
    mismatches = [
        f"{field} {have} != target's {want}" for field, (have, want) in expected.items() if have != want
    ]
    if not 1 <= draft_vocab_size <= layer.vocab_size:
        mismatches.append(f"draft_vocab_size {draft_vocab_size} is not in 1..vocab_size {layer.vocab_size}")
    if mismatches:
        raise ModelConfigError(
            f"EAGLE-3 head in {head_dir} does not fit this target model: {'; '.join(mismatches)}"
        )


def _draft_to_target(
    tensors: dict[str, TensorSlices], draft_vocab_size: int, vocab_size: int, head_dir: Path
) -> torch.Tensor:  # [draft_vocab_size] int64
    """Each draft id's target id from the checkpoint's d2t offsets (identity without d2t, which
    only a head over the whole vocabulary may omit)."""
    identity = torch.arange(draft_vocab_size)
    if "d2t" not in tensors:
        if draft_vocab_size != vocab_size:
            raise ModelConfigError(
                f"{head_dir}: draft_vocab_size {draft_vocab_size} < vocab_size needs a d2t tensor"
            )
        return identity
    d2t = tensors["d2t"][...].long()
    if d2t.shape != (draft_vocab_size,):
        raise ModelConfigError(f"{head_dir}: d2t has shape {tuple(d2t.shape)}, not ({draft_vocab_size},)")
    ids = identity + d2t
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or len(ids.unique()) != draft_vocab_size:
        raise ModelConfigError(
            f"{head_dir}: d2t maps draft ids outside 0..{vocab_size - 1} or twice to one id"
        )
    return ids
