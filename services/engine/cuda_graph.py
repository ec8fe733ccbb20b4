"""CUDA graphs of the decode step: the target forward and the LM head replayed with one launch.

Eager decoding on a GPU is host-bound: a 16-layer model launches ~900 kernels per step, each
costing more host time than device time. A CUDA graph records those launches once and replays them
with new tensor contents, so the step costs its device time (kernels/NOTES.md: 12.5 ms eager vs
2.3 ms replayed for a Llama-3.2-1B shape at batch 1).

A graph replays fixed shapes and fixed pointers. So:
- inputs live in static buffers sized for the largest batch; a step copies its inputs in;
- outputs (final hidden states, float32 logits) land in one persistent buffer sized for the largest
  batch, each graph writing its leading rows; what a capture allocates is a temporary, so the shared
  graph pool holds one capture's temporaries rather than every bucket's logits;
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
draft distributions) and its EOS and stop ids fit the tail's buffers:
1. verify + accept + sample over the forward's logits (kernels/verify.py);
2. the post-step update (`post_step`, kernels/post_step.py): the emitted tokens are appended to each
   request's row of the device token history up to the first token that ends the request (EOS,
   a stop id, max_tokens, once min_tokens is reached), so no token past a stop is kept;
3. for n-gram speculation, the next step's drafts of each request still running are matched in
   that history (kernels/ngram.py), up to the request's max_k: the per-request adaptive k stays on
   the host, which cuts them when it proposes.
The host then reads one small tensor (per request: accepted count, kept tokens, finish reason, stop
token, drafts) -- the step's only synchronisation -- and takes the finish reason as given; only stop
strings, which are text, are looked for on the host. Other steps verify eagerly (the torch path for
what the kernel does not do) and then run the same `post_step` through `kernels.post_step_update`
(the CUDA kernel, or its torch twin on CPU), so both paths keep the same tokens and stop alike.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import kernels
from kernels import AttentionMetadata, TokenHistory
from kernels.post_step_ref import LENGTH, RUNNING, STOP
from services.engine.rejection_sampler import RowSampling, VerifyResult
from services.engine.sequence import FinishReason, Sequence, TokenLogprobs
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
    kernels.verify_ref), apply the post-step update, and with `history`, match n-gram drafts of up
    to `num_drafts` tokens."""

    strategy: int
    policy: int
    history: TokenHistory | None = None
    min_n: int = 1
    max_n: int = 1
    num_drafts: int = 0
    max_eos_ids: int = 8
    """EOS ids of one request the tail's buffers hold (a step with more is verified eagerly)."""
    max_stop_ids: int = 16
    """Stop token ids of one request the tail's buffers hold (likewise)."""


UNLIMITED = 2**31 - 1
"""max_tokens of padding sequences: they never stop."""


@dataclass
class StopInputs:
    """Per sequence, what the post-step update checks its emitted tokens against
    (kernels/post_step_ref.py); the tail graph and the eager path pack them the same way."""

    num_output: list[int]
    """Tokens generated before this step."""
    max_tokens: list[int]
    min_tokens: list[int]
    ignore_eos: list[bool]
    eos_ids: list[frozenset[int]]
    stop_ids: list[frozenset[int]]

    @classmethod
    def of(cls, seqs: list[Sequence]) -> StopInputs:
        return cls(
            num_output=[seq.num_output_tokens for seq in seqs],
            max_tokens=[seq.params.max_tokens for seq in seqs],
            min_tokens=[seq.params.min_tokens for seq in seqs],
            ignore_eos=[seq.params.ignore_eos for seq in seqs],
            eos_ids=[seq.eos_token_ids for seq in seqs],
            stop_ids=[frozenset(seq.params.stop_token_ids) for seq in seqs],
        )

    def widths(self) -> tuple[int, int]:
        """The most EOS ids and the most stop ids of one sequence (at least 1 each)."""
        return max(map(len, self.eos_ids), default=0) or 1, max(map(len, self.stop_ids), default=0) or 1

    def tensors(
        self, num_seqs: int, eos_width: int, stop_width: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host int32 tensors for `num_seqs` sequences (those past the real ones are padding that
        never stops): limits [4, num_seqs] (num_output, max_tokens, min_tokens, ignore_eos), then
        eos_ids [num_seqs, eos_width] and stop_ids [num_seqs, stop_width] padded with -1."""
        pad = num_seqs - len(self.num_output)
        limits = [
            self.num_output + [0] * pad,
            self.max_tokens + [UNLIMITED] * pad,
            self.min_tokens + [0] * pad,
            [int(flag) for flag in self.ignore_eos] + [1] * pad,
        ]
        return (
            torch.from_numpy(np.array(limits, dtype=np.int32)),
            _padded(self.eos_ids, num_seqs, eos_width),
            _padded(self.stop_ids, num_seqs, stop_width),
        )


def _padded(id_sets: list[frozenset[int]], num_rows: int, width: int) -> torch.Tensor:
    """[num_rows, width] int32, each row's ids then -1. Rows are filled per distinct set (a batch
    has few: one EOS set, a handful of stop sets), not one by one: this runs every step."""
    out = np.full((num_rows, width), -1, dtype=np.int32)
    members: dict[frozenset[int], list[int]] = {}
    for i, ids in enumerate(id_sets):
        if ids:
            members.setdefault(ids, []).append(i)
    for ids, indices in members.items():
        out[indices, : len(ids)] = sorted(ids)
    return torch.from_numpy(out)


@dataclass
class TailInputs:
    """Per-row sampling inputs, per-sequence stop inputs and history rows of a step verified in the
    tail graph."""

    sampling: RowSampling
    stops: StopInputs
    history_rows: list[int]
    """Per sequence: its row of the token history (n-gram speculation), else the scratch row."""
    history_lens: list[int]
    """Per sequence: its tokens (prompt + output, no drafts) already in that row (0 on scratch)."""
    num_drafts: list[int]
    """Per sequence: the most n-gram drafts to match for its next step (0: none)."""


ACCEPTED, KEPT, FINISH, STOP_TOKEN, TOKENS = range(5)
"""Columns of `post_step`'s packed result, the emitted tokens from TOKENS on."""


