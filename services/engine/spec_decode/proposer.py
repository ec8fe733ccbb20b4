"""What every draft proposer returns, and what model-based proposers share with the runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from services.engine.block_manager import BlockManager
from services.engine.sequence import Sequence

if TYPE_CHECKING:
    from services.engine.model_runner import ModelRunner


@dataclass
class Drafts:
    token_ids: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None
    """[len(token_ids), vocab_size] draft distribution; None for one-hot (model-free or greedy) drafts."""


@dataclass
class ModelDrafterContext:
    """The runner (models, caches, metadata) and the block manager."""

    runner: ModelRunner
    block_manager: BlockManager

    def reserve_lookahead(self, seqs: list[Sequence], ks: list[int], lookahead: list[int]) -> list[int]:
        """Makes sure each sequence's blocks cover `lookahead[i]` positions past its computed
        tokens (drafting models write KV there); shrinks k where the cache has no room."""
        fitted = []
        for seq, k, ahead in zip(seqs, ks, lookahead):
            while ahead > 0 and not self.block_manager.can_append(seq, ahead):
                ahead -= 1
                k -= 1
            if ahead > 0:
                self.block_manager.append_slots(seq, ahead)
            fitted.append(max(k, 0))
        return fitted
