"""Widened targets: a small trained checkpoint grown to a big model's shape, computing the same function.

A widened target has the layer count, widths and heads (so the weight bytes and FLOPs per token)
of a big model such as Llama-3.2-1B or Qwen2.5-7B, and the logits of the small model it was grown
from (up to rounding), so a speculation benchmark on it times a big target while measuring the
small model's real draft acceptance (n-gram, suffix, its MTP and EAGLE-3 heads, widened the same
way: each head's layer gets the big model's shape).

It is not a big model: its text and acceptance are the small model's; it keeps the small
vocabulary, so its LM head is far smaller than the real model's; every weight that writes into the
residual stream (o_proj, down_proj, the MTP head's eh_proj, the EAGLE-3 head's fc) is zero outside
the small model's block, and the extra layers (appended after the original ones) write nothing. Weights that only
read the stream are random where they meet its extra, always-zero dims.

The source's H dims lead the residual stream; a norm over H' dims sees (H/H') times the mean
square, undone by eps' = eps * H / H' and gains * sqrt(H / H'). Source query heads keep their kv
head (head h goes to (h // g) * g' + h % g); a wider head keeps RoPE's frequencies with
rope_theta' = theta ** (d'/d), zero query weights in its new dims, and queries scaled by
sqrt(d'/d) to undo the attention scale. Exact in real arithmetic; rounded once to --dtype.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from benchmarks.random_model import SHAPES
from shared.errors import ModelConfigError
from shared.model.config import ModelConfig
from shared.model.eagle3 import (
    VOCAB_MAP_TENSORS,
    Eagle3Head,
    check_eagle3_config,
    head_layer_config,
    read_eagle3_config,
)
from shared.model.llama import LlamaForCausalLM
from shared.model.loader import SHARD_INDEX, SINGLE_FILE, iter_checkpoint, unfused_state_dict
from shared.model.mtp import MTPHead, check_mtp_config, mtp_config_dict, read_mtp_config

MAX_SHARD_BYTES = 5 * 10**9
"""Hugging Face's default shard size."""
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)
"""Files copied unchanged from the source model directory, where present."""
SHAPE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


@dataclass(frozen=True)
class Shape:
    """The dimensions of a widened model; vocabulary, RoPE base and eps follow from the source."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int

    @classmethod
    def preset(cls, name: str) -> Shape:
        """A shape of `benchmarks.random_model.SHAPES` (its vocabulary, RoPE and biases are not used)."""
        if name not in SHAPES:
            raise ModelConfigError(f"unknown shape {name!r}; known shapes: {', '.join(sorted(SHAPES))}")
        raw = SHAPES[name]
        fields = {field: raw[field] for field in SHAPE_FIELDS if field in raw}
        fields.setdefault("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
        return cls(**fields)

    @classmethod
    def of(cls, config: ModelConfig) -> Shape:
        return cls(**{field: getattr(config, field) for field in SHAPE_FIELDS})

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads


@dataclass(frozen=True)
class WidenResult:
    target_dir: Path
    mtp_dir: Path | None
    target_bytes_per_step: int
    """Weight bytes a decode step of the target reads (`weight_bytes_per_step`)."""
    mtp_bytes_per_step: int | None
    """Weight bytes one draft step of the MTP head reads: its own weights plus the target's LM head."""
    eagle3_dir: Path | None = None


