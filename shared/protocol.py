"""Messages on the bus: pydantic schemas, msgpack on the wire, a version field on every one.

Messages carry deltas (new token ids) except where recovery needs the whole (a dispatch carries the
prompt and the tokens already streamed, so any worker can resume a request).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgpack
import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from shared.sampling_params import SamplingParams

PROTOCOL_VERSION = 4
"""Bumped on any incompatible schema change, new fields included (a process of the previous build
refuses them: `extra="forbid"`); `Message.version` must equal it. 4: prompt logprobs in output
rows, `structured` in sampling params, the gateway incarnation on requests."""
TOKEN_DTYPE = np.dtype("<i4")
"""Token ids and counts packed in `OutputBatch`'s byte fields: little-endian int32."""


class ProtocolError(ValueError):
    """A message that cannot be decoded or does not match its schema."""


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = PROTOCOL_VERSION
    """Set from PROTOCOL_VERSION, never written by hand: a message of another version is refused."""

    @field_validator("version")
    @classmethod
    def _same_version(cls, version: int) -> int:
        if version != PROTOCOL_VERSION:
            raise ValueError(mixed_versions(version))
        return version

    def to_wire(self) -> dict[str, Any]:
        """The map msgpack packs: JSON-compatible values."""
        return self.model_dump(mode="json")


# ---- gateway -> scheduler ----------------------------------------------------------------------------


class GenerateRequest(BaseModel):
    """Everything a worker needs to run (or resume) one request."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=256)
    prompt_token_ids: list[int] = Field(min_length=1)
    params: SamplingParams
    arrival_time: float = Field(default_factory=time.time)
    resumed_token_ids: list[int] = Field(default_factory=list)
    """Tokens already streamed to the client by an instance that died: the new instance prefills
    prompt + these and continues, so the client sees one unbroken stream."""
    gateway_id: str | None = Field(default=None, min_length=1, max_length=128)
    """The gateway that submitted the request: its outputs go to that gateway's output stream
    (set by the gateway; the scheduler refuses a request without one)."""
    gateway_incarnation: str | None = Field(default=None, min_length=1, max_length=64)
    """The submitting gateway process's incarnation (`Keys.gateway_liveness`): the request is
    aborted once that incarnation stops renewing its liveness. None: kept however long it runs."""


class Submit(Message):
    kind: Literal["submit"] = "submit"
    request: GenerateRequest


class Cancel(Message):
    kind: Literal["cancel"] = "cancel"
    request_id: str
    reason: str = "client disconnected"
    epoch: int | None = None
    """Stop only the placement of this epoch (or an older one); None: whichever runs."""


# ---- scheduler -> worker -------------------------------------------------------------------------------
#
# Every placement of a request (its first dispatch, and each re-dispatch) has an *epoch*, one more
# than the last, kept in the request's state hash. Only the placement of the current epoch may
# publish the request's rows or grow its delivered record (`Bus.publish_step` refuses the others),
# and the scheduler acts only on reports of the current epoch: a worker taken for dead that comes
# back (a stopped process, a network partition) is fenced off from requests placed elsewhere since.


class Dispatch(Message):
    """Run `request` on this instance: the whole of it (mixed), its prefill (prefill: the KV goes
    to `decode_instance`), or its decode (decode: the KV arrives from a prefill instance)."""

    kind: Literal["dispatch"] = "dispatch"
    role: Literal["mixed", "prefill", "decode"]
    request: GenerateRequest
    epoch: int = Field(ge=1)
    """This placement's epoch: the worker publishes the request's rows under it."""
    decode_instance: str | None = None
    decode_kv_address: str | None = None


class Reserve(Message):
    """Decode instance: hold KV blocks for a request about to be prefilled elsewhere."""

    kind: Literal["reserve"] = "reserve"
    request: GenerateRequest
    epoch: int = Field(ge=1)
    """The placement's epoch (the prefill's dispatch carries the same)."""
    timeout_s: float = Field(gt=0)
    """How long to hold the blocks waiting for the KV."""
    reply_to: str
    """Stream of the scheduler replica waiting for the answer."""


class ReserveReply(Message):
    kind: Literal["reserve_reply"] = "reserve_reply"
    request_id: str
    instance_id: str
    ok: bool
    kv_address: str | None = None
    error: str | None = None
    code: int | None = None
    """On refusal: 400 when the request itself is invalid (no instance would take it), 503 otherwise."""


class Finished(Message):
    """Worker -> scheduler: a request left this instance (finished, failed, cancelled, handed off,
    or returned: the instance lost the bus for longer than its heartbeat TTL and stopped it; the
    scheduler places it again, this instance included, resuming from its delivered record)."""

    kind: Literal["finished"] = "finished"
    request_id: str
    instance_id: str
    outcome: Literal["done", "handed_off", "failed", "cancelled", "returned"]
    epoch: int = Field(ge=1)
    """The placement it reports on: the scheduler ignores a report of an epoch no longer current."""
    error: str | None = None


# ---- worker -> gateway ----------------------------------------------------------------------------------
#
# A gateway reads one stream, its own, of `OutputBatch` messages: each a step's new tokens for
# every request of that gateway the step touched. Inside the gateway they become `TokenEvent`s, one
# per request, which is what the HTTP layer consumes.


class TokenLogprob(BaseModel):
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = Field(default_factory=list)
    rank: int | None = None
    """The token's rank by logprob in the vocabulary (1: the most likely); given for prompt tokens."""


