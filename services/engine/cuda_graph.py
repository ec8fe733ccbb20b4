"""CUDA graphs of the decode step: the forward, then the whole tail, each replayed with one launch.

Eager decoding on a GPU is host-bound: a 16-layer model launches hundreds of kernels per step, each
costing more host time than device time. A CUDA graph records those launches once and replays them
with new tensor contents, so the step costs its device time.

A decode step replays two graphs:
1. the *forward*: the target model over the step's tokens (each request's last token and drafts)
   and the LM head, keyed by (token bucket, longest query);
2. the *tail* (services/engine/verify_update.py): verify + sample, the post-step update and the
   next step's drafting by every device proposer — n-gram matching, the MTP head's catch-up and
   chain, or the draft model's — keyed by (token bucket, longest query, drafting-model chain
   length). The host then reads one packed tensor, the step's only synchronisation.

A graph replays fixed shapes and fixed pointers. So:
- inputs live in static buffers sized for the largest bucket; a step copies its inputs in (two
  copies: the forward's and the tail's integers);
- outputs (final hidden states, float32 logits) land in one persistent buffer, each graph writing
  its leading rows; what a capture allocates is a temporary of the shared graph pool;
- a step's tokens are padded up to the next bucket: padding tokens form one-token sequences of
  context 1 over block 0 that write no KV (slot -1), the grid's remaining sequences are empty, and
  padding requests use the input batch's scratch slot, so every row stays finite and no real
  request sees them;
- the attention kernel's launch shape is fixed at capture from the bounds `max_query_len` and
  `max_model_len` (AttentionMetadata); the per-sequence lengths come from the buffers at replay.

Only decode steps are replayed (every scheduled sequence brings its last token and its drafts),
and the tail only when the fused kernel verifies every request (no penalties, min_tokens
suppression or logprobs); other steps run the same code eagerly.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import kernels
from kernels import AttentionMetadata
from services.engine.input_batch import InputBatch
from services.engine.spec_decode.proposer import ForwardContext
from services.engine.verify_update import StepPlan, StepTensors, VerifyAndUpdate
from shared.model.llama import KVCache, LlamaForCausalLM

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 1024)
"""Token counts a graph is captured for (those up to the configured maximum)."""


@dataclass
class HostStep:
    """A step's inputs on the host, flat over its sequences (each brings `query_lens[i]` tokens)
    and over the logit rows of the sequences that get a token."""

    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    token_slots: np.ndarray  # [num_tokens] int64 input-batch slot of each token's request
    query_lens: np.ndarray  # [num_seqs] int32
    seq_lens: np.ndarray  # [num_seqs] int32 context length after this step's tokens
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32, 0 padded
    logits_indices: np.ndarray  # [num_rows] int64 tokens that reach the LM head
    row_slots: np.ndarray  # [num_rows] int64
    row_positions: np.ndarray  # [num_rows] int64 output position each row samples
    draft_ids: np.ndarray  # [num_rows] int32, -1 on bonus rows
    request_of_row: np.ndarray  # [num_rows] int32
    cu_num_rows: np.ndarray  # [num_sampled + 1] int32
    seq_slots: np.ndarray  # [num_sampled] int64
    seq_rows: np.ndarray  # [num_sampled] int64 index among the step's sequences
    seq_methods: np.ndarray  # [num_sampled] int32
    num_wanted: np.ndarray  # [num_sampled] int32
    max_seq_len: int
    """A bound on every context length this step and its drafting reach."""

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def max_rows(self) -> int:
        """The most logit rows of one request."""
        return int(np.diff(self.cu_num_rows).max(initial=1))

    @property
    def is_decode(self) -> bool:
        """Every token is scored: each sequence brings only its last token and its drafts."""
        return len(self.logits_indices) == self.num_tokens > 0

    def to_device(self, device: torch.device, hidden_size: int) -> tuple[torch.Tensor, StepTensors]:
        """(input ids, the step's device tensors) for an eager step; the forward's hidden states
        are filled in once computed. Integers travel in one copy."""
        ints = [
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.token_slots,
            self.logits_indices,
            self.row_slots,
            self.row_positions,
            self.seq_slots,
            self.seq_rows,
        ]
        small = [self.query_lens, self.seq_lens, self.draft_ids, self.request_of_row]
        small += [self.cu_num_rows, self.seq_methods, self.num_wanted, self.block_tables.ravel()]
        longs, int32s = _upload(ints, np.int64, device), _upload(small, np.int32, device)
        (input_ids, positions, slot_mapping, token_slots, logits_indices) = longs[:5]
        row_slots, row_positions, seq_slots, seq_rows = longs[5:]
        query_lens, seq_lens, draft_ids, request_of_row, cu_num_rows, seq_methods, num_wanted = int32s[:7]
        query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32, device=device)
        torch.cumsum(query_lens, 0, out=query_start_loc[1:])
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=int32s[7].view(self.block_tables.shape),
            query_lens_cpu=self.query_lens.tolist(),
            seq_lens_cpu=self.seq_lens.tolist(),
        )
        empty = torch.empty(0, hidden_size, device=device)
        forward = ForwardContext(input_ids, positions, meta, empty, token_slots, self.max_seq_len)
        tensors = StepTensors(
            forward=forward,
            row_slots=row_slots,
            row_positions=row_positions,
            draft_ids=draft_ids,
            request_of_row=request_of_row,
            cu_num_rows=cu_num_rows,
            seq_slots=seq_slots,
            seq_rows=seq_rows,
            seq_methods=seq_methods,
            num_wanted=num_wanted,
            max_rows=self.max_rows,
        )
        return logits_indices, tensors


def _upload(arrays: list[np.ndarray], dtype: type, device: torch.device) -> list[torch.Tensor]:
    """The arrays as `dtype` tensors on `device`, moved in one copy."""
    flat = torch.from_numpy(np.concatenate([a.astype(dtype, copy=False).ravel() for a in arrays]))
    moved = flat.to(device, non_blocking=True)
    sizes = [a.size for a in arrays]
    return list(moved.split(sizes))


class DecodeGraphs:
    """Captured decode steps of one model over its KV caches: forward graphs looked up by (tokens,
    longest query), tail graphs by (tokens, longest query, chain length)."""

    LONG_FIELDS = (
        "input_ids",
        "positions",
        "slot_mapping",
        "token_slots",
        "row_slots",
        "row_positions",
        "seq_slots",
    )
    INT_FIELDS = ("draft_ids", "request_of_row", "seq_methods", "num_wanted")

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[KVCache],
        tail: VerifyAndUpdate,
        inputs: InputBatch,
        max_tokens: int,
        query_lens: list[int],
        chain_lengths: list[int],
        max_model_len: int,
        block_size: int,
    ):
        """`max_tokens`: the largest bucket; `query_lens`: the longest-query classes to capture (1,
        and 1 + num_speculative_tokens when drafting); `chain_lengths`: the drafting-model chain
        lengths a tail may run (0 when none)."""
        self.model = model
        self.kv_caches = kv_caches
        self.tail = tail
        self.inputs = inputs
        self.max_model_len = max_model_len
        self.buckets = [b for b in BUCKETS if b < max_tokens] + [max_tokens]
        self.query_lens = sorted(set(query_lens))
        self.chain_lengths = sorted(set(chain_lengths))
        device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        size = self.buckets[-1]
        max_blocks = -(-(max_model_len + inputs.max_num_drafts + 1) // block_size)
        self.longs = torch.zeros(len(self.LONG_FIELDS), size, dtype=torch.long, device=device)
        self.ints = torch.zeros(len(self.INT_FIELDS), size, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(size, max_blocks, dtype=torch.int32, device=device)
        self.seq_index = torch.arange(size, dtype=torch.long, device=device)
        self._pad_all()
        self.hidden = torch.zeros(size, model.config.hidden_size, dtype=dtype, device=device)
        self.logits = torch.zeros(size, model.config.vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.tails: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0
        self.num_tail_replays = 0
        self._host_lens: tuple[list[int], list[int]] | None = None
        """The last step's padded query and context lengths, where the attention's torch twin runs."""

    def field(self, name: str) -> torch.Tensor:
        if name in self.LONG_FIELDS:
            return self.longs[self.LONG_FIELDS.index(name)]
        return self.ints[self.INT_FIELDS.index(name)]

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def _pad_all(self) -> None:
        """Every row and request padding: what the graphs are captured on."""
        scratch = self.inputs.scratch_slot
        for name in ("token_slots", "row_slots", "seq_slots"):
            self.field(name).fill_(scratch)
        self.field("slot_mapping").fill_(-1)
        self.field("draft_ids").fill_(-1)
        self.field("request_of_row").copy_(torch.arange(self.max_tokens, dtype=torch.int32))
        self.field("seq_methods").fill_(-1)

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every shape, largest first so smaller graphs reuse its memory."""
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for query_len in self.query_lens:
            for bucket in reversed(self.buckets):
                forward = functools.partial(self._forward, bucket, query_len)
                self.graphs[bucket, query_len] = self._capture(forward, pool)
                for chain in self.chain_lengths:
                    packed: list[torch.Tensor] = []
                    tail = functools.partial(self._tail, bucket, query_len, StepPlan([], [], chain), packed)
                    self.tails[bucket, query_len, chain] = (self._capture(tail, pool), packed[-1])
        torch.cuda.synchronize()
        logger.info(
            "captured %d CUDA graphs (tokens %s, longest query %s, chains %s) in %.1f s",
            len(self.graphs) + len(self.tails),
            self.buckets,
            self.query_lens,
            self.chain_lengths,
            time.perf_counter() - started,
        )

    @staticmethod
    def _capture(run: Callable[[], None], pool: Any) -> torch.cuda.CUDAGraph:
        run()  # warm-up: compiles kernels and creates library handles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            run()
        return graph

    def tensors(self, bucket: int, query_len: int) -> StepTensors:
        """Views of the static buffers as one bucket's step: every token a logit row, every grid
        sequence a request of the tail. (The lengths on the host matter only to the attention's
        torch twin, which runs these shapes on a CPU in tests.)"""
        query_lens, seq_lens = self._host_lens if self._host_lens is not None else ([1] * bucket,) * 2
        meta = AttentionMetadata(
            slot_mapping=self.field("slot_mapping")[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            query_lens_cpu=query_lens[:bucket],
            seq_lens_cpu=seq_lens[:bucket],
            max_query_len=query_len,
            max_seq_len=self.max_model_len,
        )
        forward = ForwardContext(
            self.field("input_ids")[:bucket],
            self.field("positions")[:bucket],
            meta,
            self.hidden[:bucket],
            self.field("token_slots")[:bucket],
            self.max_model_len,
        )
        return StepTensors(
            forward=forward,
            row_slots=self.field("row_slots")[:bucket],
            row_positions=self.field("row_positions")[:bucket],
            draft_ids=self.field("draft_ids")[:bucket],
            request_of_row=self.field("request_of_row")[:bucket],
            cu_num_rows=self.query_start_loc[: bucket + 1],
            seq_slots=self.field("seq_slots")[:bucket],
            seq_rows=self.seq_index[:bucket],
            seq_methods=self.field("seq_methods")[:bucket],
            num_wanted=self.field("num_wanted")[:bucket],
            max_rows=query_len,
        )

    def _forward(self, bucket: int, query_len: int) -> None:
        """Into the persistent outputs: what the model allocates is a temporary of the capture."""
        forward = self.tensors(bucket, query_len).forward
        hidden = self.model(forward.input_ids, forward.positions, self.kv_caches, forward.meta)
        self.hidden[:bucket].copy_(hidden)
        self.model.compute_logits(hidden, out=self.logits[:bucket])

    def _tail(self, bucket: int, query_len: int, plan: StepPlan, packed: list[torch.Tensor]) -> None:
        """The tail over the forward's outputs; its packed result is appended to `packed`."""
        packed.append(self.tail(self.logits[:bucket], self.tensors(bucket, query_len), plan))

    def lookup(self, num_tokens: int, longest_query: int) -> tuple[int, int] | None:
        """The (bucket, query class) that fits this step, or None (run it eagerly)."""
        bucket = next((b for b in self.buckets if b >= num_tokens), None)
        query_class = next((q for q in self.query_lens if q >= longest_query), None)
        if bucket is None or query_class is None:
            return None
        return bucket, query_class

    def replay_forward(self, step: HostStep, key: tuple[int, int]) -> StepTensors:
        """Copies the step in and replays its forward; the views of its bucket (the logits in
        `self.logits`) for a tail run eagerly."""
        bucket, query_len = key
        self._copy_in(step, bucket)
        self.graphs[key].replay()
        self.num_replays += 1
        return self.tensors(bucket, query_len)

    def replay(self, step: HostStep, key: tuple[int, int], plan: StepPlan) -> torch.Tensor:
        """Forward and tail; [num_seqs, width] int32 packed results of the real requests (a view
        of the tail's output, which the next replay overwrites)."""
        self.replay_forward(step, key)
        graph, packed = self.tails[(*key, plan.num_steps)]
        graph.replay()
        self.num_tail_replays += 1
        return packed[: len(step.query_lens)]

    def _copy_in(self, step: HostStep, bucket: int) -> None:
        """The step padded to `bucket`: padding tokens are one-token sequences of context 1 over
        block 0 writing no KV, padding requests use the scratch slot; the rest of the grid is empty."""
        num_tokens, num_seqs = step.num_tokens, len(step.query_lens)
        num_pad = bucket - num_tokens
        scratch = self.inputs.scratch_slot
        longs = np.empty((len(self.LONG_FIELDS), bucket), dtype=np.int64)
        for row, (name, value) in enumerate(
            (
                ("input_ids", 0),
                ("positions", 0),
                ("slot_mapping", -1),
                ("token_slots", scratch),
                ("row_slots", scratch),
                ("row_positions", 0),
            )
        ):
            longs[row, :num_tokens] = getattr(step, name)
            longs[row, num_tokens:] = value
        longs[6, :num_seqs] = step.seq_slots
        longs[6, num_seqs:] = scratch
        ints = np.empty((len(self.INT_FIELDS), bucket), dtype=np.int32)
        ints[0, :num_tokens], ints[0, num_tokens:] = step.draft_ids, -1
        ints[1, :num_tokens], ints[1, num_tokens:] = (
            step.request_of_row,
            np.arange(num_seqs, num_seqs + num_pad),
        )
        ints[2, :num_seqs], ints[2, num_seqs:] = step.seq_methods, -1
        ints[3, :num_seqs], ints[3, num_seqs:] = step.num_wanted, 0
        query_lens = np.zeros(bucket, dtype=np.int32)
        query_lens[:num_seqs], query_lens[num_seqs : num_seqs + num_pad] = step.query_lens, 1
        seq_lens = np.zeros(bucket, dtype=np.int32)
        seq_lens[:num_seqs], seq_lens[num_seqs : num_seqs + num_pad] = step.seq_lens, 1
        starts = np.zeros(bucket + 1, dtype=np.int32)
        np.cumsum(query_lens, out=starts[1:])
        if not kernels.cuda_available(self.longs):
            self._host_lens = (query_lens.tolist(), seq_lens.tolist())
        tables = np.zeros((bucket, step.block_tables.shape[1]), dtype=np.int32)
        tables[:num_seqs] = step.block_tables
        self.longs[:, :bucket].copy_(torch.from_numpy(longs), non_blocking=True)
        self.ints[:, :bucket].copy_(torch.from_numpy(ints), non_blocking=True)
        self.query_start_loc[: bucket + 1].copy_(torch.from_numpy(starts), non_blocking=True)
        self.seq_lens[:bucket].copy_(torch.from_numpy(seq_lens), non_blocking=True)
        self.block_tables[:bucket, : tables.shape[1]].copy_(torch.from_numpy(tables), non_blocking=True)