def check_widening(source: ModelConfig, shape: Shape) -> None:
    """Raises ModelConfigError naming every reason `source` cannot be widened to `shape`."""
    problems = [
        f"{field} {getattr(shape, field)} < the source's {getattr(source, field)}"
        for field in SHAPE_FIELDS
        if getattr(shape, field) < getattr(source, field)
    ]
    if shape.num_attention_heads % shape.num_key_value_heads:
        problems.append(
            f"num_attention_heads {shape.num_attention_heads} is not a multiple of "
            f"num_key_value_heads {shape.num_key_value_heads}"
        )
    elif shape.num_queries_per_kv < source.num_queries_per_kv:
        problems.append(
            f"{shape.num_queries_per_kv} query heads per kv head < the source's {source.num_queries_per_kv}"
        )
    if shape.head_dim % 2:
        problems.append(f"head_dim {shape.head_dim} is odd (RoPE pairs dims)")
    if source.qkv_bias or source.o_bias or source.mlp_bias:
        problems.append("the source has biases (only bias-free Llama sources are supported)")
    if source.rope_scaling is not None:
        problems.append(f"the source has rope_scaling {source.rope_scaling} (only plain RoPE is supported)")
    if any(window is not None for window in source.sliding_windows):
        problems.append("the source has sliding-window layers")
    if problems:
        raise ModelConfigError(f"cannot widen this source to the requested shape: {'; '.join(problems)}")


