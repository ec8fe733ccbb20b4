"""CUDA graphs of the decode step: the target forward and the LM head replayed with one launch.

Eager decoding on a GPU is host-bound: a 16-layer model launches ~900 kernels per step, each
costing more host time than device time. A CUDA graph records those launches once and replays them
with new tensor contents, so the step costs its device time (kernels/NOTES.md: 12.5 ms eager vs
2.3 ms replayed for a Llama-3.2-1B shape at batch 1).

A graph replays fixed shapes and fixed pointers. So:
- inputs live in static buffers sized for the largest batch; a step copies its inputs in;
- graphs are bucketed by the step's token count (each sequence brings 1 + k tokens: its last
  token and its drafts), padded up to the next bucket, and by the longest query (1 for plain decode,
  1 + num_speculative_tokens with drafts), which sets the attention kernel's tiling;
- padding tokens form one-token sequences of context 1 over block 0 that write no KV (slot -1), so
  every row stays finite and no real sequence sees them; the attention grid covers one sequence per
  token of the bucket, and the sequences past the padding have empty queries and exit at once;
- the attention kernel's launch shape (query tiles, context splits) is fixed at capture from the
  bounds `max_query_len` and `max_model_len` (AttentionMetadata), the per-sequence lengths come
  from the buffers at replay.

Only decode steps are replayed: every scheduled sequence has all its new tokens scored (its last
token and its drafts). Steps with prefill chunks, and batches past the largest bucket, run eagerly.

Each bucket has a second, *tail* graph replayed right after the forward when every request of the
step can be verified by the fused kernel (no penalties, no min_tokens suppression, no logprobs, no
draft distributions): verify + accept + sample over the forward's logits, then, for n-gram
speculation, the emitted tokens are appended to each request's row of the device token history and
the next step's drafts are matched there. The host then reads one small tensor (emitted tokens,
accepted counts, drafts) — the step's only synchronisation. Other steps verify eagerly after the
forward replay (the torch path for what the kernel does not do).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from kernels import AttentionMetadata, TokenHistory
from services.engine.rejection_sampler import RowSampling
from shared.model.llama import KVCache, LlamaForCausalLM

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 1024)
"""Token counts a graph is captured for (those up to the configured maximum)."""


@dataclass
class HostBatch:
    """A step's inputs on the host, flat over its sequences (each brings `query_lens[i]` tokens)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    """Context length of each sequence after this step's tokens."""
    block_tables: list[list[int]]
    logits_indices: list[int]
    """Rows of the flat batch that reach the LM head."""

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_decode(self) -> bool:
        """Every token is scored: each sequence brings only its last token and its drafts."""
        return len(self.logits_indices) == self.num_tokens > 0


@dataclass
class PaddedInputs:
    """A decode batch padded to a bucket: host tensors ready to copy into the static buffers."""

    input_ids: torch.Tensor  # [bucket] int64
    positions: torch.Tensor  # [bucket] int64
    slot_mapping: torch.Tensor  # [bucket] int64, -1 for padding
    query_start_loc: torch.Tensor  # [bucket + 1] int32
    seq_lens: torch.Tensor  # [bucket] int32
    block_tables: torch.Tensor  # [bucket, max_blocks_in_batch] int32
    query_lens: list[int]
    """Per grid sequence (real, padding, empty): what the reference attention needs."""


@dataclass
class TailSpec:
    """What the tail graphs do after the forward: verify with this strategy / policy (ids of
    kernels.verify_ref), and with `history`, match n-gram drafts of up to `num_drafts` tokens."""

    strategy: int
    policy: int
    history: TokenHistory | None = None
    min_n: int = 1
    max_n: int = 1
    num_drafts: int = 0


@dataclass
class TailInputs:
    """Per-row sampling inputs and per-sequence history rows of a step verified in the tail graph."""

    sampling: RowSampling
    history_rows: list[int]
    """Per sequence: its row of the token history (n-gram speculation), else unused."""
    history_lens: list[int]
    """Per sequence: its tokens (prompt + output, no drafts) already in that row."""
    num_drafts: list[int]
    """Per sequence: the most n-gram drafts to match for its next step (0: none)."""


@dataclass
class TailOutput:
    token_ids: list[int]
    """Accepted drafts and the recovered / bonus token."""
    num_accepted: int
    drafts: list[int]
    """The next step's n-gram drafts, matched after appending `token_ids` (empty without n-gram)."""


