"""Tensor parallelism: how a model's weights split over the ranks of a group, and the collectives
that join the parts (Megatron-LM, Shoeybi et al. 2019, arXiv 1909.08053).

Each rank holds a slice of every large matrix and runs the same forward on it:
- *column-parallel* (qkv_proj, gate_up_proj): the output features split, so each rank computes its
  own attention heads and MLP columns with no communication;
- *row-parallel* (o_proj, down_proj): the input features split, each rank's product is a partial
  sum, joined by one all-reduce per attention and one per MLP;
- *vocab-parallel* (embed_tokens, lm_head): the vocabulary rows split (padded up to a multiple of
  the ranks); a token's embedding comes from the rank that holds its row (one all-reduce), the
  logits of every rank are all-gathered, so every rank holds identical float32 logits.

With fewer KV heads than ranks, each KV head is replicated on the ranks whose query heads use it.
A group of one rank runs none of the collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shared.model.config import ModelConfig, ModelConfigError

if TYPE_CHECKING:  # CuPy is imported only where a peer all-reduce is opened
    from kernels.all_reduce import PeerAllReduce


@dataclass(frozen=True)
class TensorParallel:
    """One rank's place in its group."""

    rank: int = 0
    size: int = 1
    group: Any = None
    """The torch.distributed process group of the ranks (NCCL on CUDA, gloo on CPU); None: the
    default group (or no group when `size` is 1)."""
    peer: PeerAllReduce | None = None
    """The all-reduce over peer memory (GPUs of one host, kernels/all_reduce.py), for the
    messages it takes; None: the process group reduces every message."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks, in place; returns it."""
        if self.size == 1:
            return x
        if self.peer is not None and self.peer.fits(x):
            return self.peer.all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: every rank's `x`, in rank order."""
        if self.size == 1:
            return x[None]
        gathered = x.new_empty(self.size * x.shape[0], *x.shape[1:])
        _all_gather_single(gathered, x.contiguous(), self.group)
        return gathered.view(self.size, *x.shape)

    def gather_columns(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """[num_rows, size * cols] from each rank's [num_rows, cols], rank order, cut to `width`."""
        if self.size == 1:
            return x[:, :width]
        rows, cols = x.shape
        return self.all_gather(x).permute(1, 0, 2).reshape(rows, self.size * cols)[:, :width]


SINGLE = TensorParallel()
"""The group of one rank."""


def _all_gather_single(out: torch.Tensor, x: torch.Tensor, group: Any) -> None:
    """Each rank's `x` stacked along dim 0 of `out` (`all_gather_single` from torch 2.11 on, where
    `all_gather_into_tensor` is deprecated)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)


# ---- how the model splits ---------------------------------------------------------------------------


def check_divisible(config: ModelConfig, size: int, what: str = "the model") -> None:
    """Raises ModelConfigError naming every dimension of `config` that does not split over `size`
    ranks (attention heads, MLP columns, KV heads unless each rank can hold a whole one)."""
    problems = []
    if config.num_attention_heads % size:
        problems.append(f"num_attention_heads {config.num_attention_heads} is not divisible by {size}")
    if config.intermediate_size % size:
        problems.append(f"intermediate_size {config.intermediate_size} is not divisible by {size}")
    kv = config.num_key_value_heads
    if kv % size and size % kv:
        problems.append(
            f"num_key_value_heads {kv} neither divides nor is divisible by {size} "
            "(KV heads are split, or replicated when there are fewer than ranks)"
        )
    if problems:
        raise ModelConfigError(
            f"{what} cannot be split over tensor_parallel_size {size}: {'; '.join(problems)}; "
            "choose a tensor-parallel size that divides them"
        )


def num_local_heads(config: ModelConfig, tp: TensorParallel) -> int:
    return config.num_attention_heads // tp.size


def kv_head_range(num_kv_heads: int, tp: TensorParallel) -> range:
    """The KV heads rank `tp.rank` holds: its share, or the one head its query heads use when
    there are fewer KV heads than ranks (then replicated over size / num_kv_heads ranks)."""
    if num_kv_heads >= tp.size:
        per_rank = num_kv_heads // tp.size
        return range(tp.rank * per_rank, (tp.rank + 1) * per_rank)
    head = tp.rank * num_kv_heads // tp.size
    return range(head, head + 1)


def num_local_kv_heads(config: ModelConfig, tp: TensorParallel) -> int:
    return len(kv_head_range(config.num_key_value_heads, tp))


def kv_head_owners(num_kv_heads: int, size: int) -> list[int]:
    """For each KV head, the first rank that holds it (where a gather finds it)."""
    owners: dict[int, int] = {}
    for rank in range(size):
        for head in kv_head_range(num_kv_heads, TensorParallel(rank, size)):
            owners.setdefault(head, rank)
    return [owners[head] for head in range(num_kv_heads)]


def vocab_shard(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """(first row, rows per rank) of the rank's vocabulary shard; the rows of the last shards may
    run past `vocab_size` (padding, never looked up, their logits cut off)."""
    per_rank = -(-vocab_size // tp.size)
    return tp.rank * per_rank, per_rank


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint tensor one rank holds: `length` rows (dim 0) or columns (dim 1)
    from `start`, of `total` in the whole tensor."""

    dim: int
    start: int
    length: int
    total: int


def parameter_shard(name: str, part: int | None, config: ModelConfig, tp: TensorParallel) -> Shard | None:
    """Which slice of checkpoint tensor `name` (a parameter of the model code, `part` of a fused
    one) rank `tp.rank` loads; None: the whole tensor (replicated, or a group of one)."""
    if tp.size == 1:
        return None
    head_dim = config.head_dim
    if name in ("embed_tokens.weight", "lm_head.weight"):
        start, per_rank = vocab_shard(config.vocab_size, tp)
        return Shard(0, start, max(0, min(per_rank, config.vocab_size - start)), config.vocab_size)
    if ".qkv_proj." in name:
        if part == 0:
            heads = num_local_heads(config, tp)
            return Shard(
                0, tp.rank * heads * head_dim, heads * head_dim, config.num_attention_heads * head_dim
            )
        kv = kv_head_range(config.num_key_value_heads, tp)
        return Shard(0, kv.start * head_dim, len(kv) * head_dim, config.num_key_value_heads * head_dim)
    if ".gate_up_proj." in name:
        columns = config.intermediate_size // tp.size
        return Shard(0, tp.rank * columns, columns, config.intermediate_size)
    if name.endswith(".o_proj.weight"):
        heads = num_local_heads(config, tp)
        return Shard(1, tp.rank * heads * head_dim, heads * head_dim, config.num_attention_heads * head_dim)
    if name.endswith(".down_proj.weight"):
        columns = config.intermediate_size // tp.size
        return Shard(1, tp.rank * columns, columns, config.intermediate_size)
    return None
