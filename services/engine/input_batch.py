"""The running requests' state on the device, one *slot* per request, updated by deltas.

A request takes a free slot when the scheduler first runs it and gives it back when it finishes or
is preempted (vLLM v1's `InputBatch` does the same). Per slot the device holds:

- the token row: prompt and output tokens so far (what n-gram drafting matches in, what the MTP
  head and the draft model read their next input from), appended on the device by the post-step
  update, never re-sent;
- the sampling parameters and stop conditions the fused verify and post-step kernels read;
- the drafts proposed for the request's next step (and, where they are trees, their parents).

The host writes a slot only when a request joins (its tokens and parameters); a step then names
its requests by slot, so the per-step host work is independent of the requests' lengths and
parameters. The last slot is *scratch*: padding rows of a CUDA-graph step point at it. Under tensor
parallelism every rank holds the same slots: rank 0 decides them and sends each join (`SlotJoin`)
with the next step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from services.engine.sequence import Sequence

MAX_EOS_IDS = 8
"""EOS ids one request's slot holds (a request with more is verified on the eager path)."""
MAX_STOP_IDS = 16
"""Stop token ids one request's slot holds (likewise)."""
UNLIMITED = 2**31 - 1
"""max_tokens of the scratch slot: padding never stops."""


def fused_from(seq: Sequence) -> int:
    """The output count from which the fused verify kernel alone samples the request's rows: its
    min_tokens (until then the torch sampler suppresses its EOS and stop ids), or never (UNLIMITED)
    where its logits change before sampling (penalties, logit bias), it asks for logprobs or its
    stop ids do not fit a slot. A grammar's mask is one of the kernel's inputs."""
    p = seq.params
    if p.has_penalties or p.logit_bias or p.logprobs is not None or not InputBatch.fits(seq):
        return UNLIMITED
    return p.min_tokens


@dataclass
class SlotParams:
    """Host mirrors of the per-slot parameters, [num_slots + 1] each (scratch last)."""

    temperature: np.ndarray  # float32, 0 on greedy requests
    top_p: np.ndarray  # float32
    min_p: np.ndarray  # float32
    top_k: np.ndarray  # int32, 0: off
    max_tokens: np.ndarray  # int32
    min_tokens: np.ndarray  # int32
    ignore_eos: np.ndarray  # int32 0 / 1
    eos_ids: np.ndarray  # int32 [num_slots + 1, MAX_EOS_IDS], -1 padded
    stop_ids: np.ndarray  # int32 [num_slots + 1, MAX_STOP_IDS], -1 padded
    seeds: np.ndarray  # int64

    @classmethod
    def empty(cls, num_rows: int) -> SlotParams:
        return cls(
            temperature=np.zeros(num_rows, np.float32),
            top_p=np.ones(num_rows, np.float32),
            min_p=np.zeros(num_rows, np.float32),
            top_k=np.zeros(num_rows, np.int32),
            max_tokens=np.full(num_rows, UNLIMITED, np.int32),
            min_tokens=np.zeros(num_rows, np.int32),
            ignore_eos=np.ones(num_rows, np.int32),
            eos_ids=np.full((num_rows, MAX_EOS_IDS), -1, np.int32),
            stop_ids=np.full((num_rows, MAX_STOP_IDS), -1, np.int32),
            seeds=np.zeros(num_rows, np.int64),
        )

    def write(self, slot: int, seq: Sequence) -> None:
        p = seq.params
        self.temperature[slot] = 0.0 if p.greedy else p.temperature
        self.top_p[slot], self.min_p[slot], self.top_k[slot] = p.top_p, p.min_p, max(p.top_k, 0)
        self.max_tokens[slot], self.min_tokens[slot] = p.max_tokens, p.min_tokens
        self.ignore_eos[slot] = int(p.ignore_eos)
        self.eos_ids[slot] = -1
        self.stop_ids[slot] = -1
        eos = sorted(seq.eos_token_ids)[:MAX_EOS_IDS]
        stops = sorted(set(p.stop_token_ids))[:MAX_STOP_IDS]
        self.eos_ids[slot, : len(eos)] = eos
        self.stop_ids[slot, : len(stops)] = stops
        self.seeds[slot] = seq.seed

    def row(self, slot: int) -> dict[str, np.ndarray]:
        """Every parameter of one slot (copies)."""
        return {f.name: np.array(getattr(self, f.name)[slot]) for f in dataclasses.fields(self)}

    def set_row(self, slot: int, row: dict[str, np.ndarray]) -> None:
        for name, value in row.items():
            getattr(self, name)[slot] = value