@dataclass
class TailOutput:
    """One sequence's share of a verified step after the post-step update: what the tail graph
    reads back, and what the eager path gets from the same `post_step`."""

    token_ids: list[int]
    """Accepted drafts and the recovered / bonus token, cut after the token that ends the request."""
    num_accepted: int
    """Drafts that verification accepted (a stop may keep fewer of them)."""
    finish_reason: FinishReason | None = None
    """STOP (EOS or a stop id) or LENGTH (max_tokens) at the last kept token; None: running."""
    stop_token_id: int | None = None
    """The stop id that ended the request (None for an EOS, max_tokens or running)."""
    drafts: list[int] = field(default_factory=list)
    """The next step's n-gram drafts, matched after the kept tokens (tail graph with n-gram only)."""
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    """Per kept token, when the request asked for them (eager path only)."""

    @classmethod
    def unpack(cls, row: list[int], width: int) -> TailOutput:
        """One row of `post_step`'s packed result for `width` emitted-token columns, followed in the
        tail graph's read-back by the draft count and the drafts."""
        end = TOKENS + width
        return cls(
            token_ids=row[TOKENS : TOKENS + row[KEPT]],
            num_accepted=row[ACCEPTED],
            finish_reason={STOP: FinishReason.STOP, LENGTH: FinishReason.LENGTH}.get(row[FINISH]),
            stop_token_id=row[STOP_TOKEN] if row[STOP_TOKEN] >= 0 else None,
            drafts=row[end + 1 : end + 1 + row[end]] if len(row) > end else [],
        )


def post_step(
    token_ids: torch.Tensor,  # [num_seqs, width] int32: accepted drafts, the recovered / bonus token, -1s
    num_accepted: torch.Tensor,  # [num_seqs] int32
    limits: torch.Tensor,  # [4, num_seqs] int32 (StopInputs.tensors); its num_output row is updated
    eos_ids: torch.Tensor,  # [num_seqs, max_eos] int32
    stop_ids: torch.Tensor,  # [num_seqs, max_stop] int32
    rows: torch.Tensor,  # [num_rows, capacity] int32 token rows the kept tokens are appended to
    row_ids: torch.Tensor | None,  # [num_seqs] int64 row of each sequence; None: sequence i is row i
    lengths: torch.Tensor,  # [num_seqs] int32 tokens in each sequence's row, updated
) -> torch.Tensor:  # [num_seqs, TOKENS + width] int32: the columns above, then the emitted tokens
    """The post-step update of a verified step, the same in the tail graph and on the eager path:
    `kernels.post_step_update` keeps each sequence's emitted tokens up to the one that ends it."""
    num_kept, finish, stop_token = kernels.post_step_update(
        rows,
        row_ids,
        lengths,
        limits[0],
        token_ids,
        num_accepted + 1,
        limits[1],
        limits[2],
        limits[3],
        eos_ids,
        stop_ids,
    )
    return torch.cat([torch.stack([num_accepted, num_kept, finish, stop_token], dim=1), token_ids], dim=1)


