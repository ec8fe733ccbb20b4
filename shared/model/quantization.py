"""Quantized linear layers: the modules, and how checkpoint tensors fill them.

Every linear layer of the decoder (and of an MTP head or a draft model) becomes a `QuantizedLinear`
holding its weight as compressed-tensors stores it (kernels/quant_ref.py): `weight` (fp8) or
`weight_packed` (int8 / int4), and `weight_scale`. The embeddings and the LM head keep the model's
dtype. A checkpoint already quantized fills them by name; an unquantized one is quantized at load,
each matrix whole (its scales span whole rows) before the rank's slice of it is taken, so a
quantized-at-load model equals one loaded from the same weights saved quantized, on any number of
ranks. Once loaded on a GPU, each int8 / int4 layer also keeps its weight in the tile layout its
tensor-core kernel reads (`repack_layers`, kernels/quant_tiled_ref.py); the stored tensors stay as
loaded (saving, sharding and the CPU path read them).

Under tensor parallelism stored weights split along the dims the unquantized ones do
(shared/model/parallel.py); their scales split with them: by rows with the rows, by input features
group by group (a rank's features must hold whole groups), and a per-channel scale of a
row-parallel layer (one column, the whole row's) is replicated.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from kernels.quant_ref import FP8_DTYPE, check_group_size, packed_width, quantize_weight_ref
from kernels.quant_tiled_ref import TiledWeight, check_tileable, repack_tiles
from shared.errors import ModelConfigError
from shared.model.parallel import Shard
from shared.model.quant_config import QuantScheme

STORED_WEIGHT_NAMES = ("weight", "weight_packed")
SCALE_NAME = "weight_scale"
SKIPPED_SUFFIXES = (".weight_shape",)
"""Checkpoint tensors the layers do not keep (their shapes are the model's)."""
UNQUANTIZED_LINEARS = ("lm_head",)


class QuantizedLinear(nn.Module):
    """`nn.Linear` with a quantized weight: y = x @ dequantize(weight).T + bias."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, scheme: QuantScheme, dtype: torch.dtype
    ):
        """`dtype`: the bias's (the model's) dtype; raises ValueError for a group size that does
        not tile `in_features`."""
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        group_size = scheme.group_size or in_features
        check_group_size(scheme.method, in_features, group_size)
        storage = FP8_DTYPE if scheme.method == "fp8" else torch.int32
        self.stored_name = "weight" if scheme.method == "fp8" else "weight_packed"
        width = packed_width(scheme.method, in_features)
        self.register_parameter(
            self.stored_name,
            nn.Parameter(torch.empty(out_features, width, dtype=storage), requires_grad=False),
        )
        num_groups = in_features // group_size
        self.weight_scale = nn.Parameter(
            torch.empty(out_features, num_groups, dtype=torch.float32), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.tiled: TiledWeight | None = None

    @property
    def qweight(self) -> torch.Tensor:
        # fp8 [out_features, in_features] or int32 [out_features, in_features * bits / 32]
        stored: torch.Tensor = getattr(self, self.stored_name)
        return stored

    def matmul(
        self, x: torch.Tensor, with_bias: bool = True, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        rows = x.reshape(-1, self.in_features)
        bias = self.bias if with_bias else None
        out = kernels.quant_linear(
            rows, self.qweight, self.weight_scale, self.scheme.method, bias, out_dtype, self.tiled
        )
        return out.view(*x.shape[:-1], self.out_features)

    def tileable(self) -> bool:
        """True when the weight fits the tile layout: int8 / int4 on a CUDA device, groups of whole
        tiles or one scale per output (kernels/quant_tiled_ref.py, `check_tileable`)."""
        if self.scheme.method not in ("int8", "int4") or not self.weight_scale.is_cuda:
            return False
        try:
            check_tileable(self.scheme.method, self.out_features, self.in_features, self.group_size)
        except ValueError:
            return False
        return True

    def repack(self) -> None:
        """Keeps the loaded weight also in the tile layout (made again if it was made before)."""
        self.tiled = repack_tiles(self.qweight, self.weight_scale, self.scheme.method)

    @property
    def group_size(self) -> int:
        return self.in_features // self.weight_scale.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"


def quantize_linears(module: nn.Module, scheme: QuantScheme, source: str) -> None:
    """Replaces every `nn.Linear` of `module` but the LM head with a `QuantizedLinear` of the same
    shape (on the same device, typically meta before the weights load); `source` (the checkpoint)
    names the model in errors."""
    for name, child in list(module.named_modules()):
        if not isinstance(child, nn.Linear) or name.rsplit(".", 1)[-1] in UNQUANTIZED_LINEARS:
            continue
        try:
            with torch.device(child.weight.device):
                layer = QuantizedLinear(
                    child.in_features, child.out_features, child.bias is not None, scheme, child.weight.dtype
                )
        except ValueError as exc:
            raise ModelConfigError(f"{source}: {name} cannot be quantized as {scheme}: {exc}") from exc
        parent_name, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent_name) if parent_name else module, attr, layer)


def repack_layers(module: nn.Module) -> None:
    """Makes the tile layout of every loaded `QuantizedLinear` of `module` that fits it."""
    for layer in quantized_layers(module).values():
        if layer.tileable():
            layer.repack()


def quantized_layers(module: nn.Module) -> dict[str, QuantizedLinear]:
    """Every `QuantizedLinear` of `module` by its module name."""
    return {name: m for name, m in module.named_modules() if isinstance(m, QuantizedLinear)}


def quantize_checkpoint_weight(
    name: str, weight: torch.Tensor, layer: QuantizedLinear
) -> list[tuple[str, torch.Tensor]]:
    """An unquantized checkpoint matrix `name` (`...proj.weight`, read whole) as the named tensors
    a quantized checkpoint stores for it, quantized on `layer`'s device."""
    device = layer.weight_scale.device
    group_size = layer.scheme.group_size or weight.shape[1]
    try:
        qweight, scale = quantize_weight_ref(weight.to(device), layer.scheme.method, group_size)
    except ValueError as exc:
        raise ModelConfigError(f"{name} cannot be quantized as {layer.scheme}: {exc}") from exc
    prefix = name.removesuffix(".weight")
    return [(f"{prefix}.{layer.stored_name}", qweight), (f"{prefix}.{SCALE_NAME}", scale)]


