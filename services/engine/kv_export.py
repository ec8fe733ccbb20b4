"""What a prefill instance hands a decode instance: a request's KV, ready to send."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
