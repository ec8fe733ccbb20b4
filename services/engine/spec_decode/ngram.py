"""N-gram (prompt lookup) drafting: copy what followed the last occurrence of the current suffix.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n tokens of a request are
searched for in its earlier tokens (prompt and output); at the most recent earlier match, the up to
k tokens that followed become the drafts. Code editing and retrieval-style prompts repeat long
spans of their input, which is where this pays.

On a GPU the whole batch is matched in one kernel launch over token histories kept on the device
(`kernels.ngram.TokenHistory`, appended with each step's new tokens only); elsewhere each request is
matched on the host with numpy. Both give the same drafts.
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

import kernels


class NgramProposer:
    def __init__(
        self,
        min_n: int,
        max_n: int,
        device: torch.device | None = None,
        history: kernels.TokenHistory | None = None,
    ):
        """`history`: the device token history to use (the CUDA-graph step's, which it appends to
        and drafts in); by default one of its own on a GPU."""
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min ({min_n}) <= prompt_lookup_max ({max_n})")
        self.min_n = min_n
        self.max_n = max_n
        self.history: kernels.TokenHistory | None = history
        if (
            history is None
            and device is not None
            and device.type == "cuda"
            and kernels.cuda_available(torch.empty(0, device=device))
        ):
            self.history = kernels.TokenHistory(device)

    def propose_batch(self, requests: list[tuple[str, list[int], int]]) -> list[list[int]]:
        """Drafts for each (request id, token ids, k): one launch on a GPU, `propose` otherwise."""
        if self.history is None or not requests:
            return [self.propose(token_ids, k) for _, token_ids, k in requests]
        return self.history.propose(requests, self.min_n, self.max_n)

    def forget(self, request_id: str) -> None:
        if self.history is not None:
            self.history.forget(request_id)

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` drafts following the most recent earlier match of the longest suffix."""
        if k <= 0 or len(token_ids) < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = _last_match(tokens, n)
            if start is not None:
                follow = start + n
                return tokens[follow : follow + k].tolist()
        return []


def _last_match(tokens: np.ndarray, n: int) -> int | None:
    """Start of the most recent window tokens[i:i+n] == tokens[-n:] with i + n < len(tokens)."""
    history = tokens[:-1]  # a match must be followed by at least one token
    if len(history) < n:
        return None
    windows = sliding_window_view(history, n)  # [len(history) - n + 1, n]
    hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
    return int(hits[-1]) if len(hits) else None
