"""Which quantization a model's linear layers use: `--quantization`, or a compressed-tensors checkpoint's.

A checkpoint that llm-compressor wrote carries `quantization_config` with `quant_method:
compressed-tensors` in its config.json; specmesh reads the schemes its kernels run (formats in
kernels/quant_ref.py): float8 e4m3 weights with per-channel (or one per-tensor) `weight_scale`
(`float-quantized` / `naive-quantized`), and symmetric int8 / int4 `pack-quantized` weights
(`weight_packed`, `weight_scale`, `weight_shape`; int8 also unpacked as `int-quantized` `weight`)
with per-channel or group-wise scales; activation quantization (W8A8) is not applied: the
activations stay in the model's dtype (fp8 quantizes them per token where it runs on tensor cores).
Every other scheme (zero points, activation ordering, static activation scales, 2:4 sparsity,
quantized KV caches, per-layer exceptions besides the LM head) is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.errors import ModelConfigError

METHODS = ("fp8", "int8", "int4")
DEFAULT_INT4_GROUP_SIZE = 128
COMPRESSED_TENSORS = "compressed-tensors"
FLOAT_FORMATS = ("float-quantized", "naive-quantized")
INT_FORMATS = {4: ("pack-quantized",), 8: ("pack-quantized", "int-quantized", "naive-quantized")}
"""int8 may also be stored unpacked (`weight`, int8), as W8A8 checkpoints are."""


@dataclass(frozen=True)
class QuantScheme:
    """Weight-only (int8, int4) or FP8 quantization of every linear layer but the LM head."""

    method: str
    """fp8, int8 or int4."""
    group_size: int | None = None
    """Input features sharing one scale; None: one scale per output channel (the whole row)."""

    @classmethod
    def default(cls, method: str) -> QuantScheme:
        """What `--quantization METHOD` quantizes a bf16 checkpoint to: fp8 and int8 per channel,
        int4 in groups of 128."""
        if method not in METHODS:
            raise ModelConfigError(
                f"quantization {method!r} is not supported; choose one of {', '.join(METHODS)}"
            )
        return cls(method, DEFAULT_INT4_GROUP_SIZE if method == "int4" else None)

    def __str__(self) -> str:
        return self.method + ("" if self.group_size is None else f" (groups of {self.group_size})")


def resolve_quantization(method: str | None, stored: QuantScheme | None, source: str) -> QuantScheme | None:
    """The scheme a checkpoint loads with: `method` (a quantization flag, None: none asked for)
    against `stored` (the checkpoint's own). A quantized checkpoint keeps its scheme; asking for
    another method is an error."""
    if method is None:
        return stored
    if stored is None:
        return QuantScheme.default(method)
    if stored.method != method:
        raise ModelConfigError(
            f"{source} is already quantized as {stored}; --quantization {method} cannot re-quantize it "
            f"(pass --quantization {stored.method} or leave it out)"
        )
    return stored


def parse_quantization_config(raw: dict[str, Any]) -> QuantScheme:
    """The scheme of a config.json's `quantization_config` (compressed-tensors only)."""
    method = raw.get("quant_method")
    if method != COMPRESSED_TENSORS:
        raise ModelConfigError(
            f"quantization_config quant_method {method!r} is not supported; specmesh loads "
            f"{COMPRESSED_TENSORS!r} checkpoints (fp8, int8, int4) or quantizes at load (--quantization)"
        )
    _refuse_extras(raw)
    groups = raw.get("config_groups") or {}
    if not groups:
        raise ModelConfigError("compressed-tensors quantization_config has no config_groups")
    schemes = {_group_scheme(name, group, raw.get("format")) for name, group in groups.items()}
    if len(schemes) > 1:
        raise ModelConfigError(
            f"compressed-tensors config_groups mix schemes ({', '.join(sorted(map(str, schemes)))}); "
            "specmesh quantizes every linear layer alike"
        )
    return schemes.pop()


def _refuse_extras(raw: dict[str, Any]) -> None:
    if raw.get("kv_cache_scheme"):
        raise ModelConfigError("compressed-tensors kv_cache_scheme (a quantized KV cache) is not supported")
    if raw.get("sparsity_config"):
        raise ModelConfigError("compressed-tensors sparsity_config (sparse weights) is not supported")
    status = raw.get("quantization_status", "compressed")
    if status != "compressed":
        raise ModelConfigError(
            f"compressed-tensors quantization_status {status!r}: only saved `compressed` weights load"
        )
    others = [
        name for name in raw.get("ignore") or [] if not name.endswith("lm_head")
    ]  # "lm_head", "re:.*lm_head"
    if others:
        raise ModelConfigError(
            f"compressed-tensors ignore lists layers besides the LM head ({', '.join(others[:4])}); "
            "specmesh quantizes every linear layer of the decoder alike"
        )


def _group_scheme(name: str, group: dict[str, Any], default_format: str | None) -> QuantScheme:
    where = f"compressed-tensors config group {name!r}"
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise ModelConfigError(
            f'{where} targets {targets}; only ["Linear"] (every linear layer) is supported'
        )
    if group.get("input_activations") and not group["input_activations"].get("dynamic"):
        raise ModelConfigError(f"{where}: static input_activations scales are not supported (dynamic only)")
    if group.get("output_activations"):
        raise ModelConfigError(f"{where}: output_activations quantization is not supported")
    weights = group.get("weights")
    if not weights:
        raise ModelConfigError(f"{where} has no weights scheme")
    return _weights_scheme(where, weights, group.get("format") or default_format)


def _weights_scheme(where: str, weights: dict[str, Any], fmt: str | None) -> QuantScheme:
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    if not weights.get("symmetric", True):
        raise ModelConfigError(f"{where}: asymmetric weights (zero points) are not supported")
    if weights.get("actorder") or weights.get("dynamic"):
        raise ModelConfigError(f"{where}: activation-ordered or dynamic weight scales are not supported")
    if kind == "float" and bits == 8:
        if fmt not in FLOAT_FORMATS:
            raise ModelConfigError(
                f"{where}: fp8 weights in format {fmt!r}; supported: {', '.join(FLOAT_FORMATS)}"
            )
        if strategy not in ("channel", "tensor"):
            raise ModelConfigError(f"{where}: fp8 strategy {strategy!r}; supported: channel, tensor")
        return QuantScheme("fp8")
    if kind == "int" and bits in (4, 8):
        if fmt not in INT_FORMATS[bits]:
            raise ModelConfigError(
                f"{where}: int{bits} weights in format {fmt!r}; supported: {', '.join(INT_FORMATS[bits])}"
            )
        if strategy == "channel":
            return QuantScheme(f"int{bits}")
        if strategy == "group" and isinstance(weights.get("group_size"), int) and weights["group_size"] > 0:
            return QuantScheme(f"int{bits}", weights["group_size"])
        raise ModelConfigError(
            f"{where}: int{bits} strategy {strategy!r} (group size {weights.get('group_size')}); "
            "supported: channel, group with a positive group_size"
        )
    raise ModelConfigError(f"{where}: {kind} weights of {bits} bits are not supported (fp8, int8, int4)")
