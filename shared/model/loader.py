"""Loads a Hugging Face Llama-family checkpoint (single or sharded safetensors) into `LlamaForCausalLM`."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from shared.model.config import ModelConfig, ModelConfigError
from shared.model.llama import LlamaForCausalLM

SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"

_FUSED = {
    # checkpoint projection -> (fused parameter, index of the part inside it)
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_UNFUSED = {
    # fused parameter -> checkpoint projections, in the order they are stacked
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def safetensors_files(model_dir: Path) -> list[Path]:
    if (model_dir / SHARD_INDEX).is_file():
        weight_map = json.loads((model_dir / SHARD_INDEX).read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    raise ModelConfigError(f"{model_dir} has neither {SINGLE_FILE} nor {SHARD_INDEX}")


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def load_model(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device, max_positions: int
) -> LlamaForCausalLM:
    """Builds the model without initialising weights, then fills every parameter from the checkpoint."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    model.rotary.build(device)
    _load_weights(model, model_dir)
    return model.eval()


def _load_weights(model: LlamaForCausalLM, model_dir: Path) -> None:
    ignored = frozenset({"lm_head.weight"}) if model.config.tie_word_embeddings else frozenset()
    load_named_tensors(model, model.config, iter_checkpoint(model_dir), str(model_dir), ignored)


def load_named_tensors(
    module: nn.Module,
    config: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    source: str,
    ignored: frozenset[str] = frozenset(),
) -> None:
    """Fills every parameter of `module` (whose layers are shaped by `config`) from Hugging Face
    named tensors, stacking q/k/v_proj and gate/up_proj into the fused parameters; parameters
    named in `ignored` are neither loaded nor required."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for name, tensor in tensors:
        target, part = _target_name(name)
        if target is None or target in ignored:
            continue
        if target not in params:
            raise ModelConfigError(f"checkpoint tensor {name!r} has no place in the model")
        _copy_into(config, params[target], target, part, tensor)
        loaded.add(target if part is None else f"{target}#{part}")
    missing = sorted(_expected_parts(params) - ignored - loaded)
    if missing:
        raise ModelConfigError(f"checkpoint in {source} is missing weights: {', '.join(missing[:8])}")


def unfused_state_dict(module: nn.Module, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of `load_named_tensors`: `module`'s persistent state under Hugging Face names,
    fused qkv_proj / gate_up_proj split back into q/k/v_proj and gate/up_proj (contiguous copies,
    ready for `safetensors.torch.save_file`)."""
    unfused = {}
    for name, tensor in module.state_dict().items():
        unfused.update(unfuse_tensor(name, tensor.detach().clone(), config))
    return unfused


def unfuse_tensor(name: str, tensor: torch.Tensor, config: ModelConfig) -> dict[str, torch.Tensor]:
    """One parameter under Hugging Face names: a fused qkv_proj / gate_up_proj split into its parts."""
    for fused, projections in _UNFUSED.items():
        marker = f".{fused}."
        if marker in name:
            parts = tensor.split(fused_part_sizes(config, name), dim=0)
            return {
                name.replace(marker, f".{proj}."): part.contiguous() for proj, part in zip(projections, parts)
            }
    return {name: tensor.contiguous()}


def _target_name(name: str) -> tuple[str | None, int | None]:
    """Maps a checkpoint tensor name to (parameter name, part index of a fused parameter)."""
    if "rotary_emb" in name:
        return None, None
    name = name.removeprefix("model.")
    for proj, (fused, part) in _FUSED.items():
        marker = f".{proj}."
        if marker in name:
            return name.replace(marker, f".{fused}."), part
    return name, None


def _copy_into(
    config: ModelConfig, param: torch.nn.Parameter, target: str, part: int | None, tensor: torch.Tensor
) -> None:
    with torch.no_grad():
        if part is None:
            if param.shape != tensor.shape:
                raise ModelConfigError(
                    f"{target}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}"
                )
            param.copy_(tensor)
            return
        sizes = fused_part_sizes(config, target)
        offset = sum(sizes[:part])
        rows = param.narrow(0, offset, sizes[part])
        if rows.shape != tensor.shape:
            raise ModelConfigError(
                f"{target}[{part}]: checkpoint shape {tuple(tensor.shape)} != {tuple(rows.shape)}"
            )
        rows.copy_(tensor)


def fused_part_sizes(config: ModelConfig, target: str) -> list[int]:
    """Row counts of the parts stacked in fused parameter `target`: [q, k, v] or [gate, up]."""
    if ".qkv_proj." in target:
        kv = config.num_key_value_heads * config.head_dim
        return [config.num_attention_heads * config.head_dim, kv, kv]
    return [config.intermediate_size, config.intermediate_size]


def _expected_parts(params: dict[str, torch.nn.Parameter]) -> set[str]:
    # a tied lm_head.weight is absent here: named_parameters() de-duplicates it under embed_tokens.weight
    expected = set()
    for name in params:
        if ".qkv_proj." in name:
            expected |= {f"{name}#{i}" for i in range(3)}
        elif ".gate_up_proj." in name:
            expected |= {f"{name}#{i}" for i in range(2)}
        else:
            expected.add(name)
    return expected