def pad_decode_batch(batch: HostBatch, bucket: int) -> PaddedInputs:
    """The batch's tokens followed by `bucket - num_tokens` padding tokens, each its own sequence
    of context 1 over block 0 writing no KV; the grid's remaining sequences are empty."""
    num_pad = bucket - batch.num_tokens
    assert num_pad >= 0, f"{batch.num_tokens} tokens do not fit bucket {bucket}"
    num_seqs = len(batch.query_lens)
    num_empty = bucket - num_seqs - num_pad
    query_lens = batch.query_lens + [1] * num_pad + [0] * num_empty
    seq_lens = batch.seq_lens + [1] * num_pad + [0] * num_empty
    width = max(len(t) for t in batch.block_tables)
    tables = torch.zeros(bucket, width, dtype=torch.int32)
    for i, table in enumerate(batch.block_tables):
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
    starts = torch.zeros(bucket + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    return PaddedInputs(
        input_ids=torch.tensor(batch.input_ids + [0] * num_pad, dtype=torch.long),
        positions=torch.tensor(batch.positions + [0] * num_pad, dtype=torch.long),
        slot_mapping=torch.tensor(batch.slots + [-1] * num_pad, dtype=torch.long),
        query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        query_lens=query_lens,
    )


class DecodeGraphs:
    """Captured decode steps of one model over its KV caches, looked up by (tokens, longest query)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[KVCache],
        max_tokens: int,
        query_lens: list[int],
        max_model_len: int,
        block_size: int,
        tail: TailSpec | None = None,
    ):
        """`max_tokens`: the largest bucket; `query_lens`: the longest-query classes to capture
        (1, and 1 + num_speculative_tokens when drafting); `tail`: also capture tail graphs."""
        self.model = model
        self.tail = tail
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.buckets = [b for b in BUCKETS if b < max_tokens] + [max_tokens]
        self.query_lens = sorted(set(query_lens))
        device = next(model.parameters()).device
        size = self.buckets[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(size, max_blocks, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.tails: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0
        self.num_tail_replays = 0
        # tail inputs: per row (token) sampling parameters, per sequence history rows
        self.temperature = torch.zeros(size, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(size, dtype=torch.int32, device=device)
        self.top_p = torch.ones(size, dtype=torch.float32, device=device)
        self.min_p = torch.zeros(size, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(size, dtype=torch.long, device=device)
        self.sample_positions = torch.zeros(size, dtype=torch.long, device=device)
        self.draft_ids = torch.full((size,), -1, dtype=torch.int32, device=device)
        self.request_of_row = torch.arange(size, dtype=torch.int32, device=device)
        self.history_rows = torch.zeros(size, dtype=torch.long, device=device)
        self.history_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self.num_drafts = torch.zeros(size, dtype=torch.int32, device=device)
        self._keep_alive: list[torch.Tensor] = []
        """Scratch buffers of the kernels (their inter-block counters) that the graphs point at."""

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every (bucket, query class), largest first so smaller graphs reuse its memory."""
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for query_len in self.query_lens:
            for bucket in reversed(self.buckets):
                self.graphs[bucket, query_len] = self._capture(bucket, query_len, pool)
                if self.tail is not None:
                    self.tails[bucket, query_len] = self._capture_tail(bucket, query_len, pool)
        torch.cuda.synchronize()
        logger.info(
            "captured %d CUDA graphs (tokens %s, longest query %s) in %.1f s",
            len(self.graphs) + len(self.tails),
            self.buckets,
            self.query_lens,
            time.perf_counter() - started,
        )

    def _capture(
        self, bucket: int, query_len: int, pool: Any
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        meta = self._meta(bucket, query_len)
        self._forward(bucket, meta)  # warm-up: compiles kernels and creates library handles outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden, logits = self._forward(bucket, meta)
        return graph, hidden, logits

    def _capture_tail(
        self, bucket: int, query_len: int, pool: Any
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self._tail(bucket, query_len)  # warm-up, as for the forward
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            packed = self._tail(bucket, query_len)
        return graph, packed

    def _tail(self, bucket: int, query_len: int) -> torch.Tensor:
        """[bucket, 2 + query_len + num_drafts] int32: per grid sequence, the accepted count, the
        emitted tokens, the draft count and the drafts."""
        from kernels.ngram import _COUNTERS as NGRAM_COUNTERS
        from kernels.ngram import ngram_match_cuda
        from kernels.verify import _counters, verify_sample_cuda

        assert self.tail is not None
        _, logits = self.graphs[bucket, query_len][1:]
        token_ids, num_accepted, *_ = verify_sample_cuda(
            logits,
            self.temperature[:bucket],
            self.top_k[:bucket],
            self.top_p[:bucket],
            self.min_p[:bucket],
            self.seeds[:bucket],
            self.sample_positions[:bucket],
            self.draft_ids[:bucket],
            self.query_start_loc[: bucket + 1],  # in a decode step every token is a logit row
            self.tail.strategy,
            self.tail.policy,
            max_rows=query_len,
            request_of_row=self.request_of_row[:bucket],
        )
        self._keep_alive.append(_counters(bucket, logits.device))
        parts = [num_accepted[:, None], token_ids]
        history = self.tail.history
        if history is not None and self.tail.num_drafts > 0:
            rows = self.history_rows[:bucket]
            lens = self.history_lens[:bucket]
            emitted = num_accepted + 1
            offsets = torch.arange(query_len, device=logits.device)
            cols = (lens[:, None] + offsets[None, :]).long().clamp(max=history.tokens.shape[1] - 1)
            rows2d = rows[:, None].expand(-1, query_len)
            current = history.tokens[rows2d, cols]
            history.tokens[rows2d, cols] = torch.where(
                offsets[None, :] < emitted[:, None], token_ids, current
            )
            drafts, num_drafts = ngram_match_cuda(
                history.tokens,
                (lens + emitted).to(torch.int32),
                self.tail.min_n,
                self.tail.max_n,
                self.num_drafts[:bucket],
                max_k=self.tail.num_drafts,
                row_ids=rows,
            )
            self._keep_alive.append(NGRAM_COUNTERS[logits.device])
            parts += [num_drafts[:, None], drafts]
        return torch.cat(parts, dim=1)

    def _meta(self, bucket: int, query_len: int) -> AttentionMetadata:
        """Views of the static buffers; the host lists describe the all-padding capture batch and
        the bounds fix the launch shape for every replay."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            query_lens_cpu=[1] * bucket,
            seq_lens_cpu=[1] * bucket,
            max_query_len=query_len,
            max_seq_len=self.max_model_len,
        )

    def _forward(self, bucket: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, meta)
        return hidden, self.model.compute_logits(hidden)

    def lookup(self, num_tokens: int, longest_query: int) -> tuple[int, int] | None:
        """The (bucket, query class) that fits this step, or None (run it eagerly)."""
        bucket = next((b for b in self.buckets if b >= num_tokens), None)
        query_class = next((q for q in self.query_lens if q >= longest_query), None)
        if bucket is None or query_class is None:
            return None
        return bucket, query_class

    def replay(self, batch: HostBatch, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies the batch into the buffers and replays; returns (hidden, logits) of its real
        tokens, [num_tokens, hidden_size] and [num_tokens, vocab_size] float32. The logits are a
        view of graph memory the next replay overwrites (use them before then); the hidden states
        are copied out, as drafters keep them across steps."""
        bucket, _ = key
        padded = pad_decode_batch(batch, bucket)
        self.input_ids[:bucket].copy_(padded.input_ids, non_blocking=True)
        self.positions[:bucket].copy_(padded.positions, non_blocking=True)
        self.slot_mapping[:bucket].copy_(padded.slot_mapping, non_blocking=True)
        self.query_start_loc[: bucket + 1].copy_(padded.query_start_loc, non_blocking=True)
        self.seq_lens[:bucket].copy_(padded.seq_lens, non_blocking=True)
        self.block_tables[:bucket, : padded.block_tables.shape[1]].copy_(
            padded.block_tables, non_blocking=True
        )
        graph, hidden, logits = self.graphs[key]
        graph.replay()
        self.num_replays += 1
        return hidden[: batch.num_tokens].clone(), logits[: batch.num_tokens]

    def replay_tail(self, batch: HostBatch, key: tuple[int, int], rows: TailInputs) -> list[TailOutput]:
        """After `replay(batch, key)`: verifies, samples and (n-gram) drafts in the tail graph; one
        device-to-host read. Padding rows sample greedily and draft nothing."""
        bucket, query_len = key
        num_seqs, num_rows = len(batch.query_lens), batch.num_tokens
        pad_rows, pad_seqs = bucket - num_rows, bucket - num_seqs
        request_of_row = [i for i, n in enumerate(batch.query_lens) for _ in range(n)]
        request_of_row += range(num_seqs, num_seqs + pad_rows)
        sampling = rows.sampling
        floats = torch.tensor(
            sampling.temperature
            + [0.0] * pad_rows
            + sampling.top_p
            + [1.0] * pad_rows
            + sampling.min_p
            + [0.0] * pad_rows,
            dtype=torch.float32,
        )
        ints = torch.tensor(
            sampling.top_k + [0] * pad_rows + sampling.draft_ids + [-1] * pad_rows + request_of_row,
            dtype=torch.int32,
        )
        longs = torch.tensor(
            sampling.seeds + [0] * pad_rows + sampling.positions + [0] * pad_rows, dtype=torch.long
        )
        self.temperature[:bucket].copy_(floats[:bucket], non_blocking=True)
        self.top_p[:bucket].copy_(floats[bucket : 2 * bucket], non_blocking=True)
        self.min_p[:bucket].copy_(floats[2 * bucket :], non_blocking=True)
        self.top_k[:bucket].copy_(ints[:bucket], non_blocking=True)
        self.draft_ids[:bucket].copy_(ints[bucket : 2 * bucket], non_blocking=True)
        self.request_of_row[:bucket].copy_(ints[2 * bucket :], non_blocking=True)
        self.seeds[:bucket].copy_(longs[:bucket], non_blocking=True)
        self.sample_positions[:bucket].copy_(longs[bucket:], non_blocking=True)
        history = self.tail.history if self.tail is not None else None
        if history is not None:
            scratch = history.tokens.shape[0] - 1
            self.history_rows[:bucket].copy_(
                torch.tensor(rows.history_rows + [scratch] * pad_seqs, dtype=torch.long), non_blocking=True
            )
            per_seq = torch.tensor(
                rows.history_lens + [0] * pad_seqs + rows.num_drafts + [0] * pad_seqs, dtype=torch.int32
            )
            self.history_lens[:bucket].copy_(per_seq[:bucket], non_blocking=True)
            self.num_drafts[:bucket].copy_(per_seq[bucket:], non_blocking=True)
        graph, packed = self.tails[key]
        graph.replay()
        self.num_tail_replays += 1
        outputs = []
        for row in packed[:num_seqs].tolist():
            accepted = row[0]
            drafts: list[int] = []
            if len(row) > 1 + query_len:
                count = row[1 + query_len]
                drafts = row[2 + query_len : 2 + query_len + count]
            outputs.append(TailOutput(row[1 : accepted + 2], accepted, drafts))
        return outputs