class SlotBlockTables:
    """Host copies of the running requests' block tables by slot, each extended by the blocks its
    request took since the last step, so that a step reads the blocks it has not seen rather than
    every block of every request. A request's table only grows while it holds its slot (freeing
    its blocks gives the slot back)."""

    def __init__(self, num_rows: int):
        self.tables = np.zeros((num_rows, 0), dtype=np.int32)
        self.num_blocks = [0] * num_rows

    def reset(self, slot: int) -> None:
        """A request takes the slot: its row starts empty."""
        self.tables[slot] = 0
        self.num_blocks[slot] = 0

    def rows(self, seqs: list[Sequence], slots: list[int]) -> np.ndarray:
        """[num_seqs, most blocks of one] int32: the block tables of `seqs`, in `slots`, 0 padded
        (a loop of few operations a request: it runs every step)."""
        width, known = 0, self.num_blocks
        for seq, slot in zip(seqs, slots):
            num_blocks = len(seq.block_table)
            if num_blocks != known[slot]:
                self._update(slot, seq.block_table)
            if num_blocks > width:
                width = num_blocks
        return self.tables[slots, :width]

    def _update(self, slot: int, block_table: list[int]) -> None:
        """The slot's row takes the blocks its request took since the last step."""
        num_blocks, known = len(block_table), self.num_blocks[slot]
        if num_blocks > self.tables.shape[1]:
            extra = max(num_blocks, 2 * self.tables.shape[1]) - self.tables.shape[1]
            self.tables = np.pad(self.tables, ((0, 0), (0, extra)))
        if num_blocks < known:  # not expected (see the class): written again whole
            self.reset(slot)
            known = 0
        self.tables[slot, known:num_blocks] = block_table[known:num_blocks]
        self.num_blocks[slot] = num_blocks


@dataclass
class SlotJoin:
    """A request taking a slot: what the device rows of that slot get."""

    slot: int
    token_ids: np.ndarray  # [num_tokens] int32
    num_output: int
    params: dict[str, np.ndarray]
    """`SlotParams.row` of the slot."""


@dataclass
class GatheredParams:
    """Some slots' sampling and stopping parameters, gathered with three copies (one per packed
    tensor) instead of one per parameter: the step's tail launches few kernels."""

    floats: torch.Tensor  # [3, n] float32: temperature, top_p, min_p
    ints: torch.Tensor  # [4, n] int32: top_k, max_tokens, min_tokens, ignore_eos
    seeds: torch.Tensor  # [n] int64

    @property
    def temperature(self) -> torch.Tensor:
        return self.floats[0]

    @property
    def top_p(self) -> torch.Tensor:
        return self.floats[1]

    @property
    def min_p(self) -> torch.Tensor:
        return self.floats[2]

    @property
    def top_k(self) -> torch.Tensor:
        return self.ints[0]

    @property
    def max_tokens(self) -> torch.Tensor:
        return self.ints[1]

    @property
    def min_tokens(self) -> torch.Tensor:
        return self.ints[2]

    @property
    def ignore_eos(self) -> torch.Tensor:
        return self.ints[3]


