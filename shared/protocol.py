"""Messages on the bus: pydantic schemas, msgpack on the wire, a version field on every one.

Messages carry deltas (new token ids) except where recovery needs the whole (a dispatch carries the
prompt and the tokens already streamed, so any worker can resume a request).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from shared.sampling_params import SamplingParams

PROTOCOL_VERSION = 1
"""Bumped on any incompatible schema change; `Message.version` must equal it."""


class ProtocolError(ValueError):
    """A message that cannot be decoded or does not match its schema."""


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1


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


class Submit(Message):
    kind: Literal["submit"] = "submit"
    request: GenerateRequest


class Cancel(Message):
    kind: Literal["cancel"] = "cancel"
    request_id: str
    reason: str = "client disconnected"


# ---- scheduler -> worker -------------------------------------------------------------------------------


class Dispatch(Message):
    """Run `request` on this instance: the whole of it (mixed), its prefill (prefill: the KV goes
    to `decode_instance`), or its decode (decode: the KV arrives from a prefill instance)."""

    kind: Literal["dispatch"] = "dispatch"
    role: Literal["mixed", "prefill", "decode"]
    request: GenerateRequest
    decode_instance: str | None = None
    decode_kv_address: str | None = None


class Reserve(Message):
    """Decode instance: hold KV blocks for a request about to be prefilled elsewhere."""

    kind: Literal["reserve"] = "reserve"
    request: GenerateRequest
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
    """Worker -> scheduler: a request left this instance (finished, failed, cancelled, handed off)."""

    kind: Literal["finished"] = "finished"
    request_id: str
    instance_id: str
    outcome: Literal["done", "handed_off", "failed", "cancelled"]
    error: str | None = None


# ---- worker -> gateway ----------------------------------------------------------------------------------


class TokenLogprob(BaseModel):
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = Field(default_factory=list)


class ErrorInfo(BaseModel):
    code: int
    """HTTP status the gateway answers with (400 bad request, 429 busy, 500, 503, 504)."""
    type: str
    message: str


class TokenEvent(Message):
    """New tokens of one request (a delta), or its end."""

    kind: Literal["tokens"] = "tokens"
    request_id: str
    token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = Field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    """Output tokens so far (all of them, also across a resume)."""
    spec_stats: dict[str, Any] = Field(default_factory=dict)
    error: ErrorInfo | None = None


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
    | TokenEvent
    | InstanceInfo
    | SuffixUpdate
    | SuffixLookup
    | SuffixReply,
    Field(discriminator="kind"),
]
_ADAPTER: TypeAdapter[AnyMessage] = TypeAdapter(AnyMessage)

PAYLOAD_FIELD = b"m"
"""Stream entries hold one field: the msgpack-encoded message."""


def encode(message: Message) -> bytes:
    return msgpack.packb(message.model_dump(mode="json"), use_bin_type=True)


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
        raise ProtocolError(
            f"unsupported protocol version {version!r} (this build speaks {PROTOCOL_VERSION})"
        )
    try:
        return _ADAPTER.validate_python(raw)
    except ValidationError as exc:
        from shared.errors import describe_validation_error

        raise ProtocolError(
            f"invalid {raw.get('kind', 'message')!r}: {describe_validation_error(exc)}"
        ) from None
