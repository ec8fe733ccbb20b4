"""CUDA graphs of the engine step: the forward, then the whole tail, each replayed with one launch.

Eager decoding on a GPU is host-bound: a 16-layer model launches hundreds of kernels per step, each
costing more host time than device time. A CUDA graph records those launches once and replays them
with new tensor contents, so the step costs its device time.

A step replays two graphs:
1. the *forward*: the target model over the step's tokens (prefill chunks, each decoding request's
   last token and drafts) and the LM head over the rows that are sampled, keyed by (token bucket,
   query class);
2. the *tail* (services/engine/verify_update.py): verify + sample, the post-step update and the
   next step's drafting by every device proposer — n-gram matching, the MTP or EAGLE-3 head's
   catch-up and chain, or the draft model's — keyed by (token bucket, query class, drafting-model chain
   length). The host then reads one packed tensor, the step's only synchronisation.

Query classes bound the longest query of a step: 1 (plain decode), 1 + num_speculative_tokens
(verification), with a draft tree its node count at each depth it can be cut at, and a prefill
class (chunks of any length that fits the largest bucket), so a step that carries prefill chunks — a
burst of new prompts, or chunks beside decoding requests, most steps of a busy server — is replayed
too. On a server that drafts trees every graph is a tree step's: the forward attends with each
token's tree mask (causal for tokens of no tree) and the tail verifies by the tree rule, compacting
the accepted paths' KV (services/engine/tree_verify.py); the masks and parent arrays are inputs.
The attention kernel launches one block per query tile of the step (tiles numbered densely, not a
grid of every sequence times the longest query), so a prefill class costs what its tokens cost.

A graph replays fixed shapes and fixed pointers. So:
- inputs live in static buffers sized for the largest bucket, all in one allocation with a host
  twin of the same layout (`StagedInputs`): a step writes the twin and moves it in one copy;
- outputs (final hidden states, float32 logits) land in one persistent buffer, each graph writing
  its leading rows; what a capture allocates is a temporary of the shared graph pool;
- the grammar masks of a step's rows are a persistent input too: the host fills them while the
  forward's replay runs and copies them in before the tail's;
- a step's tokens are padded up to the next bucket: padding tokens form one-token sequences of
  context 1 over block 0 that write no KV (slot -1), the grid's remaining sequences are empty;
  logit rows are padded up to the bucket's row count with one-row padding requests on the input
  batch's scratch slot, so every row stays finite and no real request sees them;
- the attention kernel's launch shape is fixed at capture from the bounds `max_query_len` and
  `max_model_len` (AttentionMetadata); the per-sequence lengths come from the buffers at replay;
- a step launched ahead (services/engine/run_ahead.py) is completed on the device by the forward
  graph's first kernel, which reads how many tokens to complete from an input buffer (0 in any
  other step, where it does nothing), so that step too is one copy and two replays.

Steps with more tokens than the largest bucket (`cuda_graph_max_tokens`) run the same code eagerly;
the tail is replayed only when the fused kernel verifies every request (no penalties, min_tokens
suppression or logprobs), and otherwise runs eagerly after the forward's replay.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import kernels
from kernels import AttentionMetadata
from kernels.attention_ref import CAUSAL_MASK
from kernels.verify_ref import num_mask_words
from services.engine.input_batch import InputBatch
from services.engine.prompt_logprobs import PromptRows
from services.engine.spec_decode.proposer import ForwardContext
from services.engine.verify_update import StepPlan, StepTensors, VerifyAndUpdate
from shared.model.llama import KVCache, LlamaForCausalLM

logger = logging.getLogger(__name__)

BUCKETS = (
    1,
    2,
    4,
    8,
    12,
    16,
    24,
    32,
    48,
    64,
    96,
    128,
    160,
    192,
    256,
    320,
    384,
    448,
    512,
    640,
    768,
    1024,
    1280,
    1536,
    2048,
    3072,
    4096,
    6144,
    8192,
)
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
    masked_rows: np.ndarray  # [num_rows] int32 1: the row's request follows a grammar
    cu_num_rows: np.ndarray  # [num_sampled + 1] int32
    seq_slots: np.ndarray  # [num_sampled] int64
    seq_rows: np.ndarray  # [num_sampled] int64 index among the step's sequences
    num_output: np.ndarray  # [num_sampled] int64 output tokens before the step (host only; 0 ahead)
    seq_methods: np.ndarray  # [num_sampled] int32
    num_wanted: np.ndarray  # [num_sampled] int32
    max_seq_len: int
    """A bound on every context length this step and its drafting reach."""
    prompt_rows: PromptRows | None = None
    """Forward rows that score prompt tokens (requests that asked for prompt logprobs)."""
    tree_mask: np.ndarray | None = None
    """[num_tokens] int64 tree-attention masks (`AttentionMetadata.tree_mask`) where a request
    verifies a draft tree; None: every query is causal."""
    tree_parents: np.ndarray | None = None
    """[num_sampled, max_rows] int64 each request's parent array over its rows (a chain: j - 1;
    -1 at the root and past the rows), where the step verifies trees."""
    ahead: bool = False
    """A step launched ahead (services/engine/run_ahead.py): its tokens' ids, positions and KV
    slots, its rows' output positions and drafts and its context lengths are completed on the
    device (`StepTensors.complete_ahead`); here they are placeholders, and `num_output` is not known."""

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def max_rows(self) -> int:
        """The most logit rows of one request."""
        return int(np.diff(self.cu_num_rows).max(initial=1))

    @property
    def has_grammar(self) -> bool:
        """Whether a row of the step is masked by its request's grammar."""
        return bool(self.masked_rows.any())

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
        small = [self.query_lens, self.seq_lens, self.draft_ids, self.request_of_row, self.masked_rows]
        small += [self.cu_num_rows, self.seq_methods, self.num_wanted, self.block_tables.ravel()]
        longs, int32s = _upload(ints, np.int64, device), _upload(small, np.int32, device)
        (input_ids, positions, slot_mapping, token_slots, logits_indices) = longs[:5]
        row_slots, row_positions, seq_slots, seq_rows = longs[5:]
        query_lens, seq_lens, draft_ids, request_of_row, masked_rows = int32s[:5]
        cu_num_rows, seq_methods, num_wanted = int32s[5:8]
        query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32, device=device)
        torch.cumsum(query_lens, 0, out=query_start_loc[1:])
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=int32s[8].view(self.block_tables.shape),
            query_lens_cpu=self.query_lens.tolist(),
            seq_lens_cpu=self.seq_lens.tolist(),
            # the attention kernel's bound, which the host's lengths are not before the completion
            max_seq_len=self.max_seq_len if self.ahead else None,
        )
        if self.tree_mask is not None:
            meta.tree_mask = torch.from_numpy(self.tree_mask).to(device, non_blocking=True)
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
            masked_rows=masked_rows,
            max_rows=self.max_rows,
        )
        if self.tree_parents is not None:
            tensors.tree_parents = torch.from_numpy(self.tree_parents).to(device, non_blocking=True)
        return logits_indices, tensors