class InputBatch:
    def __init__(self, max_num_seqs: int, row_capacity: int, max_num_drafts: int, device: torch.device):
        """`row_capacity`: tokens one row holds (the longest request plus room for drafts written
        past its end); `max_num_drafts`: the most drafts a request gets per step."""
        self.device = device
        self.num_slots = max_num_seqs
        self.max_num_drafts = max_num_drafts
        rows = max_num_seqs + 1
        self.token_rows = torch.zeros(rows, row_capacity, dtype=torch.int32, device=device)
        self.num_tokens = torch.zeros(rows, dtype=torch.int32, device=device)
        """Tokens in each row (prompt + output)."""
        self.num_output = torch.zeros(rows, dtype=torch.int32, device=device)
        """Output tokens of each request (resumed ones included): what max_tokens counts."""
        self.drafts = torch.full((rows, max(max_num_drafts, 1)), -1, dtype=torch.int32, device=device)
        """The drafts each request's last step proposed for its next, -1 past `num_drafts` (the
        tail writes them: a step launched ahead reads them here, services/engine/run_ahead.py)."""
        self.num_drafts = torch.zeros(rows, dtype=torch.int32, device=device)
        self.draft_parents = torch.zeros(rows, max(max_num_drafts, 1), dtype=torch.int32, device=device)
        """Where a server drafts trees: each draft's parent node (0: the root, draft j is node j + 1;
        a chain's draft j hangs from node j), beside `drafts` (a step launched ahead lays its tree
        out from them: kernels/run_ahead_ref.py)."""
        self.host = SlotParams.empty(rows)
        self.fused_from = np.zeros(rows, np.int64)
        """Per slot, `fused_from` of its request (on the host only: rank 0 decides how a step verifies)."""
        self.block_tables = SlotBlockTables(rows)
        """The requests' block tables (on the host: each step sends those of its requests)."""
        self._floats = torch.zeros(3, rows, dtype=torch.float32, device=device)
        self._ints = torch.zeros(4 + MAX_EOS_IDS + MAX_STOP_IDS, rows, dtype=torch.int32, device=device)
        self.seeds = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_of: dict[str, int] = {}
        self._free = list(range(max_num_seqs - 1, -1, -1))
        self._dirty = True
        self.joins: list[SlotJoin] | None = None
        """Joins since the last `take_joins` (only where other ranks mirror this batch)."""
        self.flush()

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    @property
    def row_capacity(self) -> int:
        return self.token_rows.shape[1]

    # ---- the device views the kernels read --------------------------------------------------------

    @property
    def temperature(self) -> torch.Tensor:
        return self._floats[0]

    @property
    def top_p(self) -> torch.Tensor:
        return self._floats[1]

    @property
    def min_p(self) -> torch.Tensor:
        return self._floats[2]

    @property
    def top_k(self) -> torch.Tensor:
        return self._ints[0]

    @property
    def max_tokens(self) -> torch.Tensor:
        return self._ints[1]

    @property
    def min_tokens(self) -> torch.Tensor:
        return self._ints[2]

    @property
    def ignore_eos(self) -> torch.Tensor:
        return self._ints[3]

    @property
    def eos_ids(self) -> torch.Tensor:  # [num_slots + 1, MAX_EOS_IDS]
        return self._ints[4 : 4 + MAX_EOS_IDS].t()

    @property
    def stop_ids(self) -> torch.Tensor:  # [num_slots + 1, MAX_STOP_IDS]
        return self._ints[4 + MAX_EOS_IDS :].t()

    def gather(self, slots: torch.Tensor) -> GatheredParams:
        """The parameters of `slots` ([n] int64), each a contiguous [n] tensor."""
        return GatheredParams(
            self._floats.index_select(1, slots),
            self._ints[:4].index_select(1, slots),
            self.seeds.index_select(0, slots),
        )

    # ---- requests joining and leaving ---------------------------------------------------------------

    @staticmethod
    def fits(seq: Sequence) -> bool:
        """Whether the request's EOS and stop ids fit a slot (else it is verified eagerly)."""
        return len(seq.eos_token_ids) <= MAX_EOS_IDS and len(set(seq.params.stop_token_ids)) <= MAX_STOP_IDS

    def add(self, seq: Sequence) -> int:
        """Gives `seq` a slot and writes its tokens and parameters there."""
        if seq.request_id in self.slot_of:
            return self.slot_of[seq.request_id]
        if seq.num_tokens > self.row_capacity:
            raise ValueError(f"{seq.num_tokens} tokens do not fit a token row of {self.row_capacity}")
        slot = self._free.pop()
        self.slot_of[seq.request_id] = slot
        self.host.write(slot, seq)
        self.fused_from[slot] = fused_from(seq)
        self.block_tables.reset(slot)
        join = SlotJoin(slot, np.asarray(seq.token_ids, np.int32), seq.num_output_tokens, self.host.row(slot))
        self.write(join)
        if self.joins is not None:
            self.joins.append(join)
        return slot

    def write(self, join: SlotJoin) -> None:
        """A request's tokens and parameters into its slot (the parameters reach the device at
        the next `flush`)."""
        self.host.set_row(join.slot, join.params)
        self._dirty = True
        num_tokens = len(join.token_ids)
        tokens = torch.from_numpy(join.token_ids).to(self.device, non_blocking=True)
        self.token_rows[join.slot, :num_tokens] = tokens
        self.num_tokens[join.slot] = num_tokens
        self.num_output[join.slot] = join.num_output
        self.num_drafts[join.slot] = 0

    def record_joins(self) -> None:
        """Keeps every join from now on, for `take_joins`."""
        self.joins = []

    def take_joins(self) -> list[SlotJoin]:
        """The joins since the last call (none unless recording)."""
        joins, self.joins = self.joins, [] if self.joins is not None else None
        return joins or []

    def remove(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def flush(self) -> None:
        """Copies the parameters of requests that joined since the last flush to the device."""
        if not self._dirty:
            return
        h = self.host
        floats = np.stack([h.temperature, h.top_p, h.min_p])
        ints = np.concatenate(
            [np.stack([h.top_k, h.max_tokens, h.min_tokens, h.ignore_eos]), h.eos_ids.T, h.stop_ids.T]
        )
        self._floats.copy_(torch.from_numpy(floats), non_blocking=True)
        self._ints.copy_(torch.from_numpy(np.ascontiguousarray(ints)), non_blocking=True)
        self.seeds.copy_(torch.from_numpy(h.seeds), non_blocking=True)
        self._dirty = False
