"""Torch/numpy reference of the batched n-gram match (prompt lookup) over token histories.

For each request, with `tokens = history[b, :lengths[b]]`: for n from `max_n` down to `min_n`, the
last n tokens are searched for among earlier windows that are followed by at least one token; at
the most recent match of the longest n, the up to `k` tokens that followed become the drafts
(services/engine/spec_decode/ngram.py is the per-request form). A per-step `budget` caps the drafts
of the whole batch, granted in request order.
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view


def _match(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    if k <= 0 or len(tokens) < min_n + 1:
        return []
    history = tokens[:-1]
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        if len(history) < n:
            continue
        hits = np.flatnonzero((sliding_window_view(history, n) == tokens[-n:]).all(axis=1))
        if len(hits):
            follow = int(hits[-1]) + n
            return tokens[follow : follow + k].tolist()
    return []


def ngram_match_ref(
    history: torch.Tensor,  # [num_reqs, max_len] int32
    lengths: torch.Tensor,  # [num_reqs] int32
    min_n: int,
    max_n: int,
    k: int | torch.Tensor,  # drafts per request: one for all, or [num_reqs] int32
    budget: int | None = None,
    row_ids: torch.Tensor | None = None,  # [num_reqs] int64: history row of each request (None: row b)
    max_k: int | None = None,  # the drafts' width (default: the largest k)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (drafts [num_reqs, max_k] int32 padded with -1, num_drafts [num_reqs] int32)."""
    if row_ids is not None:
        history = history[row_ids]
    num_reqs = history.shape[0]
    ks = [k] * num_reqs if isinstance(k, int) else k.tolist()
    if max_k is None:
        max_k = max(ks, default=0)
    ks = [min(k_b, max_k) for k_b in ks]
    rows = history.cpu().numpy()
    lens = lengths.tolist()
    drafts = torch.full((num_reqs, max(max_k, 1)), -1, dtype=torch.int32)
    num_drafts = torch.zeros(num_reqs, dtype=torch.int32)
    remaining = budget if budget is not None else None
    for b in range(num_reqs):
        found = _match(rows[b, : lens[b]], min_n, max_n, ks[b])
        if remaining is not None:
            found = found[: max(remaining, 0)]
            remaining -= len(found)
        drafts[b, : len(found)] = torch.tensor(found, dtype=torch.int32)
        num_drafts[b] = len(found)
    return drafts.to(history.device), num_drafts.to(history.device)