class ErrorInfo(BaseModel):
    code: int
    """HTTP status the gateway answers with (400 bad request, 429 busy, 500, 503, 504)."""
    type: str
    message: str


@dataclass(slots=True)
class TokenEvent:
    """New tokens of one request (a delta), or its end: a row of an `OutputBatch`, as the gateway
    hands it to its request (a plain dataclass: the gateway makes one per request per step)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_output_tokens: int = 0
    """Output tokens so far (all of them, also across a resume)."""
    spec_stats: dict[str, Any] = field(default_factory=dict)
    error: ErrorInfo | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """Per prompt position (None at 0), on the request's first row when it asked for them."""


class OutputEnd(BaseModel):
    """How the request of one row of an `OutputBatch` ended (rows that did not end have none)."""

    row: int = Field(ge=0)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    spec_stats: dict[str, Any] = Field(default_factory=dict)
    """The request's speculative statistics, cumulative (they ride only on its last row)."""
    error: ErrorInfo | None = None


class RowLogprobs(BaseModel):
    row: int = Field(ge=0)
    logprobs: list[TokenLogprob]


class RowPromptLogprobs(BaseModel):
    """The prompt's logprobs of a request that asked for them, on its first row."""

    row: int = Field(ge=0)
    logprobs: list[TokenLogprob | None]
    """One per prompt position; None at 0 (nothing before it to score it)."""


class OutputBatch(Message):
    """New tokens of several requests of one gateway, column by column (one step's, usually).

    Row i is request `request_ids[i]`; its new tokens are `token_ids[cu_num_tokens[i]:
    cu_num_tokens[i + 1]]`. The byte fields are `TOKEN_DTYPE` arrays, so a step of 256 requests is
    three byte strings rather than thousands of msgpack integers. A request may have several rows
    (steps coalesced into one batch); its rows are in order.
    """

    kind: Literal["outputs"] = "outputs"
    request_ids: list[str]
    cu_num_tokens: bytes
    """[num_rows + 1] prefix sums of the rows' new-token counts."""
    token_ids: bytes
    """[cu_num_tokens[-1]] the rows' new tokens, concatenated."""
    texts: list[str]
    """Each row's text delta (the worker detokenizes; a delta never splits a UTF-8 character)."""
    num_output_tokens: bytes
    """[num_rows] the request's output tokens so far, across a resume too."""
    ends: list[OutputEnd] = Field(default_factory=list)
    logprobs: list[RowLogprobs] = Field(default_factory=list)
    """Rows of requests that asked for logprobs: one entry per new token."""
    prompt_logprobs: list[RowPromptLogprobs] = Field(default_factory=list)
    """First rows of requests that asked for prompt logprobs (computed where the prompt ran)."""

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="python")  # the byte fields stay bytes (msgpack bin)

    @model_validator(mode="after")
    def _check_shapes(self) -> OutputBatch:
        num_rows = len(self.request_ids)
        cu = np.frombuffer(self.cu_num_tokens, TOKEN_DTYPE) if len(self.cu_num_tokens) % 4 == 0 else None
        if cu is None or len(cu) != num_rows + 1 or cu[0] != 0 or np.any(np.diff(cu) < 0):
            raise ValueError(f"cu_num_tokens must be {num_rows + 1} non-decreasing int32 from 0")
        if len(self.token_ids) != 4 * int(cu[-1]) or len(self.num_output_tokens) != 4 * num_rows:
            raise ValueError("token_ids / num_output_tokens do not match cu_num_tokens")
        if len(self.texts) != num_rows:
            raise ValueError(f"{len(self.texts)} texts for {num_rows} rows")
        rows = [end.row for end in self.ends] + [r.row for r in self.logprobs]
        rows += [r.row for r in self.prompt_logprobs]
        if any(row >= num_rows for row in rows):
            raise ValueError(f"an end or logprobs row is past the {num_rows} rows")
        return self

    def events(self) -> list[TokenEvent]:
        """One event per row, in order (what the gateway hands to each request)."""
        cu = np.frombuffer(self.cu_num_tokens, TOKEN_DTYPE).tolist()
        token_ids = np.frombuffer(self.token_ids, TOKEN_DTYPE).tolist()  # one conversion, sliced per row
        num_output = np.frombuffer(self.num_output_tokens, TOKEN_DTYPE).tolist()
        ends = {end.row: end for end in self.ends}
        logprobs = {row.row: row.logprobs for row in self.logprobs}
        prompt_logprobs = {row.row: row.logprobs for row in self.prompt_logprobs}
        events = []
        for row, request_id in enumerate(self.request_ids):
            end = ends.get(row)
            event = TokenEvent(
                request_id,
                token_ids[cu[row] : cu[row + 1]],
                self.texts[row],
                logprobs.get(row, []),
                end is not None,
                num_output_tokens=num_output[row],
                prompt_logprobs=prompt_logprobs.get(row),
            )
            if end is not None:
                event.finish_reason, event.stop_reason = end.finish_reason, end.stop_reason
                event.spec_stats, event.error = end.spec_stats, end.error
            events.append(event)
        return events

    @classmethod
    def of(cls, events: list[TokenEvent]) -> OutputBatch:
        """A batch holding these events (a worker's step builds its batches from arrays instead)."""
        cu = np.cumsum([0, *(len(e.token_ids) for e in events)], dtype=TOKEN_DTYPE)
        tokens = [t for e in events for t in e.token_ids]
        return cls(
            request_ids=[e.request_id for e in events],
            cu_num_tokens=cu.tobytes(),
            token_ids=np.asarray(tokens, TOKEN_DTYPE).tobytes(),
            texts=[e.text for e in events],
            num_output_tokens=np.asarray([e.num_output_tokens for e in events], TOKEN_DTYPE).tobytes(),
            ends=[
                OutputEnd(
                    row=i,
                    finish_reason=e.finish_reason,
                    stop_reason=e.stop_reason,
                    spec_stats=e.spec_stats,
                    error=e.error,
                )
                for i, e in enumerate(events)
                if e.finished or e.error is not None
            ],
            logprobs=[RowLogprobs(row=i, logprobs=e.logprobs) for i, e in enumerate(events) if e.logprobs],
            prompt_logprobs=[
                RowPromptLogprobs(row=i, logprobs=e.prompt_logprobs)
                for i, e in enumerate(events)
                if e.prompt_logprobs is not None
            ],
        )


