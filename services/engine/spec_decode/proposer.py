"""The one interface every draft method implements: `propose(batch) -> Drafts`.

A proposer drafts the next step of the requests that got a token this step. Device proposers
(n-gram, MTP, EAGLE-3, draft model) run inside the step's tail, right after verification and the post-step
update, on tensors only (so the tail can be captured in a CUDA graph); the host reads their drafts
back with the step's tokens. Host proposers (suffix decoding) run after that read-back, on the
requests' token lists. The drafter looks them up by method name (`drafter.make_proposers`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

import kernels
from kernels import AttentionMetadata
from services.engine.input_batch import InputBatch
from services.engine.sequence import Sequence
from services.engine.spec_decode.draft_sampling import DraftSampling
from shared.model.llama import KVCache


@dataclass
class ForwardContext:
    """The step's target forward, which drafting models catch up on: every scheduled token."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    hidden: torch.Tensor  # [num_tokens, hidden_size] the target's final-normed hidden states
    token_slots: torch.Tensor  # [num_tokens] int64 slot of each token's request (padding: scratch)
    max_seq_len: int
    """A bound on every context length this step and its drafting reach (attention launch shape)."""
    aux_hidden: torch.Tensor | None = None
    """[num_tokens, 3 * hidden_size] the target's streams entering the EAGLE-3 head's three layers
    (only when the eagle3 method is loaded)."""


class StepRoots:
    """Where each request of a step starts in its forward: the row of its root (its newest token
    before the step, which its drafts hang from), the root's position and the request's block
    table; each computed on first use, once a step (the target's and the drafting heads' tree KV
    compactions share them)."""

    def __init__(self, forward: ForwardContext, seq_rows: torch.Tensor, cu_num_rows: torch.Tensor):
        self.forward = forward
        self.seq_rows = seq_rows  # [num_seqs] int64
        self.cu_num_rows = cu_num_rows  # [num_seqs + 1] int32

    @functools.cached_property
    def rows(self) -> torch.Tensor:
        """[num_seqs] int64 the row of the forward holding each request's first logit row: its
        newest token before the step (unclamped)."""
        ends = self.forward.meta.query_start_loc[1:].index_select(0, self.seq_rows)
        return (ends - (self.cu_num_rows[1:] - self.cu_num_rows[:-1])).long()

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        """[num_seqs] int64 each root's position; a graph's padding requests may bring no row at the
        end of the step: their rows clamped, they read a position in range (and move nothing)."""
        rows = self.rows.clamp(0, self.forward.positions.shape[0] - 1)
        return self.forward.positions.index_select(0, rows)

    @functools.cached_property
    def tables(self) -> torch.Tensor:  # [num_seqs, max_blocks] int32 each request's block table
        return self.forward.meta.block_tables[self.seq_rows]