def _upload(arrays: list[np.ndarray], dtype: type, device: torch.device) -> list[torch.Tensor]:
    """The arrays as `dtype` tensors on `device`, moved in one copy."""
    flat = torch.from_numpy(np.concatenate([a.astype(dtype, copy=False).ravel() for a in arrays]))
    moved = flat.to(device, non_blocking=True)
    sizes = [a.size for a in arrays]
    return list(moved.split(sizes))


class StagedInputs:
    """Input buffers of the graphs laid out in one device allocation, with a host twin of the same
    layout (pinned on a GPU). A step writes the twin, then one asynchronous copy moves its leading
    bytes: the last buffer's leading rows and every buffer before it (each host copy costs the host
    far more than its bytes cost the device). The twin is the only source of the device's contents
    after start-up, so copying a buffer whole equals copying the part a step wrote."""

    ALIGN = 256
    """Bytes each buffer's start is aligned to."""

    def __init__(self, specs: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device):
        offsets, end = [], 0
        for shape, dtype in specs:
            offsets.append(end)
            end += -(-int(np.prod(shape)) * dtype.itemsize // self.ALIGN) * self.ALIGN
        self._device = torch.zeros(end, dtype=torch.uint8, device=device)
        self._host = torch.zeros(end, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self._offsets = offsets
        self.buffers = self._views(self._device, specs)
        self.twins = self._views(self._host, specs)
        self.arrays = [twin.numpy() for twin in self.twins]
        """The twins as numpy arrays (what a step writes)."""
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._recorded = False

    def _views(
        self, flat: torch.Tensor, specs: list[tuple[tuple[int, ...], torch.dtype]]
    ) -> list[torch.Tensor]:
        views = []
        for offset, (shape, dtype) in zip(self._offsets, specs):
            size = int(np.prod(shape)) * dtype.itemsize
            views.append(flat[offset : offset + size].view(dtype).view(shape))
        return views

    def sync_twins(self) -> None:
        """The twins take the buffers' contents (after the buffers were initialised on the device)."""
        self._host.copy_(self._device)

    def wait(self) -> None:
        """Waits until the last copy has read the twins, before they are written again."""
        if self._copied is not None and self._recorded:
            self._copied.synchronize()

    def copy(self, last_rows: int) -> None:
        """Moves every buffer but the last whole, and the last one's leading `last_rows` rows."""
        last = self.twins[-1]
        end = self._offsets[-1] + last_rows * last[0].numel() * last.element_size()
        self._device[:end].copy_(self._host[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
            self._recorded = True


class DecodeGraphs:
    """Captured steps of one model over its KV caches: forward graphs looked up by (tokens, query
    class), tail graphs by (tokens, query class, chain length, the proposer run alone or None)."""

    LONG_FIELDS = (
        "input_ids",
        "positions",
        "slot_mapping",
        "token_slots",
        "logits_indices",
        "row_slots",
        "row_positions",
        "seq_slots",
        "seq_rows",
    )
    INT_FIELDS = ("draft_ids", "request_of_row", "masked_rows", "seq_methods", "num_wanted")

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[KVCache],
        tail: VerifyAndUpdate,
        inputs: InputBatch,
        max_tokens: int,
        query_lens: list[int],
        chain_lengths: list[int],
        onlys: list[int | None],
        max_model_len: int,
        block_size: int,
        max_num_seqs: int | None = None,
        aux_layers: tuple[int, ...] = (),
        trees: bool = False,
    ):
        """`max_tokens`: the largest bucket; `query_lens`: the query classes to capture (1, 1 +
        num_speculative_tokens when drafting, a draft tree's sizes, and a prefill class);
        `chain_lengths`: the drafting-model chain lengths a tail may run (0 when none); `onlys`: the values of
        `StepPlan.only` steps come with (None: every device proposer); `max_num_seqs`: the most
        requests of a step (None: one per token), which bounds each class's buckets and the
        logit rows of a step (each request brings at most 1 + num_speculative_tokens);
        `aux_layers`: the target layers whose entering streams the forward keeps (the EAGLE-3 head's);
        `trees`: steps verify draft trees (`HostStep.tree_mask` and `tree_parents` given)."""
        self.model = model
        self.aux_layers = aux_layers
        self.kv_caches = kv_caches
        self.tail = tail
        self.inputs = inputs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.buckets = [b for b in BUCKETS if b < max_tokens] + [max_tokens]
        self.query_lens = sorted(set(query_lens))
        self.chain_lengths = sorted(set(chain_lengths))
        self.onlys = onlys
        self.max_num_seqs = max_num_seqs if max_num_seqs is not None else max_tokens
        self.rows_per_seq = 1 + inputs.max_num_drafts
        device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        size = self.buckets[-1]
        max_blocks = -(-(max_model_len + inputs.max_num_drafts + 1) // block_size)
        self.trees = trees
        parents_size = self.num_rows(size) * self.rows_per_seq if trees else 0
        self.staged = StagedInputs(
            [
                ((len(self.LONG_FIELDS), size), torch.long),
                ((len(self.INT_FIELDS), size), torch.int32),
                ((size + 1,), torch.int32),
                ((size + 1,), torch.int32),
                ((size,), torch.int32),
                ((size if trees else 0,), torch.long),
                ((parents_size,), torch.long),
                ((1,), torch.int32),
                ((size, max_blocks), torch.int32),  # last: a step copies only its bucket's rows
            ],
            device,
        )
        (
            self.longs,
            self.ints,
            self.query_start_loc,
            self.cu_num_rows,
            self.seq_lens,
            self.tree_mask,
            self.tree_parents,
            self.num_ahead,
            self.block_tables,
        ) = self.staged.buffers
        """`tree_mask`: each token's tree-attention mask (`AttentionMetadata.tree_mask`), where
        `trees`; `tree_parents`: each request's parent array over its rows, [num_rows(bucket),
        max_rows(query class)] in its leading entries (`StepTensors.tree_parents`), where `trees`;
        `num_ahead`: [1] the tokens of a step launched ahead, which the forward completes first
        (0: a step the host described whole)."""
        self.query_start_loc.copy_(torch.arange(size + 1))
        self.cu_num_rows.copy_(torch.arange(size + 1))
        self.seq_lens.fill_(1)
        self.tree_mask.fill_(CAUSAL_MASK)
        self.tree_parents.fill_(-1)
        self._pad_all()
        self.staged.sync_twins()
        longs, ints = self.staged.arrays[:2]
        self._twin_fields = {name: longs[i] for i, name in enumerate(self.LONG_FIELDS)}
        self._twin_fields |= {name: ints[i] for i, name in enumerate(self.INT_FIELDS)}
        """Each field's row of the host twins, by name."""
        self.hidden = torch.zeros(size, model.config.hidden_size, dtype=dtype, device=device)
        aux_size = len(aux_layers) * model.config.hidden_size
        self.aux_hidden = torch.zeros(size, aux_size, dtype=dtype, device=device) if aux_layers else None
        self.logits = torch.zeros(
            self.num_rows(size), model.config.vocab_size, dtype=torch.float32, device=device
        )
        self.bitmask = torch.full(
            (self.num_rows(size), num_mask_words(model.config.vocab_size)),
            -1,
            dtype=torch.int32,
            device=device,
        )
        """The grammar masks of the step's rows (read where `masked_rows` is 1)."""
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.tails: dict[tuple[int, int, int, int | None], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0
        self.num_tail_replays = 0
        self.num_mixed_replays = 0
        """Replays of steps that carried a prefill chunk."""
        self._host_lens: tuple[list[int], list[int]] | None = None
        """The last step's padded query and context lengths, where the attention's torch twin runs."""

    def buckets_of(self, query_len: int) -> list[int]:
        """The token buckets captured for a query class: as many tokens as its requests can bring."""
        cap = min(self.max_num_seqs * query_len, self.buckets[-1])
        return [b for b in self.buckets if b < cap] + [cap]

    def num_rows(self, bucket: int) -> int:
        """Logit rows (and tail requests) of a bucket: every row a request could bring, padded."""
        return min(bucket, self.max_num_seqs * self.rows_per_seq)

    def max_rows(self, query_len: int) -> int:
        """The most logit rows of one request in a query class."""
        return min(query_len, self.rows_per_seq)

    @property
    def max_decode_tokens(self) -> int:
        """Tokens of the largest graph of a decode step (each request its last token and drafts):
        what drafts are trimmed to."""
        return min(self.max_num_seqs * self.rows_per_seq, self.max_tokens)

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
        self.field("logits_indices").copy_(torch.arange(self.max_tokens))
        self.field("seq_rows").copy_(torch.arange(self.max_tokens))

    def shapes(self) -> list[tuple[int, int]]:
        """Every (bucket, query class) captured, largest bucket first."""
        shapes = [(bucket, q) for q in self.query_lens for bucket in self.buckets_of(q)]
        return sorted(shapes, key=lambda shape: (-shape[0], shape[1]))

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every shape, largest first so smaller graphs reuse its memory."""
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        try:
            for bucket, query_len in self.shapes():
                forward = functools.partial(self._forward, bucket, query_len)
                self.graphs[bucket, query_len] = self._capture(forward, pool)
                for chain, only in itertools.product(self.chain_lengths, self.onlys):
                    packed: list[torch.Tensor] = []
                    plan = StepPlan([], [], chain, only=only)
                    tail = functools.partial(self._tail, bucket, query_len, plan, packed)
                    self.tails[bucket, query_len, chain, only] = (self._capture(tail, pool), packed[-1])
        except BaseException:
            self.release()  # the graphs captured so far hold the group's communicator (`release`)
            raise
        torch.cuda.synchronize()
        logger.info(
            "captured %d CUDA graphs (tokens %s, query classes %s, chains %s) in %.1f s",
            len(self.graphs) + len(self.tails),
            self.buckets,
            self.query_lens,
            self.chain_lengths,
            time.perf_counter() - started,
        )

    def release(self) -> None:
        """Destroys every captured graph. Before a tensor-parallel rank leaves its group: NCCL does
        not destroy a communicator while a graph that captured its collectives lives, so leaving
        first would wait for the graphs, and the communicator's teardown would run in the leaving
        thread whenever they are freed, a later capture in this process perhaps (whose global
        capture mode that thread's CUDA calls invalidate)."""
        if self.hidden.is_cuda:  # no replay in flight
            torch.cuda.synchronize(self.hidden.device)
        for graph in [*self.graphs.values(), *(graph for graph, _ in self.tails.values())]:
            graph.reset()
        self.graphs.clear()
        self.tails.clear()

    @staticmethod
    def _capture(run: Callable[[], None], pool: Any) -> torch.cuda.CUDAGraph:
        run()  # warm-up: compiles kernels and creates library handles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            run()
        return graph

    def tensors(self, bucket: int, query_len: int) -> StepTensors:
        """Views of the static buffers as one bucket's step: its tokens, its padded logit rows and
        tail requests. (The lengths on the host matter only to the attention's torch twin, which
        runs these shapes on a CPU in tests.)"""
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
            tree_mask=self.tree_mask[:bucket] if self.trees else None,
        )
        forward = ForwardContext(
            self.field("input_ids")[:bucket],
            self.field("positions")[:bucket],
            meta,
            self.hidden[:bucket],
            self.field("token_slots")[:bucket],
            self.max_model_len,
            None if self.aux_hidden is None else self.aux_hidden[:bucket],
        )
        rows = self.num_rows(bucket)
        return StepTensors(
            forward=forward,
            row_slots=self.field("row_slots")[:rows],
            row_positions=self.field("row_positions")[:rows],
            draft_ids=self.field("draft_ids")[:rows],
            request_of_row=self.field("request_of_row")[:rows],
            cu_num_rows=self.cu_num_rows[: rows + 1],
            seq_slots=self.field("seq_slots")[:rows],
            seq_rows=self.field("seq_rows")[:rows],
            seq_methods=self.field("seq_methods")[:rows],
            num_wanted=self.field("num_wanted")[:rows],
            masked_rows=self.field("masked_rows")[:rows],
            max_rows=self.max_rows(query_len),
            bitmask=self.bitmask[:rows],
            tree_parents=self._parents(rows, query_len) if self.trees else None,
        )

    def _parents(self, rows: int, query_len: int) -> torch.Tensor:
        """[rows, max_rows(query_len)] the parent arrays of a bucket's requests (leading entries)."""
        width = self.max_rows(query_len)
        return self.tree_parents[: rows * width].view(rows, width)

    def _forward(self, bucket: int, query_len: int) -> None:
        """Into the persistent outputs: what the model allocates is a temporary of the capture.
        A step launched ahead is completed first, so its replay needs no launch before it."""
        tensors = self.tensors(bucket, query_len)
        self._complete_ahead(tensors, bucket)
        forward = tensors.forward
        args = (forward.input_ids, forward.positions, self.kv_caches, forward.meta)
        if self.aux_hidden is None:
            hidden = self.model(*args)
        else:
            hidden, aux_hidden = self.model.forward_with_aux(*args, self.aux_layers)
            self.aux_hidden[:bucket].copy_(aux_hidden)
        self.hidden[:bucket].copy_(hidden)
        rows = self.num_rows(bucket)
        logits_indices = self.field("logits_indices")[:rows]
        self.model.compute_logits(hidden[logits_indices], out=self.logits[:rows])

    def _complete_ahead(self, tensors: StepTensors, bucket: int) -> None:
        """Completes the leading `num_ahead` tokens of the bucket on the device (none but in a step
        launched ahead)."""
        tensors.complete_ahead(self.inputs, self.block_size, self.num_ahead)
        if self._host_lens is not None:  # the attention's torch twin in the tail reads the completed lengths
            self._host_lens = (self._host_lens[0], self.seq_lens[:bucket].tolist())

    def _tail(self, bucket: int, query_len: int, plan: StepPlan, packed: list[torch.Tensor]) -> None:
        """The tail over the forward's outputs; its packed result is appended to `packed`."""
        rows = self.num_rows(bucket)
        packed.append(self.tail(self.logits[:rows], self.tensors(bucket, query_len), plan))

    def lookup(self, num_tokens: int, longest_query: int) -> tuple[int, int] | None:
        """The (bucket, query class) that fits this step, or None (run it eagerly)."""
        query_class = next((q for q in self.query_lens if q >= longest_query), None)
        if query_class is None:
            return None
        bucket = next((b for b in self.buckets_of(query_class) if b >= num_tokens), None)
        if bucket is None:
            return None
        return bucket, query_class

    def replay_forward(self, step: HostStep, key: tuple[int, int]) -> None:
        """Copies the step in and replays its forward (which completes a step launched ahead
        first): its final hidden states land in `self.hidden`, the logits of its rows in
        `self.logits`, in the step's row order."""
        bucket, query_len = key
        self._copy_in(step, bucket, query_len)
        self.graphs[key].replay()
        self.num_replays += 1
        self.num_mixed_replays += not step.is_decode

    def fill_outputs(self, forward: ForwardContext) -> None:
        """Points an eager tail's forward at the replayed forward's outputs (its leading rows)."""
        num_tokens = forward.input_ids.shape[0]
        forward.hidden = self.hidden[:num_tokens]
        forward.aux_hidden = None if self.aux_hidden is None else self.aux_hidden[:num_tokens]

    def chain_key(self, num_steps: int) -> int:
        """The captured chain length a step that needs `num_steps` replays: the shortest that is
        as long (a longer chain drafts no more than each request wants, and writes no KV past it)."""
        return next(length for length in self.chain_lengths if length >= num_steps)

    def replay_tail(self, step: HostStep, key: tuple[int, int], plan: StepPlan) -> torch.Tensor:
        """The tail of a step whose forward `replay_forward` replayed (its grammar rows' masks in
        `self.bitmask`); [num_sampled, width] int32 packed results of the real requests (a view of
        the tail's output, which the next replay overwrites)."""
        graph, packed = self.tails[(*key, self.chain_key(plan.num_steps), plan.only)]
        graph.replay()
        self.num_tail_replays += 1
        return packed[: len(step.seq_slots)]

    def _copy_in(self, step: HostStep, bucket: int, query_len: int) -> None:
        """The step padded to `bucket`: padding tokens are one-token sequences of context 1 over
        block 0 writing no KV (causal, where steps verify trees); padding rows are one-row requests
        on the scratch slot (a root alone); the rest of the grid is empty. Written into the host
        twins, then copied in one copy."""
        if (step.tree_mask is not None, step.tree_parents is not None) != (self.trees, self.trees):
            raise ValueError(f"the step's tree inputs do not fit graphs captured with trees={self.trees}")
        num_tokens, num_seqs = step.num_tokens, len(step.query_lens)
        num_rows, num_sampled = len(step.logits_indices), len(step.seq_slots)
        rows = self.num_rows(bucket)
        num_pad, num_pad_rows = bucket - num_tokens, rows - num_rows
        scratch = self.inputs.scratch_slot
        self.staged.wait()
        _, _, starts, cu_num_rows, seq_lens, masks, parents, num_ahead, tables = self.staged.arrays

        def fill(name: str, values: np.ndarray, padding: int | np.ndarray) -> None:
            """A field's leading entries from the step, the rest of the bucket padding."""
            row = self._twin_fields[name]
            row[: len(values)], row[len(values) : bucket] = values, padding

        for name, value in (
            ("input_ids", 0),
            ("positions", 0),
            ("slot_mapping", -1),
            ("token_slots", scratch),
        ):
            fill(name, getattr(step, name), value)
        for name, value in (
            ("logits_indices", 0),
            ("row_slots", scratch),
            ("row_positions", 0),
            ("draft_ids", -1),
            ("masked_rows", 0),
        ):
            fill(name, getattr(step, name), value)
        fill("request_of_row", step.request_of_row, np.arange(num_sampled, num_sampled + bucket - num_rows))
        for name, value in (("seq_slots", scratch), ("seq_methods", -1), ("num_wanted", 0)):
            fill(name, getattr(step, name), value)
        fill(
            "seq_rows",
            step.seq_rows,
            np.minimum(np.arange(num_seqs, num_seqs + bucket - num_sampled), bucket - 1),
        )
        cu_num_rows[: num_sampled + 1] = step.cu_num_rows
        cu_num_rows[num_sampled + 1 : num_sampled + 1 + num_pad_rows] = num_rows + np.arange(
            1, num_pad_rows + 1
        )
        cu_num_rows[num_sampled + 1 + num_pad_rows : rows + 1] = rows
        query_lens = np.zeros(bucket, dtype=np.int32)
        query_lens[:num_seqs], query_lens[num_seqs : num_seqs + num_pad] = step.query_lens, 1
        seq_lens[:num_seqs], seq_lens[num_seqs : num_seqs + num_pad] = step.seq_lens, 1
        seq_lens[num_seqs + num_pad : bucket] = 0
        num_ahead[0] = num_tokens if step.ahead else 0
        starts[0] = 0
        np.cumsum(query_lens, out=starts[1 : bucket + 1])
        if not kernels.cuda_available(self.longs):
            self._host_lens = (query_lens.tolist(), seq_lens[:bucket].tolist())
        width = step.block_tables.shape[1]
        tables[:num_seqs, :width] = step.block_tables
        tables[num_seqs:bucket, :width] = 0
        if step.tree_mask is not None and step.tree_parents is not None:
            masks[:num_tokens], masks[num_tokens:bucket] = step.tree_mask, CAUSAL_MASK
            num_parents = rows * self.max_rows(query_len)
            parents[:num_parents] = -1
            step_rows = step.tree_parents.shape[1]
            parents[:num_parents].reshape(rows, -1)[:num_sampled, :step_rows] = step.tree_parents
        self.staged.copy(last_rows=bucket)
