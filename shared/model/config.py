"""The subset of a Hugging Face `config.json` that the decoder model code needs.

Every supported architecture is the Llama decoder with config-driven differences:
- Qwen2: bias on q/k/v; Qwen3: RMSNorm of each query and key head (`qk_norm`);
- Phi-3: q/k/v and gate/up already fused in the checkpoint (the loader splits them);
- Gemma-2 / Gemma-3: GeGLU (gelu-tanh), RMSNorm weights stored as offsets from 1, the embedding
  scaled by sqrt(hidden_size), norms after attention and MLP outputs too ("sandwich"), tanh
  soft-capping of attention and final logits, a query scale of its own, sliding-window layers
  alternating with global ones; Gemma-3 also norms q/k heads and gives its sliding-window layers a
  RoPE base of their own.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.errors import ModelConfigError
from shared.model.quant_config import QuantScheme, parse_quantization_config

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
_LAYER_TYPES = ("full_attention", "sliding_attention")


def read_config_json(directory: str | Path, expected: str) -> dict[str, Any]:
    """The `config.json` of a model or drafting-head directory; a clear error where it is missing or
    not JSON (`expected`: what the directory should have been, for the message)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{directory} has no config.json; expected {expected}")
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path} is not valid JSON: {exc}") from exc
    return raw


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    """`rope_type` plus its parameters, or None for plain RoPE."""
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_windows: tuple[int | None, ...]
    """Per layer: attention window in tokens, or None for full causal attention."""
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    hidden_act: str = "silu"
    """The MLP's gate activation: `silu` (SwiGLU) or `gelu_pytorch_tanh` (GeGLU)."""
    qk_norm: bool = False
    """RMSNorm over each query and key head before RoPE (Qwen3, Gemma-3)."""
    norm_weight_offset: float = 0.0
    """Added to every RMSNorm weight (Gemma stores `weight - 1`), the product taken in float32."""
    sandwich_norm: bool = False
    """Gemma-2/3: the attention and MLP outputs are normed before the residual add, and the MLP
    input has its own norm (`pre_feedforward_layernorm`)."""
    embedding_multiplier: float | None = None
    """The token embeddings are multiplied by this (Gemma: sqrt(hidden_size)); None: not scaled."""
    query_pre_attn_scalar: float | None = None
    """Attention scale is this ** -0.5 (Gemma); None: head_dim ** -0.5."""
    attn_logit_softcapping: float | None = None
    """Attention scores become cap * tanh(score / cap) before the mask (Gemma-2)."""
    final_logit_softcapping: float | None = None
    """Logits become cap * tanh(logit / cap) (Gemma-2)."""
    local_rope_theta: float | None = None
    """RoPE base of the sliding-window layers where it differs from the global layers' (Gemma-3);
    None: every layer uses `rope_theta` / `rope_scaling`."""
    local_rope_scaling: dict[str, Any] | None = None
    quantization: QuantScheme | None = None
    """The scheme the checkpoint's linear layers are stored in (a compressed-tensors
    `quantization_config`); None: unquantized."""

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        return cls.from_dict(read_config_json(model_dir, "a Hugging Face model directory"))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        architecture = _architecture(raw)
        _refuse_unsupported_fields(raw)
        is_gemma = architecture in GEMMA_ARCHITECTURES
        num_heads = int(raw["num_attention_heads"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
            )
        hidden = int(raw["hidden_size"])
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        num_layers = int(raw["num_hidden_layers"])
        max_positions = int(raw.get("max_position_embeddings", 2048))
        (rope_theta, rope_scaling), local_rope = _ropes(raw, max_positions)
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = bool(raw.get("attention_bias", False))
        return cls(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", is_gemma)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_windows=_sliding_windows(raw, architecture, num_layers),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            eos_token_ids=_as_ids(raw.get("eos_token_id")),
            hidden_act=_activation(raw, is_gemma),
            qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            norm_weight_offset=1.0 if is_gemma else 0.0,
            sandwich_norm=is_gemma,
            embedding_multiplier=math.sqrt(hidden) if is_gemma else None,
            query_pre_attn_scalar=_optional_float(raw, "query_pre_attn_scalar") if is_gemma else None,
            attn_logit_softcapping=_optional_float(raw, "attn_logit_softcapping") if is_gemma else None,
            final_logit_softcapping=_optional_float(raw, "final_logit_softcapping") if is_gemma else None,
            local_rope_theta=None if local_rope is None else local_rope[0],
            local_rope_scaling=None if local_rope is None else local_rope[1],
            quantization=_quantization(raw),
        )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def max_context_len(self) -> int:
        """The longest context the checkpoint covers: `max_position_embeddings`, stretched by a
        YaRN or dynamic-NTK RoPE scaling factor (as vLLM derives it)."""
        scaling = self.rope_scaling
        if scaling is None or scaling["rope_type"] not in ("yarn", "dynamic"):
            return self.max_position_embeddings
        stretched = int(scaling["original_max_position_embeddings"] * scaling["factor"])
        return max(self.max_position_embeddings, stretched)


def _architecture(raw: dict[str, Any]) -> str:
    architectures = raw.get("architectures") or []
    architecture = architectures[0] if architectures else _BY_MODEL_TYPE.get(raw.get("model_type", ""))
    architecture = architecture or str(raw.get("model_type"))
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelConfigError(
            f"architecture {architecture!r} is not supported; specmesh serves "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return architecture


def _quantization(raw: dict[str, Any]) -> QuantScheme | None:
    quantization = raw.get("quantization_config")
    return parse_quantization_config(quantization) if quantization else None


def _refuse_unsupported_fields(raw: dict[str, Any]) -> None:
    """Fields whose non-default value would change the computation in a way the model code lacks."""
    if raw.get("use_bidirectional_attention"):
        raise ModelConfigError("use_bidirectional_attention is not supported (causal decoders only)")
    if float(raw.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ModelConfigError(
            f"partial_rotary_factor {raw['partial_rotary_factor']} is not supported (RoPE over whole heads only)"
        )
    if raw.get("model_type") == "gemma3_text" and raw.get("attn_logit_softcapping") is not None:
        # transformers' Gemma-3 never applies it, and Gemma-3 checkpoints leave it null
        raise ModelConfigError(
            "attn_logit_softcapping is not supported for Gemma-3 (transformers ignores it)"
        )
    unknown = sorted(set(raw.get("layer_types") or ()) - set(_LAYER_TYPES))
    if unknown:
        raise ModelConfigError(
            f"layer_types {unknown} are not supported; supported: {', '.join(_LAYER_TYPES)}"
        )


def _activation(raw: dict[str, Any], is_gemma: bool) -> str:
    # Gemma configs name the MLP activation `hidden_activation` (its `hidden_act` is legacy)
    field = "hidden_activation" if is_gemma and raw.get("hidden_activation") else "hidden_act"
    act = raw.get(field) or ("gelu_pytorch_tanh" if is_gemma else "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ModelConfigError(
            f"{field} {act!r} is not supported; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
        )
    return str(act)


def _optional_float(raw: dict[str, Any], field: str) -> float | None:
    value = raw.get(field)
    if value is None:
        return None
    if not isinstance(value, int | float) or value <= 0:
        raise ModelConfigError(f"{field} must be a positive number or null, not {value!r}")
    return float(value)


Rope = tuple[float, dict[str, Any] | None]
"""(theta, scaling): the RoPE base and its scaling (`rope_type` plus parameters), None: plain."""


def _ropes(raw: dict[str, Any], max_positions: int) -> tuple[Rope, Rope | None]:
    """(global layers' RoPE, sliding-window layers' RoPE or None when the same), read from both the
    transformers<5 (`rope_theta`, `rope_scaling`, Gemma-3's `rope_local_base_freq`) and the
    transformers>=5 (`rope_parameters`, nested by layer type where the types differ) layouts."""
    params = raw.get("rope_parameters") or {}
    if any(key in params for key in _LAYER_TYPES):
        full = _rope(
            {**(raw.get("rope_scaling") or {}), **(params.get("full_attention") or {})}, raw, max_positions
        )
        local = _rope(dict(params.get("sliding_attention") or {}), raw, max_positions)
        return full, (None if local == full else local)
    full = _rope({**(raw.get("rope_scaling") or {}), **params}, raw, max_positions)
    if raw.get("rope_local_base_freq") is not None:
        return full, (float(raw["rope_local_base_freq"]), None)
    return full, None


def _rope(merged: dict[str, Any], raw: dict[str, Any], max_positions: int) -> Rope:
    merged = dict(merged)
    theta = float(merged.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0)
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    partial = float(merged.pop("partial_rotary_factor", None) or 1.0)
    if partial != 1.0:
        raise ModelConfigError(
            f"partial_rotary_factor {partial} is not supported (RoPE over whole heads only)"
        )
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    scaling: dict[str, Any] = {"rope_type": rope_type, **merged}
    if rope_type == "yarn":
        _yarn_defaults(scaling, raw, max_positions)
    elif rope_type == "dynamic":
        # transformers scales past max_position_embeddings, whatever the scaling dict says
        scaling["original_max_position_embeddings"] = max_positions
    _require(scaling, _REQUIRED[rope_type])
    return theta, scaling


_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def _yarn_defaults(scaling: dict[str, Any], raw: dict[str, Any], max_positions: int) -> None:
    """Fills YaRN's optional parameters as transformers does: the pretraining length from the
    top-level `original_max_position_embeddings` first (Phi-3 keeps it there), else the scaling
    dict's, else `max_position_embeddings`; a missing factor is the ratio of the two lengths."""
    original = raw.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
    scaling["original_max_position_embeddings"] = int(original or max_positions)
    if scaling.get("factor") is None:
        scaling["factor"] = max_positions / scaling["original_max_position_embeddings"]


def _require(scaling: dict[str, Any], fields: tuple[str, ...]) -> None:
    for field in fields:
        value = scaling.get(field)
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise ModelConfigError(
                f"rope_scaling.{field} must be a positive number for rope type {scaling['rope_type']!r}, "
                f"not {value!r}"
            )


def _sliding_windows(raw: dict[str, Any], architecture: str, num_layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    uses_flag = architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
    if uses_flag and not raw.get("use_sliding_window", False):
        window = None
    if not window:
        return (None,) * num_layers
    if layer_types:
        if len(layer_types) != num_layers:
            raise ModelConfigError(
                f"layer_types has {len(layer_types)} entries for num_hidden_layers {num_layers}"
            )
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    if uses_flag:
        first_sliding = int(raw.get("max_window_layers", num_layers))
        return tuple(int(window) if i >= first_sliding else None for i in range(num_layers))
    if architecture in GEMMA_ARCHITECTURES:
        # written before `layer_types`: Gemma-2 alternates from a sliding first layer; Gemma-3
        # has one global layer in every `sliding_window_pattern`
        pattern = int(raw.get("sliding_window_pattern", 2 if architecture == "Gemma2ForCausalLM" else 6))
        return tuple(int(window) if (i + 1) % pattern else None for i in range(num_layers))
    return (int(window),) * num_layers


def _as_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    raise ModelConfigError(f"eos_token_id must be an int or a list of ints, not {value!r}")