def is_unquantized_weight(name: str, tensor_dtype: torch.dtype) -> bool:
    """True for a floating `.weight` a quantized layer must quantize (not a stored fp8 weight)."""
    return name.endswith(".weight") and tensor_dtype.is_floating_point and tensor_dtype != FP8_DTYPE


def base_weight_name(target: str) -> str:
    """`...proj.weight` for a layer's stored weight or scale (what decides how it shards)."""
    for suffix in ("weight_packed", SCALE_NAME):
        if target.endswith("." + suffix):
            return target.removesuffix(suffix) + "weight"
    return target


def stored_shard(shard: Shard, stored_cols: int, target: str) -> Shard | None:
    """The rank's slice of a stored weight or scale with `stored_cols` columns, from the unquantized
    weight's `shard`: rows unchanged; input features in packed words or groups (whole ones only);
    None for a one-column per-channel scale of a row-parallel layer (replicated)."""
    if shard.dim == 0 or stored_cols == shard.total:
        return shard
    if stored_cols == 1:
        return None
    per_col = shard.total // stored_cols
    if shard.total % stored_cols or shard.start % per_col or shard.length % per_col:
        raise ModelConfigError(
            f"{target}: the rank's {shard.length} input features do not hold whole groups of {per_col}; "
            "choose a tensor-parallel size that splits the layer into whole quantization groups"
        )
    return Shard(1, shard.start // per_col, shard.length // per_col, stored_cols)
