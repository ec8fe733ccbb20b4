"""Random-weight checkpoints of real model shapes, in Hugging Face format, for timing benchmarks.

Their timings are real; their outputs are noise, so acceptance is never measured on them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from shared.model.config import ModelConfig
from shared.model.llama import LlamaForCausalLM
from shared.model.loader import unfuse_tensor

SHAPES: dict[str, dict[str, Any]] = {
    "llama-tiny": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",  # transformers' AutoConfig keys on it
        vocab_size=8192,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "qwen2.5-7b": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
    ),
}


def write_random_checkpoint(
    shape: str,
    out_dir: Path,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Writes config.json, model.safetensors and a byte-level tokenizer.json (ids past its
    vocabulary decode to nothing, which is fine for timing). `overrides` replace fields of the shape."""
    raw = {
        **SHAPES[shape],
        **(overrides or {}),
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "eos_token_id": 0,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2))
    config = ModelConfig.from_dict(raw)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions=1)
    tensors = {}
    for name, param in model.named_parameters():
        scale = 1.0 if "norm" in name else 0.02
        value = (
            torch.randn(param.shape, dtype=torch.float32) * scale
            if "norm" not in name
            else torch.ones(param.shape)
        )
        tensors.update(_unfuse(name, value.to(dtype), config))
        del value
    save_file(tensors, str(out_dir / "model.safetensors"))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens([chr(c) for c in range(32, 127)])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    return out_dir


def _unfuse(name: str, value: torch.Tensor, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Checkpoint names (`model.` prefix, q/k/v and gate/up split) for one model parameter."""
    prefix = "" if name.startswith("lm_head") else "model."
    return {prefix + key: tensor for key, tensor in unfuse_tensor(name, value, config).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    write_random_checkpoint(args.shape, args.out_dir, getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
