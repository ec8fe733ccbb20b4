"""What a worker and its engine-core process say to each other over their channel.

worker -> core: commands (`AddRequest`, `Abort`, `Reserve`, `ImportKV`, `ImportShared`, `Activate`,
`FetchKV`, `ReleaseKV`, `Shutdown`); `Reserve`, `ImportShared` and `FetchKV` are answered (a `Reply`),
the others' effects come back in step batches.
core -> worker: `EngineInfo` once, then at least one `StepBatch` a step (the last step's outputs as
soon as they are made, during the step; and after commands that produced outputs while idle), and
`Reply`s; on a prefill core that streams KV, a `KVStreamStart` as a request to hand off starts its
prefill and a `KVLayers` per target layer of a step's chunks of them, during the step, each before the
`StepBatch` that hands the request off.

A `StepBatch` is columnar: row i is one request's delta, its new tokens are
`token_ids[cu_num_tokens[i]:cu_num_tokens[i + 1]]`; the arrays cross the channel without per-token
Python objects. This module imports no engine code: the worker side never loads the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from services.engine.kv_export import KVExport
from shared.bus import OUTPUT_END, DeliveredRecords, RedisSettings
from shared.config import EngineConfig
from shared.protocol import (
    TOKEN_DTYPE,
    ErrorInfo,
    OutputBatch,
    OutputEnd,
    RowLogprobs,
    RowPromptLogprobs,
    TokenLogprob,
)
from shared.sampling_params import SamplingParams

if TYPE_CHECKING:
    from services.kv_transport.ipc_buffer import SharedKV

# ---- worker -> core ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SuffixCacheOptions:
    """Where the engine core finds the shared suffix cache (it talks to it from its own thread)."""

    redis: RedisSettings
    instance_id: str
    deadline_s: float


@dataclass(frozen=True)
class CoreOptions:
    """The first frame the core reads: what to build."""

    config: EngineConfig
    suffix_cache: SuffixCacheOptions | None = None
    share_kv: bool = False
    """Prefill role: gather exported KV into device buffers the decode side opens by handle (the
    ipc KV transport), not copies on the host."""
    share_timeout_s: float = 120.0
    """A shared export not released by then is freed anyway (its transfer is long dead)."""
    stream_kv: bool = False
    """Prefill role: stream the KV of requests to hand off layer by layer as their prefill runs
    (`KVStreamStart`, `KVLayers`), not whole after it (the bytes transports; not with `share_kv`)."""


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    epoch: int
    """The placement's epoch: the request's rows carry it (`StepBatch.epochs`)."""
    prompt_token_ids: list[int]
    params: SamplingParams
    resumed_token_ids: list[int]
    handoff: bool = False
    """Prefill role: stop after the first token and export the KV."""
    arrival_time: float | None = None
    """When the request first arrived (wall clock): its place in the engine's queue."""


@dataclass(frozen=True)
class Abort:
    request_id: str
    emit: bool = True
    """Send the request's final row (finish reason `abort`); False drops it silently, for a
    request the worker hands back to the scheduler to place again."""


@dataclass(frozen=True)
class Reserve:
    """Decode role: hold KV blocks for a request prefilled elsewhere (answered with a `Reply`)."""

    call_id: int
    request_id: str
    epoch: int
    prompt_token_ids: list[int]
    params: SamplingParams
    resumed_token_ids: list[int]


@dataclass(frozen=True)
class ImportKV:
    """Every layer of one request's received KV, in one command once all arrived and were verified."""

    request_id: str
    layers: list[tuple[str, int, torch.Tensor, torch.Tensor]]
    """(cache, index, key, value); key and value [num_blocks, block_size, kv_heads, head_dim]."""


@dataclass(frozen=True)
class ImportShared:
    """Decode role: open a request's KV shared by a prefill instance on this host and copy it into the
    reserved blocks (answered with a `Reply` once the copy is complete: then the buffer may go)."""

    call_id: int
    request_id: str
    shared: SharedKV


@dataclass(frozen=True)
class FetchKV:
    """Prefill role: a host copy of a shared export, for a decode instance that could not open it
    (answered with a `Reply` carrying it)."""

    call_id: int
    request_id: str


@dataclass(frozen=True)
class ReleaseKV:
    """Prefill role: the transfer of a shared export ended (acknowledged or failed): free its buffer."""

    request_id: str


@dataclass(frozen=True)
class Activate:
    request_id: str
    first_token_id: int


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Profile:
    """From now on the core's loop runs under cProfile; its stats go to `path` as the core stops
    (`benchmarks.core_step --profile`: after a warm-up, so one-time work stays out)."""

    path: str


Command = (
    AddRequest
    | Abort
    | Reserve
    | ImportKV
    | ImportShared
    | FetchKV
    | ReleaseKV
    | Activate
    | Shutdown
    | Profile
)


