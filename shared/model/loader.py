"""Loads a Hugging Face Llama-family checkpoint (single or sharded safetensors) into `LlamaForCausalLM`.

Checkpoints store q/k/v_proj and gate/up_proj apart (Llama) or already fused (Phi-3: qkv_proj,
gate_up_proj); either way each part lands in its rows of the model's fused parameter.

Under tensor parallelism each rank reads only its slices of the checkpoint (`safe_open(...).get_slice`,
shared/model/parallel.py `parameter_shard`), never a whole matrix it would then cut, except to
quantize it at load (shared/model/quantization.py: scales span whole rows).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from kernels.quant_ref import pack_int32
from shared.model.config import ModelConfig, ModelConfigError
from shared.model.llama import LlamaForCausalLM
from shared.model.parallel import (
    SINGLE,
    Shard,
    TensorParallel,
    num_local_heads,
    num_local_kv_heads,
    parameter_shard,
)
from shared.model.quant_config import resolve_quantization
from shared.model.quantization import (
    SCALE_NAME,
    SKIPPED_SUFFIXES,
    QuantizedLinear,
    base_weight_name,
    is_unquantized_weight,
    quantize_checkpoint_weight,
    quantize_linears,
    quantized_layers,
    repack_layers,
    stored_shard,
)

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


class TensorSlices(Protocol):
    """A tensor that is read slice by slice: safetensors' `PySafeSlice`, or `InMemory`."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


SLICE_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I8": torch.int8,
}
"""safetensors' names of the dtypes a checkpoint weight may need converting from."""


def slice_dtype(tensor: TensorSlices) -> torch.dtype | None:
    """The dtype of an `InMemory` tensor or of a safetensors slice of `SLICE_DTYPES`; None for
    any other stored dtype."""
    if isinstance(tensor, InMemory):
        return tensor.tensor.dtype
    get_dtype = getattr(tensor, "get_dtype", None)
    return SLICE_DTYPES.get(get_dtype()) if get_dtype else None


class InMemory:
    """A tensor already in memory, read through the `TensorSlices` interface."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[index]


class RowsOf:
    """Rows [start, start + num_rows) of a `TensorSlices`, itself read as one: a part of a fused
    checkpoint tensor, read without the rest."""

    def __init__(self, whole: TensorSlices, start: int, num_rows: int):
        self.whole, self.start, self.num_rows = whole, start, num_rows

    def get_shape(self) -> list[int]:
        return [self.num_rows, *self.whole.get_shape()[1:]]

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows = slice(self.start, self.start + self.num_rows)
        if index is Ellipsis:
            return self.whole[rows]
        if isinstance(index, slice) and index.step is None:
            first, stop, _ = index.indices(self.num_rows)
            return self.whole[self.start + first : self.start + stop]
        raise TypeError(f"RowsOf reads whole rows only, not {index!r}")


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def iter_checkpoint_slices(model_dir: Path) -> Iterator[tuple[str, TensorSlices]]:
    """Every tensor of the checkpoint, unread: the loader reads the slices it needs."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_slice(name)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    tp: TensorParallel = SINGLE,
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """Builds the model without initialising weights, then fills every parameter from the
    checkpoint (rank `tp.rank`'s slices of it). `quantization` (fp8, int8, int4): quantize the
    linear layers at load, or check a quantized checkpoint's method; None: as the checkpoint is."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    scheme = resolve_quantization(quantization, config.quantization, str(model_dir))
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions, tp).to(dtype)
        if scheme is not None:
            quantize_linears(model, scheme, str(model_dir))
    model = model.to_empty(device=device)
    model.tie_weights()
    model.build_rotary(device)
    _load_weights(model, model_dir)
    return model.eval()


def _load_weights(model: LlamaForCausalLM, model_dir: Path) -> None:
    ignored = frozenset({"lm_head.weight"}) if model.config.tie_word_embeddings else frozenset()
    slices = iter_checkpoint_slices(model_dir)
    load_named_tensors(model, model.config, slices, str(model_dir), ignored, model.tp)


def load_named_tensors(
    module: nn.Module,
    config: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor | TensorSlices]],
    source: str,
    ignored: frozenset[str] = frozenset(),
    tp: TensorParallel = SINGLE,
) -> None:
    """Fills every parameter of `module` (whose layers are shaped by `config`, split as rank
    `tp.rank` holds them) from Hugging Face named tensors, stacking q/k/v_proj and gate/up_proj
    into the fused parameters and reading only the rank's slice of each; parameters named in
    `ignored` are neither loaded nor required. Quantized layers take a quantized checkpoint's
    tensors by name, or quantize an unquantized checkpoint's weights; on a GPU each int8 / int4 layer
    then also keeps its weight in its kernel's tile layout (`repack_layers`)."""
    params = dict(module.named_parameters())
    layers = quantized_layers(module)
    loaded: set[str] = set()
    for name, tensor in tensors:
        target, part = _target_name(name)
        if target is None or target in ignored or name.endswith(SKIPPED_SUFFIXES):
            continue
        slices = InMemory(tensor) if isinstance(tensor, torch.Tensor) else tensor
        for stored_name, stored in _as_stored(target, slices, layers):
            if stored_name not in params:
                raise ModelConfigError(f"checkpoint tensor {name!r} has no place in the model")
            for part_index, part_slices in _parts(config, name, stored_name, part, stored):
                _copy_into(config, params[stored_name], stored_name, part_index, part_slices, tp)
                loaded.add(stored_name if part_index is None else f"{stored_name}#{part_index}")
    missing = sorted(_expected_parts(params) - ignored - loaded)
    if missing:
        raise ModelConfigError(f"checkpoint in {source} is missing weights: {', '.join(missing[:8])}")
    repack_layers(module)