def eager_post_step(results: list[VerifyResult], stops: StopInputs, device: torch.device) -> list[TailOutput]:
    """The tail graph's post-step update run on an eager verifier's tokens: the same `post_step`
    (the CUDA kernel on a GPU, its torch twin on CPU), so both paths keep the same tokens and stop
    alike. The token rows are scratch: the proposers keep their own histories in step."""
    num_seqs, width = len(results), max(len(r.token_ids) for r in results)
    host = [
        torch.tensor([r.token_ids + [-1] * (width - len(r.token_ids)) for r in results], dtype=torch.int32),
        torch.tensor([r.num_accepted for r in results], dtype=torch.int32),
        *stops.tensors(num_seqs, *stops.widths()),
    ]
    token_ids, num_accepted, limits, eos_ids, stop_ids = (t.to(device, non_blocking=True) for t in host)
    scratch = torch.empty(num_seqs, width, dtype=torch.int32, device=device)
    lengths = torch.zeros(num_seqs, dtype=torch.int32, device=device)
    packed = post_step(token_ids, num_accepted, limits, eos_ids, stop_ids, scratch, None, lengths)
    outputs = [TailOutput.unpack(row, width) for row in packed.tolist()]
    for out, result in zip(outputs, results):
        out.logprobs = result.logprobs[: len(out.token_ids)]
    return outputs


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
    tables = np.zeros((bucket, width), dtype=np.int32)  # numpy: one fill per row, no tensor per row
    for i, table in enumerate(batch.block_tables):
        tables[i, : len(table)] = table
    starts = np.zeros(bucket + 1, dtype=np.int32)
    np.cumsum(query_lens, out=starts[1:])
    return PaddedInputs(
        input_ids=torch.from_numpy(np.array(batch.input_ids + [0] * num_pad, dtype=np.int64)),
        positions=torch.from_numpy(np.array(batch.positions + [0] * num_pad, dtype=np.int64)),
        slot_mapping=torch.from_numpy(np.array(batch.slots + [-1] * num_pad, dtype=np.int64)),
        query_start_loc=torch.from_numpy(starts),
        seq_lens=torch.from_numpy(np.array(seq_lens, dtype=np.int32)),
        block_tables=torch.from_numpy(tables),
        query_lens=query_lens,
    )