# ---- registry -------------------------------------------------------------------------------------------


class InstanceInfo(Message):
    """A worker's heartbeat: who it is and how loaded it is."""

    kind: Literal["instance"] = "instance"
    instance_id: str
    role: Literal["mixed", "prefill", "decode"]
    model: str
    max_model_len: int
    kv_address: str | None = None
    num_running: int = 0
    num_waiting: int = 0
    queued_tokens: int = 0
    """Prompt tokens waiting to be prefilled."""
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    block_size: int = 16
    speculative_method: str = "naive"
    draining: bool = False
    """Set on SIGTERM: finishing in-flight work, taking no more."""
    updated_at: float = Field(default_factory=time.time)


# ---- suffix cache ---------------------------------------------------------------------------------------


class SuffixUpdate(Message):
    kind: Literal["suffix_update"] = "suffix_update"
    sequence_id: str
    token_ids: list[int]


class SuffixQuery(BaseModel):
    request_id: str
    context: list[int]
    max_spec_tokens: int = Field(ge=0)


class SuffixLookup(Message):
    kind: Literal["suffix_lookup"] = "suffix_lookup"
    lookup_id: int
    instance_id: str
    queries: list[SuffixQuery]
    sent_at: float = Field(default_factory=time.time)


class SuffixDraftOut(BaseModel):
    token_ids: list[int] = Field(default_factory=list)
    score: float = 0.0


class SuffixReply(Message):
    kind: Literal["suffix_reply"] = "suffix_reply"
    lookup_id: int
    drafts: list[SuffixDraftOut]
    service_s: float = 0.0
    """Time the service spent answering (the rest of the round trip is the bus)."""


AnyMessage = Annotated[
    Submit
    | Cancel
    | Dispatch
    | Reserve
    | ReserveReply
    | Finished
    | OutputBatch
    | InstanceInfo
    | SuffixUpdate
    | SuffixLookup
    | SuffixReply,
    Field(discriminator="kind"),
]
_ADAPTER: TypeAdapter[AnyMessage] = TypeAdapter(AnyMessage)

PAYLOAD_FIELD = b"m"
"""Stream entries hold one field: the msgpack-encoded message."""


def mixed_versions(version: object) -> str:
    """The refusal of a message from another build of specmesh."""
    return (
        f"unsupported protocol version {version!r} (this build speaks {PROTOCOL_VERSION}): a process "
        "of another specmesh build is on this bus; run every process of the mesh from one build"
    )


def encode(message: Message) -> bytes:
    return msgpack.packb(message.to_wire(), use_bin_type=True)


def decode(data: bytes) -> AnyMessage:
    """Parses and validates one message; any problem is a ProtocolError saying what is wrong."""
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"not msgpack: {exc}") from None
    if not isinstance(raw, dict):
        raise ProtocolError(f"message must be a map, not {type(raw).__name__}")
    version = raw.get("version")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(mixed_versions(version))
    try:
        return _ADAPTER.validate_python(raw)
    except ValidationError as exc:
        from shared.errors import describe_validation_error

        raise ProtocolError(
            f"invalid {raw.get('kind', 'message')!r}: {describe_validation_error(exc)}"
        ) from None
