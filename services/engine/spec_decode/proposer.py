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

    @classmethod
    def on_host(cls, inputs: InputBatch, seqs: list[Sequence], num_wanted: list[int]) -> DraftBatch:
        """A batch for host proposers, which read the requests' token lists and `num_wanted_cpu`."""
        none = torch.empty(0, dtype=torch.long)
        return cls(inputs, seqs, none, none, none.int(), num_wanted, 0, None)

    def sample(self, logits: torch.Tensor, num_before: int) -> torch.Tensor:
        """[num_seqs] int64: each request's draft number `num_before` from a drafting model's
        logits ([num_seqs, vocab_size] float32), sampled with the noise the target's verification
        will use at that output position, so that the target's own sample decides acceptance."""
        return self._sampling.sample(logits, num_before)

    @functools.cached_property
    def _sampling(self) -> DraftSampling:
        return DraftSampling.gather(self.inputs, self.seq_slots)

    @functools.cached_property
    def _tables(self) -> torch.Tensor:  # [num_seqs, max_blocks] each request's block table
        assert self.forward is not None
        return self.forward.meta.block_tables[self.seq_rows]

    def chain_inputs(
        self, positions: torch.Tensor, step: int, block_size: int
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """Positions and attention metadata of one chained drafting forward: one new token per
        request at `positions` ([num_seqs] int64), over the request's blocks. Requests that want at
        most `step` drafts (their blocks may not reach that far) sit at position 0, write no KV
        and attend to one key: their rows are not used."""
        assert self.forward is not None
        tables = self._tables
        drafting = self.num_wanted > step
        positions = torch.where(drafting, positions, 0)
        blocks = tables.gather(1, (positions // block_size)[:, None])[:, 0].long()
        slots = torch.where(drafting, blocks * block_size + positions % block_size, -1)
        num_seqs = positions.shape[0]
        seq_lens = (positions + 1).int()
        on_host = not kernels.cuda_available(positions)  # the torch twin reads lengths on the host
        return positions, AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=self._sampling.rows,  # one query token per request
            seq_lens=seq_lens,
            block_tables=tables,
            query_lens_cpu=[1] * num_seqs,
            seq_lens_cpu=seq_lens.tolist() if on_host else [1] * num_seqs,
            max_query_len=1,
            max_seq_len=self.forward.max_seq_len,
        )


@dataclass
class Drafts:
    token_ids: torch.Tensor  # [num_seqs, width] int32, -1 past each request's count
    num_drafts: torch.Tensor  # [num_seqs] int32
    num_context_tokens: int = 0
    """Tokens a host proposer took in that it had not seen (index updates): its cost grows with them."""

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

    def append(self, seq: Sequence, token_ids: list[int]) -> None:
        """The request kept `token_ids` this step (already in `seq.token_ids`)."""

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted."""
