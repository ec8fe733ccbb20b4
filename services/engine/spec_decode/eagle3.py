"""`eagle3` drafting with an EAGLE-3 head (see shared/model/eagle3.py).

The same chain as the MTP head's (services/engine/spec_decode/mtp.py): every step the head catches
up on the step's rows, writing its own KV cache (one layer, the target's block tables), and its
row at the last verified position drafts the token after the newest one; later drafts chain the
head on its own output. What differs is what the head reads of the target at row i: the streams
entering three of its layers, projected by the head's `fc` (`ForwardContext.aux_hidden`, which the
target's forward fills only while this method is loaded), and that its LM head scores a draft
vocabulary mapped into the target's.
"""

from __future__ import annotations

import torch

from services.engine.spec_decode.mtp import MTPProposer
from services.engine.spec_decode.proposer import ForwardContext
from services.engine.spec_decode.tree import DraftTree
from shared.model.eagle3 import Eagle3Head
from shared.model.llama import KVCache


class Eagle3Proposer(MTPProposer):
    def __init__(
        self,
        head: Eagle3Head,
        kv_cache: KVCache,
        num_steps: int,
        block_size: int,
        tree: DraftTree | None = None,
        ngram: tuple[int, int] | None = None,
        num_branch: int = 0,
    ):
        """`ngram`, `num_branch`: the tree's n-gram branch (with_ngram; MTPProposer)."""
        super().__init__(head, kv_cache, num_steps, block_size, ngram, tree, num_branch)
        self.eagle3_head = head

    def _features(self, forward: ForwardContext) -> torch.Tensor:
        """g_i = fc(the target's three streams at row i)."""
        assert forward.aux_hidden is not None, "the target's forward did not keep the EAGLE-3 streams"
        return self.eagle3_head.project(forward.aux_hidden)