def unfused_state_dict(module: nn.Module, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of `load_named_tensors`: `module`'s persistent state under Hugging Face names,
    fused qkv_proj / gate_up_proj split back into q/k/v_proj and gate/up_proj (contiguous copies,
    ready for `safetensors.torch.save_file`)."""
    unfused = {}
    for name, tensor in module.state_dict().items():
        unfused.update(unfuse_tensor(name, tensor.detach().clone(), config))
    return unfused


def save_head(head: nn.Module, config: ModelConfig, config_json: dict[str, Any], out_dir: str | Path) -> Path:
    """Writes a drafting head's `config.json` and its weights (unfused Hugging Face names) as one
    `model.safetensors` into `out_dir` (created if needed)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    tensors = {name: t.cpu() for name, t in unfused_state_dict(head, config).items()}
    save_file(tensors, str(out_dir / SINGLE_FILE), metadata={"format": "pt"})
    return out_dir


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


def _as_stored(
    target: str, tensor: TensorSlices, layers: dict[str, QuantizedLinear]
) -> list[tuple[str, TensorSlices]]:
    """(parameter name, tensor) pairs a checkpoint tensor fills: itself, the quantized weight and
    scale of a quantized layer's unquantized weight (the whole matrix, quantized here), or an int8
    layer's unpacked `weight` packed as the layer stores it."""
    layer = layers.get(target.removesuffix(".weight"))
    dtype = slice_dtype(tensor)
    if layer is None or dtype is None or not target.endswith(".weight"):
        return [(target, tensor)]
    if dtype == torch.int8 and layer.scheme.method == "int8":
        return [(f"{target}_packed", InMemory(pack_int32(tensor[...], 8)))]
    if not is_unquantized_weight(target, dtype):
        return [(target, tensor)]
    return [(name, InMemory(t)) for name, t in quantize_checkpoint_weight(target, tensor[...], layer)]


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


def _parts(
    config: ModelConfig, name: str, target: str, part: int | None, tensor: TensorSlices
) -> Iterator[tuple[int | None, TensorSlices]]:
    """(part index, its rows) of a checkpoint tensor: itself, or each part of one stored fused."""
    if part is not None or not any(f".{fused}." in target for fused in _UNFUSED):
        yield part, tensor
        return
    sizes = fused_part_sizes(config, target)
    if tensor.get_shape()[0] != sum(sizes):
        raise ModelConfigError(
            f"{name}: checkpoint shape {tuple(tensor.get_shape())} has {tensor.get_shape()[0]} rows, "
            f"not the {' + '.join(map(str, sizes))} of its fused parts"
        )
    for index, size in enumerate(sizes):
        yield index, RowsOf(tensor, sum(sizes[:index]), size)


def _copy_into(
    config: ModelConfig,
    param: torch.nn.Parameter,
    target: str,
    part: int | None,
    tensor: TensorSlices,
    tp: TensorParallel,
) -> None:
    """Reads the rank's slice of `tensor` into `param` (or its part of a fused parameter); rows
    past the checkpoint's (the last vocabulary shard's padding) are zeroed."""
    label = target if part is None else f"{target}[{part}]"
    local: torch.Tensor = param
    if part is not None:
        sizes = fused_part_sizes(config, target, tp)
        local = param.narrow(0, sum(sizes[:part]), sizes[part])
    shard = parameter_shard(base_weight_name(target), part, config, tp)
    if target.endswith(SCALE_NAME):
        whole_rows = shard.total if shard is not None and shard.dim == 0 else local.shape[0]
        tensor = broadcast_scale(tensor, whole_rows)
    if shard is not None and base_weight_name(target) != target:
        shard = stored_shard(shard, tensor.get_shape()[1], label)
    expected = list(local.shape) if shard is None else _whole_shape(local, shard)
    if tensor.get_shape() != expected:
        raise ModelConfigError(f"{label}: checkpoint shape {tuple(tensor.get_shape())} != {tuple(expected)}")
    with torch.no_grad():
        if shard is None:
            local.copy_(tensor[...])
            return
        index = slice(shard.start, shard.start + shard.length)
        local.narrow(shard.dim, 0, shard.length).copy_(tensor[index] if shard.dim == 0 else tensor[:, index])
        local.narrow(shard.dim, shard.length, local.shape[shard.dim] - shard.length).zero_()


def broadcast_scale(scale: TensorSlices, whole_rows: int) -> TensorSlices:
    """A per-tensor scale (one value) as the per-channel [whole_rows, 1] a quantized layer holds
    (the whole checkpoint tensor's rows, before a rank takes its slice); other scales unchanged."""
    if math.prod(scale.get_shape()) != 1:
        return scale
    return InMemory(scale[...].reshape(1, 1).expand(whole_rows, 1))


def _whole_shape(local: torch.Tensor, shard: Shard) -> list[int]:
    shape = list(local.shape)
    shape[shard.dim] = shard.total
    return shape


def fused_part_sizes(config: ModelConfig, target: str, tp: TensorParallel = SINGLE) -> list[int]:
    """Row counts of the parts stacked in fused parameter `target` (rank `tp.rank`'s share):
    [q, k, v] or [gate, up]."""
    if ".qkv_proj." in target:
        kv = num_local_kv_heads(config, tp) * config.head_dim
        return [num_local_heads(config, tp) * config.head_dim, kv, kv]
    return [config.intermediate_size // tp.size] * 2


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
