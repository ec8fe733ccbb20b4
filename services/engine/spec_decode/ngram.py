"""N-gram (prompt lookup) drafting: copy what followed the last occurrence of the current suffix.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n tokens of a request are
searched for in its earlier tokens (prompt and output); at the most recent earlier match, the up to
k tokens that followed become the drafts. Code editing and retrieval-style prompts repeat long
spans of their input, which is where this pays.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min ({min_n}) <= prompt_lookup_max ({max_n})")
        self.min_n = min_n
        self.max_n = max_n

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
