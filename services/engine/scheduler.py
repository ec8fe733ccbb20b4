"""The worker's batch scheduler: continuous batching, chunked prefill, preemption by recompute.

Every step it spends a token budget first on running sequences, oldest first (a decode token or
the next prefill chunk each), then admits waiting sequences first-come-first-served. When the KV
cache cannot hold a running sequence's next tokens, the newest running sequence is preempted: its
blocks are freed and it goes back to the head of the queue, to be recomputed (prompt plus the
tokens it already produced) when room returns. Preemption never changes a greedy token.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.engine.block_manager import BlockManager
from services.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    """Tokens each sequence computes this step (1 for a decode, a chunk for a prefill)."""
    preempted: list[Sequence] = field(default_factory=list)
    """Running sequences sent back to the queue to make room (their KV is gone)."""

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_preempted(self) -> int:
        return len(self.preempted)

    @property
    def is_decode(self) -> bool:
        """Every sequence brings only its last token and its drafts: no prefill chunk."""
        return all(seq.num_uncomputed_tokens == 1 for seq in self.seqs)

    @property
    def sampled_seqs(self) -> list[Sequence]:
        """Sequences that get a token this step: their last real token is among the new ones."""
        return [
            seq
            for seq, num_new in zip(self.seqs, self.num_new_tokens)
            if seq.num_computed_tokens + num_new >= seq.num_tokens
        ]


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.decode_chunk_limit: int | None = None
        """The longest prefill chunk of a step that also decodes (None: the token budget): the
        CUDA graphs' prefill class, so that a busy server's steps replay from graphs (set by the
        engine once graphs are captured). A longer prompt takes one more step to prefill."""
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queues `seq` behind every waiting sequence that arrived before it (`queued_at`)."""
        position = len(self.waiting)
        while position > 0 and self.waiting[position - 1].queued_at > seq.queued_at:
            position -= 1
        self.waiting.insert(position, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting_tokens(self) -> int:
        return sum(seq.num_uncomputed_tokens for seq in self.waiting)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        chunk = self.max_num_batched_tokens
        decoding = any(seq.num_uncomputed_tokens == 1 for seq in self.running)
        if self.enable_chunked_prefill and self.decode_chunk_limit is not None and decoding:
            chunk = self.decode_chunk_limit
        budget = self._schedule_running(batch, self.max_num_batched_tokens, chunk)
        if batch.num_preempted == 0:
            self._admit_waiting(batch, budget, chunk)
        return batch

    def schedule_ahead(
        self, seqs: list[Sequence], num_new_tokens: list[int], num_extra: list[int], max_len: int
    ) -> ScheduledBatch | None:
        """The next decode step of every running request, `seqs`, scheduled while their step in
        flight still runs: each computes `num_new_tokens` (its newest token and its drafts' places)
        and gets KV blocks for `num_extra` more positions (what the step in flight may add and a
        drafting chain may write), up to `max_len` positions. None where the next step needs the
        host: a waiting request could be admitted, or the blocks or the token budget fall short
        (nothing is preempted ahead)."""
        if self.waiting and len(self.running) < self.max_num_seqs:
            return None
        num_running = sum(seq.finish_reason is None for seq in self.running)  # a stop string ended the rest
        if len(seqs) != num_running or sum(num_new_tokens) > self.max_num_batched_tokens:
            return None
        growth = [n + m for n, m in zip(num_new_tokens, num_extra)]
        if any(seq.num_computed_tokens + n > max_len for seq, n in zip(seqs, growth)):
            return None
        needed = sum(
            max(0, self.block_manager.blocks_needed(seq.num_computed_tokens + n) - len(seq.block_table))
            for seq, n in zip(seqs, growth)
        )
        if needed > self.block_manager.num_free_blocks:
            return None
        batch = ScheduledBatch()
        for seq, n, num_new in zip(seqs, growth, num_new_tokens):
            self.block_manager.append_slots(seq, n)
            batch.add(seq, num_new)
        return batch

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Ends `seq` and returns its blocks (full ones stay in the prefix cache)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def _schedule_running(self, batch: ScheduledBatch, budget: int, chunk: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_uncomputed = seq.num_uncomputed_tokens
            num_new = self._fit_drafts(
                seq, num_uncomputed, budget if num_uncomputed == 1 else min(budget, chunk)
            )
            if not self._make_room(seq, num_new, batch):
                break  # seq itself was preempted; everything after it already was
            self.block_manager.append_slots(seq, num_new)
            batch.add(seq, num_new)
            budget -= num_new
            i += 1
        return budget

    def _fit_drafts(self, seq: Sequence, num_uncomputed: int, budget: int) -> int:
        """Tokens `seq` computes this step: its `num_uncomputed` tokens plus the drafts that fit the
        budget and the free blocks (drafts are dropped before anyone is preempted)."""
        num_drafts = len(seq.spec.draft_token_ids)
        if num_drafts == 0:
            return min(num_uncomputed, budget)
        num_new = min(num_uncomputed + num_drafts, budget)
        if not self.block_manager.can_append(seq, num_new):
            num_new = min(num_uncomputed, budget)
        keep = max(0, num_new - num_uncomputed)
        if keep < num_drafts:
            drop_drafts(seq, keep)
        return num_new

    def _make_room(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> bool:
        """Preempts the newest running sequences until `seq` fits; False if `seq` itself went."""
        while not self.block_manager.can_append(seq, num_new):
            victim = self.running[-1]
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        drop_drafts(seq, 0)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _admit_waiting(self, batch: ScheduledBatch, budget: int, chunk: int) -> None:
        while budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self._next_to_admit(batch)
            if seq is None:
                break
            cached = self.block_manager.match_prefix(seq)
            remaining = seq.num_tokens - len(cached) * self.block_manager.block_size
            num_new = min(remaining, budget, chunk)
            if num_new < remaining and not self.enable_chunked_prefill:
                break
            if not self.block_manager.can_allocate(seq, num_new, cached):
                break
            self.waiting.remove(seq)
            self.block_manager.allocate(seq, cached)
            self.block_manager.append_slots(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, num_new)
            budget -= num_new

    def _next_to_admit(self, batch: ScheduledBatch) -> Sequence | None:
        """The longest-waiting request whose grammar, if it has one, is compiled. One whose grammar
        is still compiling stays behind the others (the step that samples it would wait for the
        compile), unless nothing else would run."""
        for seq in self.waiting:
            if seq.grammar is None or seq.grammar.is_compiled:
                return seq
        if self.waiting and not self.running and batch.is_empty:
            return self.waiting[0]
        return None


def drop_drafts(seq: Sequence, keep: int) -> None:
    """Keeps the first `keep` drafts of `seq`."""
    seq.spec.draft_token_ids = seq.spec.draft_token_ids[:keep]