def widened_config(source_raw: dict[str, Any], shape: Shape, dtype: torch.dtype) -> dict[str, Any]:
    """The widened target's config.json: the source's, with the new shape and the eps and RoPE base
    that keep its function."""
    source = ModelConfig.from_dict(source_raw)
    dropped = {"rope_parameters", "dtype", "sliding_window", "layer_types", "use_sliding_window"}
    raw = {key: value for key, value in source_raw.items() if key not in dropped}
    raw.update({field: getattr(shape, field) for field in SHAPE_FIELDS})
    raw.update(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        rms_norm_eps=source.rms_norm_eps * source.hidden_size / shape.hidden_size,
        rope_theta=source.rope_theta ** (shape.head_dim / source.head_dim),
        rope_scaling=None,
        attention_bias=False,
        mlp_bias=False,
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    return raw


class Widener:
    """Builds each widened tensor (float32, on `device`) from the source's; see the module docstring."""

    def __init__(
        self,
        source: ModelConfig,
        shape: Shape,
        tensors: dict[str, torch.Tensor],  # the source's, Hugging Face names
        seed: int,
        device: torch.device,
    ):
        self.source, self.shape, self.device = source, shape, device
        self.tensors = {name: t.to(device, torch.float32) for name, t in tensors.items()}
        self.generator = torch.Generator(device).manual_seed(seed)
        self.norm_scale = math.sqrt(source.hidden_size / shape.hidden_size)
        self.query_scale = math.sqrt(shape.head_dim / source.head_dim)
        self.query_rows = self._head_rows(self._query_heads())  # [num_heads * head_dim]
        self.kv_rows = self._head_rows(torch.arange(source.num_key_value_heads))  # [num_kv_heads * head_dim]
        used = self._query_heads()[:, None] * shape.head_dim + torch.arange(shape.head_dim)
        self.used_query_rows = used.flatten().to(device)  # every row of the heads the source's go to

    def target_tensor(self, name: str) -> torch.Tensor:
        """The widened target's tensor `name` (a Hugging Face name)."""
        key = name.removeprefix("model.")
        if key == "embed_tokens.weight":
            return self._embedding(self.tensors[name])
        if key == "norm.weight":
            return self._norm(self.tensors[name])
        if key == "lm_head.weight":  # untied: it only reads the final norm's output
            source = self.tensors[name]
            return self._reader(source, self.source.vocab_size, self.shape.hidden_size, float(source.std()))
        _, index, rest = key.split(".", 2)  # layers.{index}.{rest}
        return self._layer_tensor(rest, int(index))

    def mtp_tensor(self, name: str) -> torch.Tensor:
        """The widened MTP head's tensor `name`; `self.tensors` holds the source head's."""
        if name in ("enorm.weight", "hnorm.weight"):
            return self._norm(self.tensors[name])
        if name == "eh_proj.weight":
            return self._eh_proj(self.tensors[name])
        source = self.tensors[name]
        return self._projection(name.split(".")[-2], source, source)

    def eagle3_tensor(self, name: str) -> torch.Tensor:
        """The widened EAGLE-3 head's tensor `name` (its layer gets the target's shape); `self.tensors`
        holds the source head's."""
        source = self.tensors[name]
        if name in VOCAB_MAP_TENSORS:  # draft ids -> target ids: the vocabulary is unchanged
            return source.bool() if name == "t2d" else source.long()
        if name == "fc.weight":
            return self._fc(source)
        if name == "lm_head.weight":  # scores the draft vocabulary from the head's final norm
            return self._reader(source, source.shape[0], self.shape.hidden_size, float(source.std()))
        if name == "embed_tokens.weight":
            return self._embedding(source)
        kind = name.split(".")[-2]
        if name.endswith("norm.weight"):
            return self._norm(source)
        if kind in ("q_proj", "k_proj", "v_proj"):  # over [normed embedding | normed features]
            half = self.source.hidden_size
            halves = (source[:, :half], source[:, half:])
            widen_half = self._query if kind == "q_proj" else self._key_value
            return torch.cat([widen_half(part, float(source.std())) for part in halves], dim=1)
        return self._projection(kind, source, source)

    def _layer_tensor(self, rest: str, index: int) -> torch.Tensor:
        """A target layer's tensor; layers past the source's are new (random readers, zero writers)
        with the scale of the source layer `index % num_layers`."""
        source = self.tensors.get(f"model.layers.{index}.{rest}")
        reference = self.tensors[f"model.layers.{index % self.source.num_hidden_layers}.{rest}"]
        return self._projection(rest.split(".")[-2], source, reference)

    def _projection(self, kind: str, source: torch.Tensor | None, reference: torch.Tensor) -> torch.Tensor:
        """One layer tensor of `kind` (q_proj, input_layernorm, ...) widened from `source`, or new
        (`source` None) with random values as spread as `reference`."""
        shape, std = self.shape, float(reference.std())
        if kind.endswith("layernorm"):
            return self._norm(source)
        if kind == "q_proj":
            return self._query(source, std)
        if kind in ("k_proj", "v_proj"):
            return self._key_value(source, std)
        if kind == "o_proj":
            return self._writer(
                source, shape.hidden_size, shape.num_attention_heads * shape.head_dim, self.query_rows
            )
        if kind in ("gate_proj", "up_proj"):
            return self._reader(source, shape.intermediate_size, shape.hidden_size, std)
        if kind == "down_proj":
            return self._writer(source, shape.hidden_size, shape.intermediate_size)
        raise ModelConfigError(f"no widening rule for a {kind!r} tensor")

    def _norm(self, source: torch.Tensor | None) -> torch.Tensor:
        """Gains over H' dims; the source's scaled by sqrt(H / H'), 1 on dims whose input is zero."""
        gains = torch.ones(self.shape.hidden_size, device=self.device)
        if source is not None:
            gains[: len(source)] = source * self.norm_scale
        return gains

    def _reader(self, source: torch.Tensor | None, num_rows: int, num_cols: int, std: float) -> torch.Tensor:
        """A weight that reads the residual stream: the source in its top-left block, random elsewhere
        (its extra columns meet zeros; its extra rows feed units or heads nobody reads)."""
        weight = self._random((num_rows, num_cols), std)
        if source is not None:
            weight[: source.shape[0], : source.shape[1]] = source
        return weight

    def _writer(
        self,
        source: torch.Tensor | None,
        num_rows: int,
        num_cols: int,
        cols: torch.Tensor | None = None,  # the new column of each source column; None: the first ones
    ) -> torch.Tensor:
        """A weight that writes into the residual stream: zero but for the source's block, so the
        stream's extra dims stay zero and new heads, units and layers add nothing."""
        weight = torch.zeros(num_rows, num_cols, device=self.device)
        if source is not None and cols is None:
            weight[: source.shape[0], : source.shape[1]] = source
        elif source is not None:
            weight[: source.shape[0], cols] = source
        return weight

    def _random(self, size: tuple[int, int], std: float) -> torch.Tensor:
        # random rather than zero where the value does not matter: zero weights can run faster on GPUs
        return torch.empty(size, device=self.device).normal_(0.0, std, generator=self.generator)

    def _embedding(self, source: torch.Tensor) -> torch.Tensor:
        # it starts the residual stream (and is the tied LM head): zero past the source's H columns
        weight = torch.zeros(self.source.vocab_size, self.shape.hidden_size, device=self.device)
        weight[:, : source.shape[1]] = source
        return weight

    def _query(self, source: torch.Tensor | None, std: float) -> torch.Tensor:
        shape = self.shape
        weight = self._random((shape.num_attention_heads * shape.head_dim, shape.hidden_size), std)
        if source is not None:
            # a query must be exactly zero in the new dims of a used head (its key there is random)
            weight[self.used_query_rows, : source.shape[1]] = 0.0
            weight[self.query_rows, : source.shape[1]] = source * self.query_scale
        return weight

    def _key_value(self, source: torch.Tensor | None, std: float) -> torch.Tensor:
        shape = self.shape
        weight = self._random((shape.num_key_value_heads * shape.head_dim, shape.hidden_size), std)
        if source is not None:
            weight[self.kv_rows, : source.shape[1]] = source
        return weight

    def _eh_proj(self, source: torch.Tensor) -> torch.Tensor:
        # [H', 2H'] over concat(enorm(embed), hnorm(hidden)): each half's source block at its start
        hidden, new_hidden = self.source.hidden_size, self.shape.hidden_size
        weight = self._random((new_hidden, 2 * new_hidden), float(source.std()))
        weight[hidden:] = 0.0  # it writes the MTP layer's residual stream
        weight[:hidden, :hidden] = source[:, :hidden]
        weight[:hidden, new_hidden : new_hidden + hidden] = source[:, hidden:]
        return weight

    def _fc(self, source: torch.Tensor) -> torch.Tensor:
        # [H', n * H'] over the target's n streams, writing the head's stream: each stream's source
        # block at its start, zero elsewhere
        hidden, new_hidden = self.source.hidden_size, self.shape.hidden_size
        num_streams = source.shape[1] // hidden
        weight = torch.zeros(new_hidden, num_streams * new_hidden, device=self.device)
        for stream in range(num_streams):
            start = stream * new_hidden
            weight[:hidden, start : start + hidden] = source[:, stream * hidden : (stream + 1) * hidden]
        return weight

    def _query_heads(self) -> torch.Tensor:
        """The new query head of each source query head: same kv head, same place in its group."""
        group, new_group = self.source.num_queries_per_kv, self.shape.num_queries_per_kv
        heads = torch.arange(self.source.num_attention_heads)
        return (heads // group) * new_group + heads % group

    def _head_rows(self, new_heads: torch.Tensor) -> torch.Tensor:
        """The new row of each source q/k/v row, given each source head's new head. RoPE pairs dim
        i with i + head_dim / 2 (Hugging Face's half-split layout): each half keeps its place at
        the start of its new half, so a pair keeps its frequency under rope_theta'."""
        dim, new_dim = self.source.head_dim, self.shape.head_dim
        dims = torch.arange(dim)
        new_dims = torch.where(dims < dim // 2, dims, dims - dim // 2 + new_dim // 2)
        return (new_heads[:, None] * new_dim + new_dims).flatten().to(self.device)


def widen(
    model_dir: Path,
    mtp_dir: Path | None,
    shape: Shape,
    out_dir: Path,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    device: torch.device | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    eagle3_dir: Path | None = None,
) -> WidenResult:
    """Writes out_dir/target (out_dir/mtp when `mtp_dir` is given, out_dir/eagle3 when `eagle3_dir`
    is); refuses existing ones."""
    device = device or torch.device("cpu")
    source = ModelConfig.from_dir(model_dir)
    check_widening(source, shape)
    if mtp_dir is not None:
        check_mtp_config(read_mtp_config(mtp_dir), source, mtp_dir)
    if eagle3_dir is not None:
        eagle3_raw = read_eagle3_config(eagle3_dir)
        eagle3_layer = head_layer_config(eagle3_raw, source)
        check_eagle3_config(eagle3_raw, eagle3_layer, source, eagle3_dir)
        check_widening(eagle3_layer, shape)
        attention = ("num_attention_heads", "num_key_value_heads", "head_dim")
        if any(getattr(eagle3_layer, field) != getattr(source, field) for field in attention):
            raise ModelConfigError(
                f"{eagle3_dir}: the EAGLE-3 head's attention heads differ from the target's"
            )
    target_dir, new_mtp_dir, new_eagle3_dir = out_dir / "target", out_dir / "mtp", out_dir / "eagle3"
    for directory in (target_dir, new_mtp_dir, new_eagle3_dir):
        if directory.exists():
            raise FileExistsError(f"{directory} exists; remove it or pass another --out")
    raw = widened_config(json.loads((model_dir / "config.json").read_text()), shape, dtype)
    config = ModelConfig.from_dict(raw)

    target_dir.mkdir(parents=True)
    (target_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for name in COPIED_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, target_dir / name)
    widener = Widener(source, shape, dict(iter_checkpoint(model_dir)), seed, device)
    write_safetensors(target_dir, target_tensor_sizes(config), widener.target_tensor, dtype, max_shard_bytes)
    target_bytes = weight_bytes_per_step(config, dtype)
    result = WidenResult(target_dir, None, target_bytes, None)
    if eagle3_dir is not None:
        eagle3_widener = Widener(source, shape, dict(iter_checkpoint(eagle3_dir)), seed, device)
        write_eagle3_head(new_eagle3_dir, eagle3_dir, config, shape, eagle3_widener, dtype)
        result = dataclasses.replace(result, eagle3_dir=new_eagle3_dir)
    if mtp_dir is None:
        return result

    head_widener = Widener(source, shape, dict(iter_checkpoint(mtp_dir)), seed, device)
    head_sizes = write_mtp_head(new_mtp_dir, config, head_widener, dtype)
    mtp_bytes = num_bytes(head_sizes, dtype) + lm_head_bytes(config, dtype)
    return dataclasses.replace(result, mtp_dir=new_mtp_dir, mtp_bytes_per_step=mtp_bytes)


def write_mtp_head(
    out_dir: Path, config: ModelConfig, widener: Widener, dtype: torch.dtype
) -> dict[str, torch.Size]:
    """Writes the widened head in `save_mtp_head`'s format (one file); returns its tensor sizes."""
    with torch.device("meta"):
        head = MTPHead(LlamaForCausalLM(config, max_positions=1))
    out_dir.mkdir(parents=True)
    head_config = {**mtp_config_dict(head), "torch_dtype": str(dtype).removeprefix("torch.")}
    (out_dir / "config.json").write_text(json.dumps(head_config, indent=2) + "\n")
    sizes = {name: t.shape for name, t in unfused_state_dict(head, head.config).items()}
    write_safetensors(out_dir, sizes, widener.mtp_tensor, dtype, max_shard_bytes=None)
    return sizes


def write_eagle3_head(
    out_dir: Path, source_dir: Path, config: ModelConfig, shape: Shape, widener: Widener, dtype: torch.dtype
) -> None:
    """Writes the widened EAGLE-3 head in `save_eagle3_head`'s format (one file): its layer of the
    target's shape, with the eps and RoPE base that keep its function, the vocabulary map unchanged."""
    source_raw = read_eagle3_config(source_dir)
    layer = head_layer_config(source_raw, config)
    raw = {**source_raw, **{field: getattr(shape, field) for field in SHAPE_FIELDS}}
    raw.update(
        num_hidden_layers=1,
        target_hidden_size=shape.hidden_size,
        rms_norm_eps=layer.rms_norm_eps * widener.source.hidden_size / shape.hidden_size,
        rope_theta=layer.rope_theta ** (shape.head_dim / layer.head_dim),
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    new_layer = head_layer_config(raw, config)
    own_embedding = "embed_tokens.weight" in widener.tensors
    layers = tuple(raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    with torch.device("meta"):
        target = LlamaForCausalLM(config, max_positions=1)
        head = Eagle3Head(target, new_layer, int(raw["draft_vocab_size"]), layers, own_embedding)
    out_dir.mkdir(parents=True)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    sizes = {name: t.shape for name, t in unfused_state_dict(head, head.config).items()}
    write_safetensors(out_dir, sizes, widener.eagle3_tensor, dtype, max_shard_bytes=None)


def target_tensor_sizes(config: ModelConfig) -> dict[str, torch.Size]:
    """Every tensor a checkpoint of `config` holds, Hugging Face names in model order (a tied LM
    head left out, as Hugging Face writes it)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions=1)
    sizes = {}
    for name, tensor in unfused_state_dict(model, config).items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        sizes[name if name.startswith("lm_head") else f"model.{name}"] = tensor.shape
    return sizes


def write_safetensors(
    out_dir: Path,
    sizes: dict[str, torch.Size],
    build: Callable[[str], torch.Tensor],
    dtype: torch.dtype,
    max_shard_bytes: int | None,
) -> None:
    """Builds and saves the tensors one shard at a time (no more than one shard in memory):
    model.safetensors when they fit one shard, else model-0000i-of-0000n.safetensors and the index
    `shared.model.loader` reads."""
    shards = plan_shards(sizes, dtype, max_shard_bytes)
    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for file_name, shard in zip(names, shards):
        tensors = {name: _stored(build(name), dtype).cpu() for name in shard}
        save_file(tensors, str(out_dir / file_name), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        weight_map = {name: file_name for file_name, shard in zip(names, shards) for name in shard}
        index = {"metadata": {"total_size": num_bytes(sizes, dtype)}, "weight_map": weight_map}
        (out_dir / SHARD_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _stored(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Weights in `dtype`; integer and boolean tensors (an EAGLE-3 head's vocabulary map) as they are."""
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def plan_shards(
    sizes: dict[str, torch.Size], dtype: torch.dtype, max_shard_bytes: int | None
) -> list[list[str]]:
    """Tensor names in order, cut into shards of at most `max_shard_bytes` (None: one shard); a
    tensor larger than that gets a shard of its own."""
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name, size in sizes.items():
        tensor_bytes = size.numel() * dtype.itemsize
        if max_shard_bytes is not None and shards[-1] and shard_bytes + tensor_bytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += tensor_bytes
    return shards


def weight_bytes_per_step(config: ModelConfig, dtype: torch.dtype) -> int:
    """Weight bytes a decode step of `config` reads: every parameter once; a tied embedding once,
    as the LM head; an untied one not at all (its gather of a few rows is negligible)."""
    stored = num_bytes(target_tensor_sizes(config), dtype)
    return stored if config.tie_word_embeddings else stored - lm_head_bytes(config, dtype)


def num_bytes(sizes: dict[str, torch.Size], dtype: torch.dtype) -> int:
    return sum(size.numel() for size in sizes.values()) * dtype.itemsize


def lm_head_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    return config.vocab_size * config.hidden_size * dtype.itemsize


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True, help="the trained source checkpoint")
    parser.add_argument("--mtp", type=Path, help="its MTP head directory (optional)")
    parser.add_argument("--eagle3", type=Path, help="its EAGLE-3 head directory (optional)")
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument(
        "--out", type=Path, required=True, help="writes OUT/target, OUT/mtp and OUT/eagle3 (those asked for)"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device",
        default="cpu",
        help="where to build the tensors: cpu or cuda (other random values, same function)",
    )
    args = parser.parse_args()
    start_s = time.perf_counter()
    result = widen(
        args.model,
        args.mtp,
        Shape.preset(args.shape),
        args.out,
        getattr(torch, args.dtype),
        args.seed,
        torch.device(args.device),
        eagle3_dir=args.eagle3,
    )
    print(f"wrote {result.target_dir} in {time.perf_counter() - start_s:.0f} s")
    print(f"target weight bytes read per decode step: {result.target_bytes_per_step:,}")
    if result.mtp_dir is not None:
        print(
            f"wrote {result.mtp_dir}; MTP weight bytes per draft step (its own + LM head): {result.mtp_bytes_per_step:,}"
        )
    if result.eagle3_dir is not None:
        print(f"wrote {result.eagle3_dir}")


if __name__ == "__main__":
    main()
