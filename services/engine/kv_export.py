"""What a prefill instance hands a decode instance: a request's KV, whole after its prefill
(`KVExport`) or streamed layer by layer while its prefill runs (`KVStreamStart`, `KVLayers`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from services.kv_transport.ipc_buffer import SharedKV


@dataclass
class KVExport:
    """A prefilled request's KV, ready to send to its decode instance."""

    request_id: str
    num_tokens: int
    """Tokens whose KV is included (prompt, plus any resumed output)."""
    first_token_id: int
    """The token sampled after them (already streamed to the client)."""
    layers: list[tuple[str, int, torch.Tensor, torch.Tensor]]
    """(cache name, layer index, key, value), each [num_blocks, block_size, kv_heads, head_dim]:
    the target's layers and its drafting model's (MTP head or draft model)."""
    tensors: dict[str, torch.Tensor]
    """Named extra tensors the transport carries after the layers."""
    buffer: torch.Tensor | None = None
    """The device buffer (uint8) `layers` are views of, when gathered for another process to open."""
    caches: dict[str, torch.Tensor] = field(default_factory=dict)
    """With `buffer`: each cache's layers stacked, [num_layers, 2, num_blocks, block_size, kv_heads,
    head_dim] (views of it)."""
    shared: SharedKV | None = None
    """The handle of `buffer`, which the worker sends instead of the bytes (`layers` is then empty)."""
    streamed: bool = False
    """The target's layers went ahead as the prefill computed them (`KVLayers`): `layers` holds
    only the drafting model's, which its catch-up after the forward wrote."""


@dataclass
class KVStreamStart:
    """A request to hand off starts its prefill and its KV streams: what its transfer carries (the
    transfer's header), sent before any of its layers."""

    request_id: str
    num_tokens: int
    """Tokens whose KV the transfer carries (the prompt, plus any resumed output)."""
    dtype: torch.dtype
    layer_shapes: list[tuple[str, int, tuple[int, int, int, int]]]
    """(cache name, layer index, [num_blocks, block_size, kv_heads, head_dim]) of every layer the
    transfer carries: the target's, streamed as the prefill computes them, then its drafting model's."""


@dataclass
class KVLayers:
    """One target layer of the requests whose prefill chunks a step runs, on the host as soon as
    the step's forward is past it (while it computes the later layers): for each request the
    blocks its chunk completed, from `first_blocks`; the whole layer where its prompt ran in one step."""

    index: int
    request_ids: list[str]
    first_blocks: list[int]
    """Per request, the first of the layer's blocks its key and value hold."""
    keys: list[torch.Tensor]
    """Per request, [num_blocks of the part, block_size, kv_heads, head_dim]."""
    values: list[torch.Tensor]


KVStreamMessage = KVStreamStart | KVLayers
