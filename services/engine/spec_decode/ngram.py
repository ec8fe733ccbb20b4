"""N-gram (prompt lookup) drafting: copy what followed the last occurrence of the current suffix.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n tokens of a request are
searched for in its earlier tokens (prompt and output); at the most recent earlier match, the up to
k tokens that followed become the drafts. Code editing and retrieval-style prompts repeat long
spans of their input, which is where this pays.

The whole batch is matched in one launch of `kernels.ngram_match` over the requests' token rows on
the device (`InputBatch`), right after the post-step update appended the step's tokens.
"""

from __future__ import annotations

import kernels
from services.engine.spec_decode.proposer import DraftBatch, Drafts, Proposer


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int, max_num_drafts: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min ({min_n}) <= prompt_lookup_max ({max_n})")
        self.min_n = min_n
        self.max_n = max_n
        self.max_num_drafts = max_num_drafts

    def propose(self, batch: DraftBatch) -> Drafts:
        inputs, slots = batch.inputs, batch.seq_slots
        token_ids, num_drafts = kernels.ngram_match(
            inputs.token_rows,
            inputs.num_tokens[slots],
            self.min_n,
            self.max_n,
            batch.num_wanted,
            row_ids=slots,
            max_k=self.max_num_drafts,
        )
        return Drafts(token_ids, num_drafts)