# ---- core -> worker ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineInfo:
    """Sent once the engine is built (or `error` if it could not be)."""

    max_model_len: int = 0
    total_kv_blocks: int = 0
    block_size: int = 0
    speculative_method: str = "naive"
    cpus: list[int] = field(default_factory=list)
    """The CPUs the core runs on (`EngineConfig.core_cpus`; empty: not pinned): the bus side keeps off them."""
    error: str | None = None


@dataclass(frozen=True)
class Reply:
    call_id: int
    error: ErrorInfo | None = None
    export: KVExport | None = None
    """`FetchKV`: the export, its layers on the host."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """`ImportShared`: the extra tensors that came with the KV, on the host."""


@dataclass
class EngineLoad:
    """A snapshot of the engine's load after a step (the heartbeat reports it)."""

    num_running: int = 0
    num_waiting: int = 0
    queued_tokens: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    num_preemptions: int = 0
    suffix_cache: dict[str, Any] = field(default_factory=dict)
    """The shared suffix-cache client's statistics, where the core has one: about once a second
    while it steps (`engine_core.SUFFIX_STATS_INTERVAL_S`), empty in the batches between."""


@dataclass
class RowEnd:
    """How one row's request left the engine."""

    row: int
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    spec_stats: dict[str, Any] = field(default_factory=dict)
    ttft_s: float | None = None
    e2e_s: float | None = None
    error: ErrorInfo | None = None
    handoff: bool = False
    """Prefilled for a decode instance: the request goes on there (not an end for the client)."""

    @property
    def outcome(self) -> str:
        """What the scheduler hears (`Finished.outcome`)."""
        if self.handoff:
            return "handed_off"
        if self.error is not None:
            return "failed"
        return "cancelled" if self.finish_reason == "abort" else "done"


Logprobs = list[tuple[int, float, list[tuple[int, float]]]]
"""(token id, logprob, top (token id, logprob) pairs) per new token."""
PromptLogprobs = list[tuple[int, float, int | None, list[tuple[int, float]]] | None]
"""(token id, logprob, rank, top (token id, logprob) pairs) per prompt position; None at 0."""


