"""`mtp` drafting with a DeepSeek-V3-style multi-token-prediction head (see shared/model/mtp.py).

Every step, after verification, the head *catches up* on the step's tokens: its row i pairs the
target's hidden state h_i with the token t_{i+1} that now follows position i (read from the
request's token row, which the post-step update just extended), writing the head's own KV cache
(one layer, sharing the target's block tables). It runs over every row of the step, whatever
verification kept: rows past the kept tokens write KV past the request's length, which the next
step overwrites, and no kept row attends to them. Catching up every step, whether or not the
request drafts next, keeps the head's cache whole while adaptive speculation pauses drafting.

The head's output at the row of the last verified position predicts the token after the newest
one: draft 1. Drafts 2..m chain the head on its own output and the previous draft, one position
further each (`num_model_steps` = m). With `mtp_strategy: with_ngram`, n-gram drafts matched after
the MTP drafts fill the rest of the request's k.

With a draft tree (`speculative_config.tree`, services/engine/spec_decode/tree.py) the head
drafts the top-k tokens of each node instead of one: depth 1 from its row at the last accepted
position, each deeper level from one forward of the head over the nodes drafted so far (tree
attention over their ancestors, each node at its parent's position + 1, its KV past the newest
token), fed with each node's token and its parent's output. After a tree step the head's KV of the
accepted path is compacted like the target's. With `with_ngram` the n-gram drafts after the newest
token are a branch from the root, merged into the head's tree on the device where it parts from
the head's nodes (`kernels.graft_trees`): the drafts come with their parents.
"""

from __future__ import annotations

from typing import Protocol

import torch

import kernels
from kernels import AttentionMetadata
from services.engine.spec_decode.proposer import DraftBatch, Drafts, ForwardContext, Proposer
from services.engine.spec_decode.tree import DraftTree
from shared.model.config import ModelConfig
from shared.model.llama import KVCache