class DecodeGraphs:
    """Captured decode steps of one model over its KV caches, looked up by (tokens, longest query)."""

    SEQ_FIELDS = 6
    """Per-sequence int32 tail inputs besides the EOS / stop ids: history length, drafts to match,
    then StopInputs' four limits."""

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
        dtype = next(model.parameters()).dtype
        size = self.buckets[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(size, max_blocks, dtype=torch.int32, device=device)
        # outputs: every graph writes its leading rows (one buffer, not one per graph)
        self.hidden = torch.zeros(size, model.config.hidden_size, dtype=dtype, device=device)
        self.logits = torch.zeros(size, model.config.vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.tails: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0
        self.num_tail_replays = 0
        # tail inputs: per row (token) sampling parameters, per sequence history rows and the int32
        # inputs of `_seq_inputs`, back to back so that one copy fills them
        self.temperature = torch.zeros(size, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(size, dtype=torch.int32, device=device)
        self.top_p = torch.ones(size, dtype=torch.float32, device=device)
        self.min_p = torch.zeros(size, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(size, dtype=torch.long, device=device)
        self.sample_positions = torch.zeros(size, dtype=torch.long, device=device)
        self.draft_ids = torch.full((size,), -1, dtype=torch.int32, device=device)
        self.request_of_row = torch.arange(size, dtype=torch.int32, device=device)
        self.max_eos_ids = tail.max_eos_ids if tail is not None else 1
        self.max_stop_ids = tail.max_stop_ids if tail is not None else 1
        self.seq_ints = torch.zeros(
            size * (self.SEQ_FIELDS + self.max_eos_ids + self.max_stop_ids), dtype=torch.int32, device=device
        )
        history = tail.history if tail is not None else None
        self.token_rows = (
            history.tokens
            if history is not None
            else torch.zeros(1, max(self.query_lens), dtype=torch.int32, device=device)
        )
        """What the post-step update appends kept tokens to: the token history, else a scratch row."""
        self.history_rows = torch.full((size,), self.scratch_row, dtype=torch.long, device=device)
        self._keep_alive: list[torch.Tensor] = []
        """Scratch buffers of the kernels (their inter-block counters) that the graphs point at."""

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    @property
    def scratch_row(self) -> int:
        """The row of `token_rows` that padding and requests without a history row write into."""
        return self.token_rows.shape[0] - 1

    def fits(self, stops: StopInputs) -> bool:
        """Whether the tail's buffers hold every sequence's EOS and stop ids."""
        num_eos, num_stop = stops.widths()
        return num_eos <= self.max_eos_ids and num_stop <= self.max_stop_ids

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

    def _capture(self, bucket: int, query_len: int, pool: Any) -> torch.cuda.CUDAGraph:
        meta = self._meta(bucket, query_len)
        self._forward(bucket, meta)  # warm-up: compiles kernels and creates library handles outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._forward(bucket, meta)
        return graph

    def _capture_tail(
        self, bucket: int, query_len: int, pool: Any
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self._tail(bucket, query_len)  # warm-up, as for the forward
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            packed = self._tail(bucket, query_len)
        return graph, packed

    def _seq_inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of a `bucket`-sequence step's int32 inputs, laid out back to back per bucket:
        [SEQ_FIELDS, bucket] (history length, drafts to match, then StopInputs' limits),
        eos ids [bucket, max_eos_ids], stop ids [bucket, max_stop_ids]."""
        fields, eos_end = self.SEQ_FIELDS * bucket, (self.SEQ_FIELDS + self.max_eos_ids) * bucket
        stop_end = eos_end + self.max_stop_ids * bucket
        return (
            self.seq_ints[:fields].view(self.SEQ_FIELDS, bucket),
            self.seq_ints[fields:eos_end].view(bucket, self.max_eos_ids),
            self.seq_ints[eos_end:stop_end].view(bucket, self.max_stop_ids),
        )

    def _tail(self, bucket: int, query_len: int) -> torch.Tensor:
        """[bucket, TOKENS + query_len] int32 per grid sequence: `post_step`'s packed result
        (accepted count, kept count, finish reason, stop token, emitted tokens); with n-gram
        drafting then the draft count and `num_drafts` drafts."""
        from kernels.ngram import ngram_match_cuda, scratch_counter
        from kernels.verify import scratch_counters, verify_sample_cuda

        assert self.tail is not None
        token_ids, num_accepted, *_ = verify_sample_cuda(
            self.logits[:bucket],
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
        self._keep_alive.append(scratch_counters(bucket, self.logits.device))
        per_seq, eos_ids, stop_ids = self._seq_inputs(bucket)
        history_lens, num_drafts, limits = per_seq[0], per_seq[1], per_seq[2:]
        rows = self.history_rows[:bucket]
        packed = post_step(
            token_ids, num_accepted, limits, eos_ids, stop_ids, self.token_rows, rows, history_lens
        )
        history = self.tail.history
        if history is None or self.tail.num_drafts == 0:
            return packed
        drafts, found = ngram_match_cuda(
            history.tokens,
            history_lens,  # now counting the kept tokens
            self.tail.min_n,
            self.tail.max_n,
            torch.where(packed[:, FINISH] == RUNNING, num_drafts, 0),  # finished requests draft nothing
            max_k=self.tail.num_drafts,
            row_ids=rows,
        )
        self._keep_alive.append(scratch_counter(self.logits.device))
        return torch.cat([packed, found[:, None], drafts], dim=1)

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

    def _forward(self, bucket: int, meta: AttentionMetadata) -> None:
        """Into the persistent outputs: what the model allocates is a temporary of the capture."""
        hidden = self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, meta)
        self.hidden[:bucket].copy_(hidden)
        self.model.compute_logits(hidden, out=self.logits[:bucket])

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
        view of the output buffer the next replay overwrites (use them before then); the hidden
        states are copied out, as drafters keep them across steps."""
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
        self.graphs[key].replay()
        self.num_replays += 1
        return self.hidden[: batch.num_tokens].clone(), self.logits[: batch.num_tokens]

    def replay_tail(self, batch: HostBatch, key: tuple[int, int], rows: TailInputs) -> list[TailOutput]:
        """After `replay(batch, key)`: verifies, samples, applies the post-step update and (n-gram)
        drafts in the tail graph; one device-to-host read. Padding rows sample greedily, never stop
        and draft nothing."""
        self.fill_tail(batch, key[0], rows)
        graph, packed = self.tails[key]
        graph.replay()
        self.num_tail_replays += 1
        return [TailOutput.unpack(row, key[1]) for row in packed[: len(batch.query_lens)].tolist()]

    def fill_tail(self, batch: HostBatch, bucket: int, rows: TailInputs) -> None:
        """Copies a step's tail inputs into the static buffers of its bucket."""
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
        self.history_rows[:bucket].copy_(
            torch.tensor(rows.history_rows + [self.scratch_row] * pad_seqs, dtype=torch.long),
            non_blocking=True,
        )
        history = torch.tensor(
            [rows.history_lens + [0] * pad_seqs, rows.num_drafts + [0] * pad_seqs], dtype=torch.int32
        )
        limits, eos_ids, stop_ids = rows.stops.tensors(bucket, self.max_eos_ids, self.max_stop_ids)
        per_seq = torch.cat([t.flatten() for t in (history, limits, eos_ids, stop_ids)])
        self.seq_ints[: per_seq.numel()].copy_(per_seq, non_blocking=True)