@dataclass
class StepBatch:
    request_ids: list[str]
    cu_num_tokens: np.ndarray  # [num_rows + 1] int32
    token_ids: np.ndarray  # [num_tokens] int32
    texts: list[str]
    num_output_tokens: np.ndarray  # [num_rows] int32
    epochs: list[int]
    """[num_rows] the epoch of the placement each row was stepped for: a request placed here again
    (a newer epoch) has rows of both in flight for a while, and only the newer may be published."""
    ends: list[RowEnd]
    logprobs: list[tuple[int, Logprobs]]
    """(row, its new tokens' logprobs) for rows of requests that asked for them."""
    handoffs: list[KVExport]
    """Prefill role: requests' KV to send to their decode instances (host tensors once received)."""
    step_s: list[float]
    """The time of each engine step that ended since the last batch, oldest first: a step's time
    goes out once, with the first batch sent after it ends (after it, or during the next step)."""
    load: EngineLoad
    prompt_logprobs: list[tuple[int, PromptLogprobs]] = field(default_factory=list)
    """(row, its request's prompt logprobs) on the first row of requests that asked for them."""
    started_at: float = 0.0
    """Wall clock as the step the batch was sent in (or after) began (0: no step, a batch of
    command effects only). Rows of a step's tokens go out during the next step, as its device runs."""
    sent_at: float = 0.0
    """Wall clock as the core handed the batch to its channel. With `started_at`, the worker logs
    the core's hops of every row (`shared.trace`): the core itself logs none a step."""

    @property
    def num_rows(self) -> int:
        return len(self.request_ids)

    def row_tokens(self, row: int) -> np.ndarray:
        return self.token_ids[self.cu_num_tokens[row] : self.cu_num_tokens[row + 1]]

    def output_batch(self, rows: np.ndarray | None = None) -> OutputBatch:
        """These rows (sorted; default: all) as the bus message for their gateway."""
        cu, token_ids, num_output = self.cu_num_tokens, self.token_ids, self.num_output_tokens
        request_ids, texts = self.request_ids, self.texts
        renumber: dict[int, int] | None = None  # a row here -> its row in the message (None: all, unmoved)
        if rows is not None and len(rows) < self.num_rows:
            token_ids = token_ids[self._token_mask(rows, np.diff(cu))]
            cu = np.concatenate([[0], np.cumsum(np.diff(cu)[rows])])
            num_output = num_output[rows]
            kept = rows.tolist()
            request_ids, texts = [request_ids[i] for i in kept], [texts[i] for i in kept]
            renumber = {old: new for new, old in enumerate(kept)} if self._has_row_extras() else {}

        def place(row: int) -> int | None:
            return row if renumber is None else renumber.get(row)

        return OutputBatch.model_construct(
            request_ids=request_ids,
            cu_num_tokens=cu.astype(TOKEN_DTYPE).tobytes(),
            token_ids=token_ids.astype(TOKEN_DTYPE).tobytes(),
            texts=texts,
            num_output_tokens=num_output.astype(TOKEN_DTYPE).tobytes(),
            ends=[
                OutputEnd(
                    row=new_row,
                    finish_reason=end.finish_reason,
                    stop_reason=end.stop_reason,
                    spec_stats=end.spec_stats,
                    error=end.error,
                )
                for end in self.ends
                if (new_row := place(end.row)) is not None and not end.handoff
            ],
            logprobs=[
                RowLogprobs(
                    row=new_row,
                    logprobs=[TokenLogprob(token_id=t, logprob=lp, top=top) for t, lp, top in entries],
                )
                for row, entries in self.logprobs
                if (new_row := place(row)) is not None
            ],
            prompt_logprobs=[
                RowPromptLogprobs(row=new_row, logprobs=[_prompt_entry(e) for e in entries])
                for row, entries in self.prompt_logprobs
                if (new_row := place(row)) is not None
            ],
        )

    def delivered_records(self, rows: np.ndarray | None, renew_ttl: np.ndarray) -> DeliveredRecords:
        """These rows (sorted; None: all) as appends to their requests' delivered records: each
        row's new tokens, then `OUTPUT_END` where its request ended here (a hand-off is no end).
        `renew_ttl`: [num_rows] bool, the rows whose record's TTL is renewed."""
        cu, token_ids = self.cu_num_tokens, self.token_ids
        num_tokens = cu[1:] - cu[:-1]  # [num_rows]
        starts = self.num_output_tokens - num_tokens  # [num_rows]
        end_rows = [end.row for end in self.ends if not end.handoff]
        if end_rows:
            token_ids = np.insert(token_ids, cu[1:][end_rows], OUTPUT_END)
            num_tokens[end_rows] += 1
        request_ids, epochs = self.request_ids, np.asarray(self.epochs)
        if rows is not None and len(rows) < self.num_rows:
            token_ids = token_ids[self._token_mask(rows, num_tokens)]
            kept = rows.tolist()
            request_ids = [request_ids[i] for i in kept]
            epochs, starts, renew_ttl = epochs[rows], starts[rows], renew_ttl[rows]
            num_tokens = num_tokens[rows]
        return DeliveredRecords(request_ids, epochs, starts, num_tokens, token_ids, renew_ttl)

    def _has_row_extras(self) -> bool:
        """Whether any row has an end or logprobs (else a selection needs no row renumbering)."""
        return bool(self.ends or self.logprobs or self.prompt_logprobs)

    def _token_mask(self, rows: np.ndarray, num_tokens: np.ndarray) -> np.ndarray:
        """[sum(num_tokens)] bool: the tokens of `rows`, given each row's `num_tokens` [num_rows]."""
        kept = np.zeros(self.num_rows, bool)
        kept[rows] = True
        return np.repeat(kept, num_tokens)


def _prompt_entry(
    entry: tuple[int, float, int | None, list[tuple[int, float]]] | None,
) -> TokenLogprob | None:
    if entry is None:
        return None
    token_id, logprob, rank, top = entry
    return TokenLogprob(token_id=token_id, logprob=logprob, top=top, rank=rank)


def concat(batches: list[StepBatch]) -> StepBatch:
    """Several batches as one, rows in order (a request may then have several rows)."""
    if len(batches) == 1:
        return batches[0]
    offsets = np.cumsum([0, *(b.num_rows for b in batches)])
    token_offsets = np.cumsum([0, *(len(b.token_ids) for b in batches)])
    ends = [replace(end, row=end.row + int(offset)) for b, offset in zip(batches, offsets) for end in b.ends]
    return StepBatch(
        request_ids=[r for b in batches for r in b.request_ids],
        cu_num_tokens=np.concatenate(
            [[0], *(b.cu_num_tokens[1:] + t for b, t in zip(batches, token_offsets))]
        ).astype(TOKEN_DTYPE),
        token_ids=np.concatenate([b.token_ids for b in batches]),
        texts=[t for b in batches for t in b.texts],
        num_output_tokens=np.concatenate([b.num_output_tokens for b in batches]),
        epochs=[e for b in batches for e in b.epochs],
        ends=ends,
        logprobs=[(row + int(o), lps) for b, o in zip(batches, offsets) for row, lps in b.logprobs],
        handoffs=[h for b in batches for h in b.handoffs],
        step_s=[s for b in batches for s in b.step_s],
        load=batches[-1].load,
        prompt_logprobs=[
            (row + int(o), lps) for b, o in zip(batches, offsets) for row, lps in b.prompt_logprobs
        ],
    )