class ChainedHead(Protocol):
    """A one-layer draft head chained on its own output: the MTP head, the EAGLE-3 head."""

    config: ModelConfig

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens]: t_{i+1}
        positions: torch.Tensor,  # [num_tokens]: i
        hidden: torch.Tensor,  # [num_tokens, hidden_size]: features of position i
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...  # [num_tokens, hidden_size]: the head's output, fed to the next draft

    def forward_with_logits(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # (`logits` of the output, the output)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # [num_rows, vocab_size] float32


class MTPProposer(Proposer):
    def __init__(
        self,
        head: ChainedHead,
        kv_cache: KVCache,
        num_steps: int,
        block_size: int,
        ngram: tuple[int, int] | None,
        tree: DraftTree | None = None,
        num_branch: int = 0,
    ):
        """`ngram`: (prompt_lookup_min, prompt_lookup_max) for with_ngram, else None; `tree`: the
        static draft tree, else None (chains); `num_branch`: the most drafts of the tree's n-gram
        branch (with `ngram`)."""
        if num_branch and (ngram is None or tree is None):
            raise ValueError("an n-gram branch needs a draft tree and the n-gram sizes")
        self.head = head
        self.kv_cache = kv_cache
        self.num_steps = num_steps
        self.block_size = block_size
        self.ngram = ngram
        self.tree = tree
        self.num_branch = num_branch
        device = kv_cache[0].device
        # on the device once: a CUDA graph's capture cannot copy from the host
        self._node_depths = torch.tensor(tree.depths[1:] if tree else [], dtype=torch.long, device=device)
        """Each node's depth past the root (level order)."""
        self._node_masks = torch.tensor(
            [m >> 1 for m in tree.masks[1:]] if tree else [], dtype=torch.long, device=device
        )
        """Each node's ancestor mask among the nodes past the root."""
        self._head_parents = torch.tensor(tree.parents[1:] if tree else [], dtype=torch.long, device=device)
        """Each node's parent (level order, past the root)."""

    def propose(self, batch: DraftBatch) -> Drafts:
        head_hidden = self._catch_up(batch)
        if batch.tree_path is not None:
            batch.compact_tree_kv([self.kv_cache], self.block_size)
        if batch.num_steps == 0:
            return Drafts.none(len(batch.seq_slots), batch.seq_slots.device)
        if self.tree is not None:
            return self._draft_tree(batch, head_hidden, self.tree)
        forward, rows = batch.forward, batch.newest_rows
        assert forward is not None
        hidden = head_hidden.index_select(0, rows)
        num_steps = min(batch.num_steps, self.num_steps)
        chain = []
        if num_steps > 1:  # chained forwards start at each request's newest token's position
            newest = forward.positions.index_select(0, rows) + 1
            chain = batch.chain_inputs(newest, 1, num_steps - 1, self.block_size)
        draft_ids = [batch.sample(self.head.logits(hidden), 0)]
        for step, (positions, meta) in enumerate(chain, start=1):
            logits, hidden = self.head.forward_with_logits(
                draft_ids[-1], positions, hidden, self.kv_cache, meta
            )
            draft_ids.append(batch.sample(logits, step))
        token_ids = torch.stack(draft_ids, dim=1)
        num_drafts = torch.minimum(batch.num_wanted, torch.full_like(batch.num_wanted, len(draft_ids)))
        if self.ngram is not None and batch.num_steps > len(draft_ids):
            return self._append_ngram(batch, token_ids, num_drafts)
        return Drafts(token_ids, num_drafts)

    def _draft_tree(self, batch: DraftBatch, head_hidden: torch.Tensor, tree: DraftTree) -> Drafts:
        """The tree's nodes past its root in level order, [num_seqs, num_nodes - 1], each node the
        head's top-k after its parent, with the n-gram branch grafted after them (with_ngram)."""
        root = head_hidden.index_select(0, batch.newest_rows)
        deepest = root[:, None, :]  # [num_seqs, 1, hidden_size] the nodes at depth 0: the root
        levels: list[torch.Tensor] = []  # [num_seqs, level width] each depth's nodes
        inputs: list[torch.Tensor] = []  # [num_seqs, level width, hidden_size] their parents' outputs
        for depth, branching in enumerate(tree.branching):
            if depth:
                out = self._tree_forward(batch, _joined(levels), _joined(inputs))
                deepest = out[:, -levels[-1].shape[1] :]  # the nodes at `depth`
            levels.append(self._top_k(deepest, branching))
            if depth + 1 < tree.depth:  # the next forward's inputs
                inputs.append(deepest.repeat_interleave(branching, dim=1))
        branch = [self._ngram_branch(batch)] if self.num_branch else []
        token_ids = torch.cat(branch + levels, dim=1).int()
        num_drafts = batch.num_wanted.clamp(max=token_ids.shape[1])
        token_ids, parents, num_drafts = kernels.graft_trees(
            self._head_parents, token_ids, num_drafts, self.num_branch
        )
        return Drafts(token_ids, num_drafts, parents=parents)

    def _ngram_branch(self, batch: DraftBatch) -> torch.Tensor:
        """[num_seqs, num_branch] int32 the n-gram drafts after each request's newest token, -1 past
        its match (grafted onto the head's tree: kernels.graft_trees)."""
        assert self.ngram is not None
        inputs, slots = batch.inputs, batch.seq_slots
        wanted = torch.where(batch.num_wanted > 0, self.num_branch, 0).int()
        branch_ids, _ = kernels.ngram_match(
            inputs.token_rows,
            inputs.num_tokens[slots],
            self.ngram[0],
            self.ngram[1],
            wanted,
            row_ids=slots,
            max_k=self.num_branch,
        )
        return branch_ids

    def _top_k(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """[num_seqs, n * k] the head's k likeliest tokens after each of n nodes ([num_seqs, n, hidden_size])."""
        logits = self.head.logits(hidden.flatten(0, 1))
        return kernels.top_k_ids(logits, k).view(hidden.shape[0], -1)

    def _tree_forward(
        self,
        batch: DraftBatch,
        token_ids: torch.Tensor,  # [num_seqs, num_nodes] the nodes drafted so far, root excluded
        hidden: torch.Tensor,  # [num_seqs, num_nodes, hidden_size] each node's parent's output
    ) -> torch.Tensor:  # [num_seqs, num_nodes, hidden_size]
        """The head over the nodes drafted so far: node m at the last accepted position + its
        depth, its KV at that position + m + 1, seeing the head's cache and its own ancestors.
        Requests that draft nothing write no KV and sit at position 0 (their rows are not used)."""
        forward = batch.forward
        assert forward is not None
        num_seqs, num_nodes = token_ids.shape
        inputs = kernels.tree_forward_inputs(
            forward.positions,
            batch.newest_rows,
            batch.num_wanted,
            forward.meta.block_tables,
            batch.seq_rows,
            self._node_depths,
            self._node_masks,
            num_nodes,
            self.block_size,
        )
        on_host = not kernels.cuda_available(token_ids)  # the torch twin reads lengths on the host
        meta = AttentionMetadata(
            slot_mapping=inputs.slot_mapping,
            query_start_loc=inputs.query_start_loc,
            seq_lens=inputs.seq_lens,
            block_tables=inputs.block_tables,
            query_lens_cpu=[num_nodes] * num_seqs,
            seq_lens_cpu=inputs.seq_lens.tolist() if on_host else [num_nodes] * num_seqs,
            max_query_len=num_nodes,
            max_seq_len=forward.max_seq_len + num_nodes + 1,
            tree_mask=inputs.tree_mask,
        )
        out = self.head(
            token_ids.flatten().long(), inputs.positions, hidden.flatten(0, 1), self.kv_cache, meta
        )
        return out.view(num_seqs, num_nodes, -1)

    def _catch_up(self, batch: DraftBatch) -> torch.Tensor:
        """The head over (h_i, t_{i+1}) at every row of the step; [num_tokens, hidden_size]."""
        forward = batch.forward
        assert forward is not None
        rows = batch.inputs.token_rows
        following = (forward.positions + 1).clamp(max=rows.shape[1] - 1)
        # padding rows read the scratch row, which holds whatever padding appended
        next_ids = rows[forward.token_slots, following].long().clamp(0, self.head.config.vocab_size - 1)
        return self.head(next_ids, forward.positions, self._features(forward), self.kv_cache, forward.meta)

    def _features(self, forward: ForwardContext) -> torch.Tensor:
        """[num_tokens, hidden_size] what the head reads of the target at each row: h_i."""
        return forward.hidden

    def _append_ngram(self, batch: DraftBatch, token_ids: torch.Tensor, num_drafts: torch.Tensor) -> Drafts:
        """MTP drafts, then n-gram drafts matched as if the MTP drafts had been accepted: they are
        written past each row's end (scratch room the next post-step update overwrites)."""
        assert self.ngram is not None
        inputs, slots = batch.inputs, batch.seq_slots
        lengths = inputs.num_tokens[slots]
        columns = (lengths.long()[:, None] + torch.arange(token_ids.shape[1], device=slots.device)).clamp(
            max=inputs.row_capacity - 1
        )
        inputs.token_rows[slots[:, None], columns] = token_ids
        extra_ids, num_extra = kernels.ngram_match(
            inputs.token_rows,
            lengths + num_drafts,
            self.ngram[0],
            self.ngram[1],
            batch.num_wanted - num_drafts,
            row_ids=slots,
            max_k=batch.num_steps - token_ids.shape[1],
        )
        num_extra = torch.where(num_drafts == token_ids.shape[1], num_extra, 0)  # only after a full chain
        return Drafts(torch.cat([token_ids, extra_ids], dim=1), num_drafts + num_extra)


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`tensors` joined along dim 1 (one tensor as it is: no copy)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=1)