@dataclass
class DraftBatch:
    """The requests that got a token this step, seen after the post-step update: each one's token
    row already ends with its kept tokens."""

    inputs: InputBatch
    seqs: list[Sequence]
    """Host state of the requests, in order (host proposers read their token lists)."""
    seq_slots: torch.Tensor  # [num_seqs] int64 (padding: the scratch slot)
    seq_rows: torch.Tensor  # [num_seqs] int64 each request's index among the step's sequences
    num_wanted: torch.Tensor  # [num_seqs] int32 drafts wanted next step; 0 for finished requests
    num_wanted_cpu: list[int]
    """The same before the update (host proposers; device proposers read `num_wanted`)."""
    num_steps: int
    """The most drafts any request wants: how long a drafting model's chain runs."""
    forward: ForwardContext | None
    """The step's forward (device proposers only)."""
    sampling: DraftSampling | None = None
    """The requests' sampling parameters, where the tail already gathered them."""
    num_accepted: torch.Tensor | None = None
    """[num_seqs] int32 drafts each request's verification accepted this step (device proposers)."""
    cu_num_rows: torch.Tensor | None = None
    """[num_seqs + 1] int32 where each request's logit rows start (device proposers)."""
    tree_path: torch.Tensor | None = None
    """[num_seqs, max_rows] int64 the row (tree node) each request accepted at each depth, where
    the step verified draft trees (services/engine/tree_verify.py); None: chains."""
    roots: StepRoots | None = None
    """The step's roots as its tail computed them (device proposers; None: from `forward`)."""

    @classmethod
    def on_host(cls, inputs: InputBatch, seqs: list[Sequence], num_wanted: list[int]) -> DraftBatch:
        """A batch for host proposers, which read the requests' token lists and `num_wanted_cpu`."""
        none = torch.empty(0, dtype=torch.long)
        return cls(inputs, seqs, none, none, none.int(), num_wanted, 0, None)

    def sample(self, logits: torch.Tensor, num_before: int) -> torch.Tensor:
        """[num_seqs] int32: each request's draft number `num_before` (< `num_steps`) from a
        drafting model's logits ([num_seqs, vocab_size] float32), sampled with the noise the
        target's verification will use at that output position, so that the target's own sample
        decides acceptance."""
        return self._sampling.sample(logits, self._draft_positions[num_before])

    @functools.cached_property
    def _sampling(self) -> DraftSampling:
        return self.sampling or DraftSampling.gather(self.inputs, self.seq_slots)

    @functools.cached_property
    def _draft_positions(self) -> torch.Tensor:
        """[num_steps, num_seqs] int64 the output position of each draft of the chain: computed once
        before it, so that a chained draft launches no kernel for its sampling key."""
        return self._sampling.draft_positions(max(self.num_steps, 1))

    @functools.cached_property
    def newest_rows(self) -> torch.Tensor:
        """[num_seqs] int64 the row of the step's forward at each request's newest position but one,
        whose hidden state and the newest token predict the next token: a request brought d drafts
        in the last d of its rows and kept the first `num_accepted` of them (clamped to the step's
        rows: a CUDA graph's padding requests, and requests that ended, draft nothing either way)."""
        forward, num_accepted = self.forward, self.num_accepted
        assert forward is not None and num_accepted is not None
        newest = num_accepted if self.tree_path is None else self.tree_path[:, -1]
        rows = self._roots.rows + newest
        return rows.clamp_(0, forward.positions.shape[0] - 1)

    @functools.cached_property
    def _roots(self) -> StepRoots:
        if self.roots is not None:
            return self.roots
        assert self.forward is not None and self.cu_num_rows is not None
        return StepRoots(self.forward, self.seq_rows, self.cu_num_rows)

    def compact_tree_kv(self, caches: list[KVCache], block_size: int) -> None:
        """Moves the KV the step's forward wrote for each request's accepted tree path into
        consecutive positions after its root, in `caches` (a drafting head's caches)."""
        assert self.tree_path is not None and self.num_accepted is not None
        roots = self._roots
        kernels.compact_path_kv(
            caches, self.tree_path, self.num_accepted, roots.positions, roots.tables, block_size
        )

    def chain_inputs(
        self, first: torch.Tensor, first_step: int, num_forwards: int, block_size: int
    ) -> list[tuple[torch.Tensor, AttentionMetadata]]:
        """Positions and attention metadata of a chain of drafting forwards, computed at once:
        forward j brings one new token per request at `first + j` (`first` [num_seqs] int64), over
        the request's blocks. Requests that want at most `first_step + j` drafts (their blocks may
        not reach that far) sit at position 0 in forward j, write no KV and attend to one key:
        their rows are not used."""
        assert self.forward is not None
        tables = self._roots.tables
        offsets = torch.arange(num_forwards, device=first.device)[:, None]
        drafting = self.num_wanted[None, :] > offsets + first_step
        positions = torch.where(drafting, first[None, :] + offsets, 0)  # [num_forwards, num_seqs]
        blocks = tables.t().gather(0, positions // block_size).long()
        slots = torch.where(drafting, blocks * block_size + positions % block_size, -1)
        seq_lens = (positions + 1).int()
        num_seqs = first.shape[0]
        on_host = not kernels.cuda_available(first)  # the torch twin reads lengths on the host
        return [
            (
                positions[j],
                AttentionMetadata(
                    slot_mapping=slots[j],
                    query_start_loc=self._sampling.rows,  # one query token per request
                    seq_lens=seq_lens[j],
                    block_tables=tables,
                    query_lens_cpu=[1] * num_seqs,
                    seq_lens_cpu=seq_lens[j].tolist() if on_host else [1] * num_seqs,
                    max_query_len=1,
                    max_seq_len=self.forward.max_seq_len,
                ),
            )
            for j in range(num_forwards)
        ]


@dataclass
class Drafts:
    token_ids: torch.Tensor  # [num_seqs, width] int32, -1 past each request's count
    num_drafts: torch.Tensor  # [num_seqs] int32
    num_context_tokens: int = 0
    """Tokens a host proposer took in that it had not seen (index updates): its cost grows with them."""
    parents: torch.Tensor | None = None  # [num_seqs, width] int32
    """Where the drafts are trees: each draft's parent node (0: the root, the newest token; draft j
    is node j + 1); None: chains (draft j's parent is node j)."""

    @classmethod
    def none(cls, num_seqs: int, device: torch.device) -> Drafts:
        return cls(
            torch.full((num_seqs, 1), -1, dtype=torch.int32, device=device),
            torch.zeros(num_seqs, dtype=torch.int32, device=device),
        )

    @classmethod
    def from_lists(cls, drafts: list[list[int]], num_context_tokens: int = 0) -> Drafts:
        width = max((len(d) for d in drafts), default=0) or 1
        rows = [d + [-1] * (width - len(d)) for d in drafts]
        token_ids = torch.tensor(rows, dtype=torch.int32).view(len(drafts), width)
        num_drafts = torch.tensor([len(d) for d in drafts], dtype=torch.int32)
        return cls(token_ids, num_drafts, num_context_tokens)


class Proposer:
    """Base of the draft methods; the lifecycle hooks matter to proposers with host state."""

    on_device = True
    """Runs in the step's tail on tensors (True) or on the host after the read-back (False)."""

    def propose(self, batch: DraftBatch) -> Drafts:
        raise NotImplementedError

    def start(self, seq: Sequence) -> None:
        """A request of this method joined."""

    def prepare(self, device_busy: Callable[[], bool]) -> None:
        """Host work that needs no step's result, done while `device_busy()` (the device runs a
        step and the host would only wait): stop soon after it turns False."""

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted."""

    def backlog(self, request_id: str) -> int:
        """Tokens of the request this proposer would take in at its next `propose` beyond those of
        the step before it (a host index's catch-up on tokens it has not seen)."""
        return 0
