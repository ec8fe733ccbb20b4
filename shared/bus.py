"""The Redis bus every role talks over: settings, connect-with-retry, streams with consumer groups.

Delivery is at-least-once: a message is acknowledged only after its handler ran, a consumer that
died leaves its messages pending, and XAUTOCLAIM hands them to a live consumer of the same group
once they have been idle for `claim_idle_ms`. Handlers are idempotent by request id. A message that
cannot be decoded goes to the dead-letter stream with the reason, and is acknowledged, so it never
blocks the stream or crashes a consumer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import AuthenticationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared import trace
from shared.keys import Keys
from shared.protocol import (
    PAYLOAD_FIELD,
    TOKEN_DTYPE,
    AnyMessage,
    Message,
    ProtocolError,
    Submit,
    decode,
    encode,
)
from shared.redis_connection import Connection

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 128
"""Connections a process opens to Redis at most."""
CONNECTION_WAIT_S = 30.0
"""Longest a command waits for a free connection before it fails."""
DEFAULT_CLAIM_IDLE_MS = 30_000
CLAIM_EVERY_S = 1.0
"""How often a consumer looks for messages a dead one left pending (each look is a round trip)."""
OUTPUT_TTL_S = 600
"""A gateway's output stream, and a request's delivered record, expire this long after their last
write (a gateway that died, a request that ended)."""
ENDED_TTL_S = 120
"""How long a request's `ended` mark (`Keys.request_state`) stays: it refuses a late repeat of the
request's Submit, taken over from a replica that died before acknowledging it (after its lease's
--scheduler-ttl, or `DEFAULT_CLAIM_IDLE_MS`) or resent by its gateway through an outage, and late
publishes of its placements. Every request that ended in the last ENDED_TTL_S holds one, so this,
times the request rate, is what Redis holds of requests that have ended."""
DEAD_LETTER_MAXLEN = 10_000
TRANSIENT_ERRORS = (RedisConnectionError, RedisTimeoutError)
"""Errors that waiting cures: Redis unreachable, restarting (loading its data is a ConnectionError),
or slow. Any other error is a bug or a refusal and is raised at once."""
FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0

T = TypeVar("T")


def reraise_if_cancelled(error: BaseException) -> None:
    """In a loop that retries Redis errors until it is cancelled: re-raises the cancellation when
    the error only stood in for it. A cancel that lands while redis-py's own socket timeout fires
    can come out as a Redis TimeoutError (asyncio.timeout's race on Python 3.11), and a loop that
    retried it would never stop (its owner then hangs awaiting it)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python 3.11+
    if cancelling is not None and cancelling():
        raise asyncio.CancelledError from error


async def retry_transient(op: Callable[[], Awaitable[T]], what: str, deadline_s: float | None) -> T:
    """`op()`, called again after each transient Redis error (`TRANSIENT_ERRORS`) with exponential
    backoff from `FIRST_BACKOFF_S` to `MAX_BACKOFF_S`, until it succeeds or `deadline_s` has passed
    (None: until cancelled); then the last error is raised. `op` must be safe to repeat: an error
    may come after Redis applied the command, before its answer arrived. A cancellation that
    surfaced as a Redis error is raised as a cancellation."""
    deadline = float("inf") if deadline_s is None else time.monotonic() + deadline_s
    delay_s = FIRST_BACKOFF_S
    while True:
        try:
            return await op()
        except TRANSIENT_ERRORS as exc:
            reraise_if_cancelled(exc)
            wait_s = min(delay_s, deadline - time.monotonic())  # the last try is at the deadline
            if wait_s <= 0:
                raise
            logger.warning("%s failed (%s); retrying in %.2f s", what, exc, wait_s)
            await asyncio.sleep(wait_s)
            delay_s = min(2 * delay_s, MAX_BACKOFF_S)


class LoopDied(RuntimeError):
    """One of a process's long-running loops ended while the process was not stopping."""


async def until_stopped_or_dead(
    stop: asyncio.Event, loops: Iterable[asyncio.Task[Any]]
) -> asyncio.Task[Any] | None:
    """Waits until `stop` is set or one of `loops` (tasks meant to run until the process stops)
    ends; returns the loop that ended first (logged with what it died of), or None once stopped.
    A process whose loop died must stop with an error, for its supervisor to start it again: run
    on without it, it would look alive to the mesh (its heartbeat, its lease) while doing none of
    that loop's work."""
    loops = list(loops)
    stopped = asyncio.create_task(stop.wait(), name="stop")
    done, _ = await asyncio.wait([stopped, *loops], return_when=asyncio.FIRST_COMPLETED)
    await stop_tasks([stopped])
    dead = next((loop for loop in loops if loop in done), None)
    if dead is None or stop.is_set():
        return None
    error = None if dead.cancelled() else dead.exception()
    logger.error("%s ended%s: stopping", dead.get_name(), f" ({error!r})" if error else "", exc_info=error)
    return dead


RECANCEL_EVERY_S = 0.5


async def stop_tasks(tasks: Iterable[asyncio.Task[Any]], timeout_s: float = 10.0) -> None:
    """Cancels background tasks and waits for them, cancelling again until they end.

    One cancel is not always enough: the same race can make redis-py's retry policy retry a
    command whose cancellation came out as a TimeoutError, and the task then carries on as if never
    cancelled (seen as a worker that ignored SIGTERM, its output loop back at its queue). A shutdown
    must not hang on that, so this repeats the cancel every `RECANCEL_EVERY_S`, and after `timeout_s`
    logs the tasks that still run and returns. Errors the tasks died of are logged, not raised.
    """
    tasks = list(tasks)
    pending = {task for task in tasks if not task.done()}
    deadline = time.monotonic() + timeout_s
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            names = ", ".join(sorted(task.get_name() for task in pending))
            logger.error("tasks still running %.0f s after being cancelled: %s", timeout_s, names)
            return
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=min(RECANCEL_EVERY_S, remaining))
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            logger.error("task %s had failed: %r", task.get_name(), task.exception())


@dataclass(frozen=True)
class RedisSettings:
    """Where the bus is; flags as FastDeploy names them (--scheduler-host/-port/-password/-topic),
    and the ACL user (--redis-user; None: Redis's default user)."""

    host: str = "127.0.0.1"
    port: int = 6379
    password: str | None = None
    topic: str = "default"
    db: int = 0
    username: str | None = None

    @property
    def keys(self) -> Keys:
        return Keys(self.topic)

    def describe(self) -> str:
        user = f"{self.username}@" if self.username else ""
        return f"redis://{user}{self.host}:{self.port}/{self.db} topic {self.topic!r}"


async def connect(settings: RedisSettings, attempts: int = 30, delay_s: float = 0.2) -> aioredis.Redis:
    """A client that answered PING, retrying while Redis starts; a clear error if it never does.
    Commands beyond `MAX_CONNECTIONS` at once wait for a free connection (a burst of hundreds of
    requests is queued, not refused). A command that fails for a broken connection is sent once
    more on a new one at once: after a Redis restart every pooled connection is broken, and each
    would otherwise fail one command. Longer outages are for `retry_transient` and the callers'
    own loops. Wrong credentials fail at once, naming the user."""
    connection_class = trace.CountingConnection if trace.ENABLED else Connection
    pool = aioredis.BlockingConnectionPool(
        connection_class=connection_class,
        host=settings.host,
        port=settings.port,
        username=settings.username,
        password=settings.password,
        db=settings.db,
        health_check_interval=30,
        max_connections=MAX_CONNECTIONS,
        timeout=CONNECTION_WAIT_S,
        retry=Retry(NoBackoff(), 1),
    )
    client = aioredis.Redis.from_pool(pool)
    last_error: Exception | None = None
    for _ in range(attempts):
        try:
            await client.ping()
            return client
        except AuthenticationError as exc:  # a ConnectionError that waiting does not cure
            await client.aclose()
            user = f"user {settings.username!r}" if settings.username else "the default user"
            raise ConnectionError(
                f"Redis at {settings.describe()} refused {user}: {exc} Check --redis-user and the "
                "password (--redis-password-file or SPECMESH_SCHEDULER_PASSWORD)"
            ) from None
        except RedisConnectionError as exc:
            last_error = exc
            await asyncio.sleep(delay_s)
        except ResponseError as exc:  # wrong password and the like: retrying will not help
            await client.aclose()
            raise ConnectionError(f"Redis at {settings.describe()} refused us: {exc}") from None
    await client.aclose()
    raise ConnectionError(
        f"cannot reach Redis at {settings.describe()} after {attempts} attempts ({last_error}); "
        "check --scheduler-host / --scheduler-port / --scheduler-password"
    )


def as_text(value: bytes | str) -> str:
    """Redis replies are bytes (this client does not decode them)."""
    return value.decode() if isinstance(value, bytes) else value


def as_bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


@dataclass
class Delivery:
    stream: str
    entry_id: str
    message: AnyMessage


OUTPUT_END = -1
"""Appended to a request's delivered record (`Keys.delivered`) after its last token."""
END_BYTES = np.asarray([OUTPUT_END], TOKEN_DTYPE).tobytes()

PUBLISH_STEP_LUA = """
local ttl_s, num_outputs, field = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local record_prefix, state_prefix = ARGV[4], ARGV[5]
local headers, ids, tokens = ARGV[6], ARGV[7], ARGV[8]
local appends, fenced = {}, {}
local id_at, tokens_at = 1, 1
for pos = 1, #headers, 20 do
    local id_len, tokens_len, start, epoch, renew = struct.unpack('<I4I4I4I4I4', headers, pos)
    local request_id = string.sub(ids, id_at, id_at + id_len - 1)
    local state = state_prefix .. request_id
    if redis.call('HGET', state, 'epoch') ~= tostring(epoch) and redis.call('EXISTS', state) == 1 then
        fenced[#fenced + 1] = request_id
    elseif tokens_len > 0 then
        appends[#appends + 1] = {record_prefix .. request_id, start, tokens_at, tokens_len, renew}
    end
    id_at, tokens_at = id_at + id_len, tokens_at + tokens_len
end
if #fenced > 0 then
    return fenced
end
for i, key in ipairs(KEYS) do
    redis.call('XADD', key, '*', field, ARGV[i + 8])
    if i <= num_outputs then
        redis.call('EXPIRE', key, ttl_s)
    end
end
for _, append in ipairs(appends) do
    local key, start, at, num_bytes, renew = append[1], append[2], append[3], append[4], append[5]
    local before = redis.call('APPEND', key, string.sub(tokens, at, at + num_bytes - 1)) - num_bytes
    if start ~= 4294967295 and before ~= 4 * start then
        if before == 0 then
            redis.call('DEL', key)
        else
            redis.call('SET', key, redis.call('GETRANGE', key, 0, before - 1), 'KEEPTTL')
        end
    elseif before == 0 or renew == 1 then
        redis.call('EXPIRE', key, ttl_s)
    end
end
return fenced
"""
"""`publish_step`. KEYS: the gateways' output streams, then other streams. ARGV: the TTL, how many
output streams, the payload field, the delivered records' key prefix, the request states' key
prefix, the records as three columns (`DeliveredRecords.columns`), then one payload per key.
Fencing first: if any row's epoch is not its request's current one (the state hash exists and
holds another epoch, or none: the request ended), nothing is written and those request ids are
returned. A state hash that is gone altogether (a Redis restart without it) fences nothing.
A record grows only where its tokens start at its end: the tokens are appended, and where the
record's length before was not their start (a publish repeated after a lost answer, or a record
that lost its tail to a Redis restart) the append is undone, so nothing is appended twice and a
record stays a prefix of the output rather than get a hole. Appending first makes the usual row
two commands (the epoch's HGET, the APPEND) where checking the length first made three. A record's
TTL is set as it is created and renewed only on rows flagged for it (the worker flags a request's
row once every `RECORD_TTL_RENEW_S`), not on every append. Keys are made here from the ids,
because every argument costs the worker microseconds of redis-py's Python (a record or state key
is only ever used on a single Redis)."""
APPEND_AT_END = 2**32 - 1
"""A record's start position that appends wherever the record ends (a refusal's end marker)."""
RECORD_TTL_RENEW_S = OUTPUT_TTL_S / 4
"""How often a running request's delivered record has its TTL renewed: a record expires between
`OUTPUT_TTL_S - RECORD_TTL_RENEW_S` and `OUTPUT_TTL_S` after its last write."""
RECORD_COLUMNS = 5
"""Per row of `DeliveredRecords.columns`' header: id bytes, token bytes, start, epoch, renew TTL."""


@dataclass(frozen=True)
class DeliveredRecords:
    """Rows to append to requests' delivered records (`Keys.delivered`), column by column, so a step
    of hundreds of requests is built from its arrays and packed without a Python object a row.

    Row i is request `request_ids[i]`, placed under epoch `epochs[i]`; its `num_tokens[i]` tokens
    are the next ones of `token_ids` (ending in `OUTPUT_END` for a request that ended), the first at
    output position `starts[i]` (`APPEND_AT_END`: wherever the record ends).
    """

    request_ids: list[str]
    epochs: np.ndarray  # [num_rows] int
    starts: np.ndarray  # [num_rows] int
    num_tokens: np.ndarray  # [num_rows] int
    token_ids: np.ndarray  # [sum(num_tokens)] int32
    renew_ttl: np.ndarray  # [num_rows] bool: renew the record's TTL (a new record gets one anyway)

    @classmethod
    def of(cls, rows: Sequence[tuple[str, int, int, bytes]]) -> DeliveredRecords:
        """From (request id, epoch, start, int32 token bytes) rows, every TTL renewed (refusals,
        reports: rows that are not a step's)."""
        return cls(
            request_ids=[row[0] for row in rows],
            epochs=np.asarray([row[1] for row in rows], np.int64),
            starts=np.asarray([row[2] for row in rows], np.int64),
            num_tokens=np.asarray([len(row[3]) // TOKEN_DTYPE.itemsize for row in rows], np.int64),
            token_ids=np.frombuffer(b"".join(row[3] for row in rows), TOKEN_DTYPE),
            renew_ttl=np.ones(len(rows), bool),
        )

    def __len__(self) -> int:
        return len(self.request_ids)

    def columns(self) -> tuple[bytes, bytes, bytes]:
        """The script's three arguments: per row `RECORD_COLUMNS` <u4 (id bytes, token bytes, start,
        epoch, renew TTL), the ids' UTF-8 bytes concatenated, and the rows' int32 tokens."""
        ids = "".join(self.request_ids).encode()
        header = np.empty((len(self), RECORD_COLUMNS), "<u4")
        if len(ids) == sum(map(len, self.request_ids)):  # ASCII ids: a character is a byte
            header[:, 0] = np.fromiter(map(len, self.request_ids), np.int64, len(self))
        else:
            header[:, 0] = [len(request_id.encode()) for request_id in self.request_ids]
        header[:, 1] = TOKEN_DTYPE.itemsize * self.num_tokens
        header[:, 2] = self.starts
        header[:, 3] = self.epochs
        header[:, 4] = self.renew_ttl
        return header.tobytes(), ids, self.token_ids.astype(TOKEN_DTYPE, copy=False).tobytes()


ADMIT_FUNCTION_LUA = """
local function admit(state, depth, submit, max_len, owned, gateways, request_id, gateway_id, incarnation)
    if redis.call('HEXISTS', state, 'ended') == 1 then
        return -2
    end
    if redis.call('HSETNX', state, 'request', submit) == 0 then
        return 0
    end
    if redis.call('INCR', depth) > tonumber(max_len) then
        redis.call('DECR', depth)
        redis.call('DEL', state)
        return -1
    end
    redis.call('HSET', state, 'slot', 1, 'attempts', 0, 'epoch', 0)
    if owned then
        redis.call('HSET', state, 'gateway', gateway_id)
        redis.call('HSET', owned, request_id, incarnation)
        redis.call('SADD', gateways, gateway_id)
    end
    return 1
end
"""
"""Records a new request and takes its queue slot: 1, or 0 (a duplicate), -1 (the queue is full),
-2 (the request has ended); `owned` (its gateway's requests hash) may be nil."""

ADMIT_LUA = (
    ADMIT_FUNCTION_LUA
    + "return admit(KEYS[1], KEYS[2], ARGV[1], ARGV[2], KEYS[3], KEYS[4], ARGV[3], ARGV[4], ARGV[5])"
)
"""`admit`. KEYS: the request's state hash, the queue depth[, its gateway's requests hash, the
gateways set]. ARGV: the Submit, the longest queue[, the request id, the gateway id, the
gateway's incarnation]."""

ADMIT_AND_DISPATCH_LUA = (
    ADMIT_FUNCTION_LUA
    + """
local admitted = admit(KEYS[1], KEYS[2], ARGV[1], ARGV[2], KEYS[5], KEYS[6], ARGV[3], ARGV[4], ARGV[5])
if admitted == 1 then
    redis.call('HSET', KEYS[1], 'epoch', ARGV[6], 'instances', ARGV[7])
    redis.call('SADD', KEYS[4], ARGV[3])
    redis.call('XADD', KEYS[3], '*', ARGV[8], ARGV[9])
end
return admitted
"""
)
"""`admit_and_dispatch`. KEYS: the request's state hash, the queue depth, the instance's inbox and
assignment set[, the gateway's requests hash, the gateways set]. ARGV: the Submit, the longest
queue, the request id, the gateway id, the gateway's incarnation, the first epoch, the instance,
the payload field, the Dispatch."""

ADMIT_AND_RESERVE_LUA = (
    ADMIT_FUNCTION_LUA
    + """
local admitted = admit(KEYS[1], KEYS[2], ARGV[1], ARGV[2], KEYS[4], KEYS[5], ARGV[3], ARGV[4], ARGV[5])
if admitted == 1 then
    redis.call('HSET', KEYS[1], 'epoch', ARGV[6])
    redis.call('XADD', KEYS[3], '*', ARGV[7], ARGV[8])
end
return admitted
"""
)
"""`admit_and_reserve`. KEYS: the request's state hash, the queue depth, the decode instance's
inbox[, the gateway's requests hash, the gateways set]. ARGV: the Submit, the longest queue, the
request id, the gateway id, the gateway's incarnation, the first epoch, the payload field, the
Reserve."""

RELEASE_LUA = """
if redis.call('HDEL', KEYS[1], 'slot') == 1 then
    redis.call('DECR', KEYS[2])
end
local gateway = redis.call('HGET', KEYS[1], 'gateway')
if gateway then
    redis.call('HDEL', ARGV[3] .. gateway, ARGV[1])
end
redis.call('DEL', KEYS[1], KEYS[3])
redis.call('HSET', KEYS[1], 'ended', 1)
redis.call('EXPIRE', KEYS[1], ARGV[2])
for i = 4, #KEYS do
    redis.call('SREM', KEYS[i], ARGV[1])
end
return 1
"""
"""`release`. KEYS: state hash, queue depth, delivered record, then assignment sets. ARGV: the id,
how long the `ended` mark stays, the gateways' requests key prefix (the gateway's own key is read
from the state hash: only ever on a single Redis)."""

FORGET_GATEWAY_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then
    redis.call('SREM', KEYS[2], ARGV[1])
    return 1
end
return 0
"""
"""`forget_gateway`. KEYS: the gateway's requests hash, the gateways set. ARGV: the gateway id."""

DELETE_IF_EQUAL_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""
"""`delete_if_equal`. KEYS: the key. ARGV: the value it must still hold."""


CLAIM_EPOCH_LUA = """
if redis.call('HEXISTS', KEYS[1], 'slot') == 0 then
    return 0
end
if ARGV[1] ~= '' and redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then
    return 0
end
return redis.call('HINCRBY', KEYS[1], 'epoch', 1)
"""
"""`claim_epoch`. KEYS: the state hash. ARGV: the epoch the caller saw ('' for any)."""

DISPATCH_LUA = """
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then
    return 0
end
redis.call('HSET', KEYS[1], 'instances', ARGV[2])
for i = 3, #KEYS do
    redis.call('SADD', KEYS[i], ARGV[3])
end
redis.call('XADD', KEYS[2], '*', ARGV[4], ARGV[5])
return 1
"""
"""`dispatch`. KEYS: the state hash, the inbox, the instances' assignment sets. ARGV: the epoch,
the instances (comma-separated), the request id, the payload field, the payload."""

CLAIM_ORPHANED_LUA = """
local stream, group, me, lease_prefix, count = KEYS[1], ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local claimed = {}
for _, fields in ipairs(redis.call('XINFO', 'CONSUMERS', stream, group)) do
    local info = {}
    for i = 1, #fields, 2 do
        info[fields[i]] = fields[i + 1]
    end
    if info.name ~= me and redis.call('EXISTS', lease_prefix .. info.name) == 0 then
        if info.pending == 0 then
            redis.call('XGROUP', 'DELCONSUMER', stream, group, info.name)
        elseif #claimed < count then
            local ids = {}
            for _, entry in ipairs(redis.call('XPENDING', stream, group, '-', '+', count - #claimed, info.name)) do
                ids[#ids + 1] = entry[1]
            end
            if #ids > 0 then
                for _, entry in ipairs(redis.call('XCLAIM', stream, group, me, 0, unpack(ids))) do
                    claimed[#claimed + 1] = entry
                end
            end
        end
    end
end
return claimed
"""
"""`read_group`'s take-over by lease. KEYS: the stream. ARGV: the group, the consumer taking over,
the lease key prefix, the most messages to take. Consumers without a lease are gone: their pending
messages (up to the count) move to the caller at once, and those with none left are deleted."""


@dataclass(frozen=True)
class Placement:
    """Where an admitted request runs now."""

    epoch: int
    """The current placement's epoch (0 before the first dispatch)."""
    instance_ids: list[str]


FIRST_EPOCH = 1
"""The epoch of a request's first placement (`claim_epoch` of a request just admitted)."""
Admission = Literal["admitted", "duplicate", "queue_full", "ended"]
ADMISSIONS: dict[int, Admission] = {1: "admitted", 0: "duplicate", -1: "queue_full", -2: "ended"}
"""`ADMIT_LUA`'s answers."""


class Bus:
    def __init__(self, client: aioredis.Redis, keys: Keys):
        self.client = client
        self.keys = keys
        self._scripts: dict[str, AsyncScript] = {}
        self._claimed_at: dict[tuple[str, str, str], float] = {}
        self._reread: set[tuple[str, str, str]] = set()
        """(stream, group, consumer) whose own pending messages are read again next (`reread_pending`)."""

    async def _run_script(self, source: str, keys: Sequence[str], args: Sequence[bytes | str | int]) -> Any:
        """EVALSHA, loading the script on first use (and again after Redis lost its script cache)."""
        script = self._scripts.get(source)
        if script is None:
            script = self._scripts[source] = self.client.register_script(source)
        return await script(keys=list(keys), args=list(args))

    async def publish(self, stream: str, message: Message, maxlen: int | None = None) -> str:
        entry_id = await self.client.xadd(
            stream, {PAYLOAD_FIELD: encode(message)}, maxlen=maxlen, approximate=True
        )
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    async def publish_step(
        self,
        outputs: Sequence[tuple[str, bytes]],
        delivered: DeliveredRecords | Sequence[tuple[str, int, int, bytes]] = (),
        messages: Sequence[tuple[str, Message]] = (),
    ) -> list[str]:
        """A worker step's effects on the bus, atomically, in one command: `outputs` (gateway id,
        encoded `OutputBatch`) go to the gateways' output streams; `delivered` (`DeliveredRecords`,
        or rows of request id, the placement's epoch, output position of the first token, int32
        token bytes) are appended to the requests' delivered records where they start at the
        record's end, so a record is always a prefix of what its gateway was sent (all of it but
        after a Redis restart that lost writes); `messages` (stream, message) are plain XADDs
        (reports to the scheduler). Returns the ids of fenced requests (rows whose epoch is not the
        current one): if there are any, nothing was written. Safe to repeat: the gateway drops rows
        it already has. Output streams expire `OUTPUT_TTL_S` after their last write, records as
        `RECORD_TTL_RENEW_S` says."""
        if not isinstance(delivered, DeliveredRecords):
            delivered = DeliveredRecords.of(delivered)
        if not (outputs or len(delivered) or messages):
            return []
        keys = [*(self.keys.outputs(gateway) for gateway, _ in outputs), *(s for s, _ in messages)]
        args: list[bytes | str | int] = [
            OUTPUT_TTL_S,
            len(outputs),
            PAYLOAD_FIELD,
            self.keys.delivered(""),
            self.keys.request_state(""),
            *delivered.columns(),
            *(payload for _, payload in outputs),
            *(encode(message) for _, message in messages),
        ]
        fenced = await self._run_script(PUBLISH_STEP_LUA, keys, args)
        return [as_text(request_id) for request_id in fenced]

    async def trim_read(self, stream: str, last_id: str) -> None:
        """Drops a stream's entries before `last_id`: its one reader has read them."""
        await self.client.xtrim(stream, minid=last_id, approximate=False)

    async def delivered_tokens(self, request_id: str) -> tuple[list[int], bool]:
        """The tokens a request's gateway has been sent, and whether the request ended."""
        raw: Any = await self.client.get(self.keys.delivered(request_id))
        tokens = np.frombuffer(raw or b"", TOKEN_DTYPE).tolist()
        if tokens and tokens[-1] == OUTPUT_END:
            return tokens[:-1], True
        return tokens, False

    async def admit(self, request_id: str, submit: Message, max_queue_len: int) -> Admission:
        """Records a new request and takes a queue slot for it, in one round trip ("ended": the
        request was here and has ended; a late repeat of its Submit). A request that names its
        gateway's incarnation is also listed under its gateway (`Keys.gateway_requests`)."""
        keys = [self.keys.request_state(request_id), self.keys.queue_depth]
        args: list[bytes | str | int] = [encode(submit), max_queue_len]
        request = submit.request if isinstance(submit, Submit) else None
        if request is not None and request.gateway_id and request.gateway_incarnation:
            keys += [self.keys.gateway_requests(request.gateway_id), self.keys.gateways]
            args += [request_id, request.gateway_id, request.gateway_incarnation]
        result = await self._run_script(ADMIT_LUA, keys, args)
        return ADMISSIONS[int(result)]

    async def admit_and_dispatch(
        self, request_id: str, submit: Submit, max_queue_len: int, instance_id: str, dispatch: Message
    ) -> Admission:
        """`admit`, and for a request admitted now also its first placement on `instance_id` (epoch
        `FIRST_EPOCH`, which `dispatch` must carry; recorded as `dispatch` records it) and the
        `dispatch` to its inbox: one round trip where `admit`, `claim_epoch` and `dispatch` take
        three. Nothing is dispatched for a request not admitted now."""
        placement = [self.keys.inbox(instance_id), self.keys.assignments(instance_id)]
        keys, args = self._admission(request_id, submit, max_queue_len, placement)
        args += [FIRST_EPOCH, instance_id, PAYLOAD_FIELD, encode(dispatch)]
        return ADMISSIONS[int(await self._run_script(ADMIT_AND_DISPATCH_LUA, keys, args))]

    async def admit_and_reserve(
        self, request_id: str, submit: Submit, max_queue_len: int, decode_id: str, reserve: Message
    ) -> Admission:
        """`admit`, and for a request admitted now also its first placement's epoch (`FIRST_EPOCH`,
        which `reserve` must carry) and the `reserve` to the decode instance's inbox: one round trip
        where `admit`, `claim_epoch` and the Reserve's XADD take three. Where the placement runs is
        recorded later, with its prefill's `dispatch`. Nothing is sent for a request not admitted now."""
        keys, args = self._admission(request_id, submit, max_queue_len, [self.keys.inbox(decode_id)])
        args += [FIRST_EPOCH, PAYLOAD_FIELD, encode(reserve)]
        return ADMISSIONS[int(await self._run_script(ADMIT_AND_RESERVE_LUA, keys, args))]

    def _admission(
        self, request_id: str, submit: Submit, max_queue_len: int, placement_keys: list[str]
    ) -> tuple[list[str], list[bytes | str | int]]:
        """The KEYS and the leading ARGV the admitting scripts share: the request's state hash, the
        queue depth, `placement_keys`, then the gateway's requests hash and the gateways set where a
        gateway owns the request; the Submit, the longest queue, the request id, the owning
        gateway's id and incarnation ("" where none owns it)."""
        request = submit.request
        keys = [self.keys.request_state(request_id), self.keys.queue_depth, *placement_keys]
        owned = request.gateway_id and request.gateway_incarnation
        if owned:
            keys += [self.keys.gateway_requests(request.gateway_id or ""), self.keys.gateways]
        args: list[bytes | str | int] = [
            encode(submit),
            max_queue_len,
            request_id,
            (request.gateway_id or "") if owned else "",
            (request.gateway_incarnation or "") if owned else "",
        ]
        return keys, args

    async def release(self, request_id: str, *instance_ids: str) -> None:
        """Frees a request's queue slot (exactly once) and forgets it, leaving its `ended` mark for
        `ENDED_TTL_S`, and takes it off the assignments of `instance_ids`, in one round trip."""
        keys = [self.keys.request_state(request_id), self.keys.queue_depth, self.keys.delivered(request_id)]
        keys += [self.keys.assignments(instance_id) for instance_id in instance_ids]
        await self._run_script(RELEASE_LUA, keys, [request_id, ENDED_TTL_S, self.keys.gateway_requests("")])

    async def placement(self, request_id: str) -> Placement | None:
        """Where the request runs now; None once it ended (or was never admitted)."""
        raw: Any = await self.client.hmget(
            self.keys.request_state(request_id), ["slot", "epoch", "instances"]
        )
        slot, epoch, instances = raw
        if slot is None:
            return None
        return Placement(int(epoch or 0), [i for i in as_text(instances or b"").split(",") if i])

    async def claim_epoch(self, request_id: str, seen: int | None = None) -> int | None:
        """The epoch of a new placement of the request (one more than the current), if it is still
        admitted and, given `seen`, its current epoch is still `seen` (no one placed it since);
        else None. From then on, rows of earlier placements are fenced off (`publish_step`)."""
        epoch = await self._run_script(
            CLAIM_EPOCH_LUA, [self.keys.request_state(request_id)], ["" if seen is None else seen]
        )
        return int(epoch) or None

    async def dispatch(
        self, request_id: str, epoch: int, instance_ids: Sequence[str], stream: str, message: Message
    ) -> bool:
        """Records where the placement of `epoch` runs (for re-dispatch should those instances die)
        and sends it `message` there, atomically; False, sending nothing, if the request has ended
        or been placed again since (its epoch is no longer `epoch`)."""
        keys = [
            self.keys.request_state(request_id),
            stream,
            *(self.keys.assignments(instance_id) for instance_id in instance_ids),
        ]
        args: list[bytes | str | int] = [
            epoch,
            ",".join(instance_ids),
            request_id,
            PAYLOAD_FIELD,
            encode(message),
        ]
        return bool(await self._run_script(DISPATCH_LUA, keys, args))

    async def hold_lease(self, key: str, ttl_s: float, value: bytes | str = b"1") -> None:
        """Sets (or renews) a lease key, holding `value`, that expires `ttl_s` after this call."""
        await self.client.set(key, value, px=max(1, int(ttl_s * 1000)))

    async def gateway_owners(self) -> dict[str, str | None]:
        """Each gateway with admitted requests -> the incarnation holding its liveness now (None:
        none does), in two round trips."""
        gateway_ids = sorted(as_text(g) for g in await self.client.smembers(self.keys.gateways))
        if not gateway_ids:
            return {}
        values: Any = await self.client.mget([self.keys.gateway_liveness(g) for g in gateway_ids])
        return {g: None if v is None else as_text(v) for g, v in zip(gateway_ids, values)}

    async def gateway_requests(self, gateway_id: str) -> dict[str, str]:
        """A gateway's admitted, unfinished requests -> the incarnation that submitted each."""
        raw: Any = await self.client.hgetall(self.keys.gateway_requests(gateway_id))
        return {as_text(request_id): as_text(incarnation) for request_id, incarnation in raw.items()}

    async def forget_gateway(self, gateway_id: str) -> bool:
        """Drops a gateway from the watched set if it has no request left (atomically: a request
        admitted meanwhile keeps it there). Whether it was dropped."""
        keys = [self.keys.gateway_requests(gateway_id), self.keys.gateways]
        return bool(await self._run_script(FORGET_GATEWAY_LUA, keys, [gateway_id]))

    async def forget_instance(self, instance_id: str) -> None:
        """Removes an instance's heartbeat: the scheduler takes it for dead on its next look (for a
        supervisor that saw the process die, instead of waiting out the TTL)."""
        await self.client.delete(self.keys.heartbeat(instance_id))

    async def delete_if_equal(self, key: str, value: bytes | str) -> bool:
        """Deletes `key` if it still holds `value`, in one round trip: a replica removes a shared
        heartbeat only while it is the last one that wrote it. Whether it was deleted."""
        return bool(await self._run_script(DELETE_IF_EQUAL_LUA, [key], [value]))

    async def forget_scheduler(self, consumer: str) -> None:
        """Removes a scheduler replica's lease: the others take its pending messages over on their
        next read (for the replica itself as it stops, or a supervisor that saw it die)."""
        await self.client.delete(self.keys.scheduler_lease(consumer))

    async def ensure_group(self, stream: str, group: str, start_id: str = "0") -> None:
        try:
            await self.client.xgroup_create(stream, group, id=start_id, mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read_group(
        self,
        stream: str,
        group: str,
        consumer: str,
        count: int = 64,
        block_ms: int = 1000,
        claim_idle_ms: int = DEFAULT_CLAIM_IDLE_MS,
        lease_prefix: str | None = None,
    ) -> list[Delivery]:
        """Messages for `consumer`: first those other (dead) consumers left pending, then new ones.
        A consumer is dead once its lease (`lease_prefix` + its name) is gone, if the group's
        consumers hold leases; else, or also, when its messages have been pending for longer than
        `claim_idle_ms`. Dead consumers are looked for at most every `CLAIM_EVERY_S`. Undecodable
        entries are dead-lettered and acknowledged."""
        entries: list[Any] = []
        key = (stream, group, consumer)
        if key in self._reread:  # once: what fails again is flagged again by its handler
            self._reread.discard(key)
            entries = await self._own_pending(stream, group, consumer, count)
        if not entries and time.monotonic() - self._claimed_at.get(key, float("-inf")) >= CLAIM_EVERY_S:
            if lease_prefix is not None:
                entries = await self._claim_orphaned(stream, group, consumer, count, lease_prefix)
            if not entries:
                entries = await self._claim_stale(stream, group, consumer, count, claim_idle_ms)
            self._claimed_at[key] = float("-inf") if len(entries) == count else time.monotonic()
        if not entries:
            try:
                response: Any = await self.client.xreadgroup(
                    group, consumer, {stream: ">"}, count=count, block=block_ms
                )
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                await self.ensure_group(stream, group)  # the stream was deleted (a Redis restart)
                return []
            entries = response[0][1] if response else []
        return await self._decode_entries(stream, group, entries)

    def reread_pending(self, stream: str, group: str, consumer: str) -> None:
        """The consumer failed to handle messages it read (a Redis outage) and left them pending:
        its next read returns its pending messages again, first, instead of after `claim_idle_ms`
        (those still being handled too: handlers are idempotent)."""
        self._reread.add((stream, group, consumer))

    async def _own_pending(self, stream: str, group: str, consumer: str, count: int) -> list[Any]:
        """Up to `count` messages delivered to `consumer` and not acknowledged yet."""
        try:
            response: Any = await self.client.xreadgroup(group, consumer, {stream: "0"}, count=count)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            return []
        return response[0][1] if response else []

    async def ack(self, stream: str, group: str, *entry_ids: str) -> None:
        """Acknowledges the entries and deletes them from the stream: every stream read through a
        group has that one group, so an acknowledged entry is needed by no one, and a stream
        (`requests`, `scheduler-replies`, an inbox) holds only what is unhandled instead of growing
        with every message ever sent."""
        if entry_ids:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.xack(stream, group, *entry_ids)
                pipe.xdel(stream, *entry_ids)
                await pipe.execute()

    async def read_stream(
        self, stream: str, last_id: str, block_ms: int = 1000, count: int = 256
    ) -> tuple[list[Delivery], str]:
        """Plain (group-less) read after `last_id`: how a request's output is followed and resumed
        after a reconnect. Returns the decoded messages and the id to read after next time (past
        any undecodable entries, which are dead-lettered, so they are never read twice)."""
        response: Any = await self.client.xread({stream: last_id}, count=count, block=block_ms)
        entries = response[0][1] if response else []
        if entries:
            last_id = as_text(entries[-1][0])
        return await self._decode_entries(stream, None, entries), last_id

    async def dead_letter(self, stream: str, entry_id: str, raw: bytes | None, reason: str) -> None:
        logger.error("dead-lettered %s %s: %s", stream, entry_id, reason)
        await self.client.xadd(
            self.keys.dead_letters,
            {
                b"stream": stream,
                b"entry_id": entry_id,
                b"reason": reason,
                b"payload": raw or b"",
                b"at": str(time.time()),
            },
            maxlen=DEAD_LETTER_MAXLEN,
            approximate=True,
        )

    async def _claim_orphaned(
        self, stream: str, group: str, consumer: str, count: int, lease_prefix: str
    ) -> list[Any]:
        try:
            claimed: Any = await self._run_script(
                CLAIM_ORPHANED_LUA, [stream], [group, consumer, lease_prefix, count]
            )
        except ResponseError as exc:
            if "NOGROUP" in str(exc) or "no such key" in str(exc):
                await self.ensure_group(stream, group)
                return []
            raise
        if claimed:
            logger.warning(
                "%s took over %d message(s) pending with consumers gone from %s",
                consumer,
                len(claimed),
                stream,
            )
        # a script returns entries as Redis sends them: the fields as one flat list
        return [
            (entry[0], dict(zip(entry[1][::2], entry[1][1::2]))) for entry in claimed if entry and entry[1]
        ]

    async def _claim_stale(
        self, stream: str, group: str, consumer: str, count: int, idle_ms: int
    ) -> list[Any]:
        try:
            result: Any = await self.client.xautoclaim(
                stream, group, consumer, min_idle_time=idle_ms, start_id="0-0", count=count
            )
        except ResponseError as exc:
            if "NOGROUP" in str(exc):
                await self.ensure_group(stream, group)
                return []
            raise
        claimed = result[1]
        if claimed:
            logger.warning("%s took over %d pending message(s) on %s", consumer, len(claimed), stream)
        return [entry for entry in claimed if entry[1]]  # entries deleted meanwhile come back empty

    async def _decode_entries(self, stream: str, group: str | None, entries: list[Any]) -> list[Delivery]:
        deliveries = []
        for raw_id, fields in entries:
            entry_id = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
            payload = fields.get(PAYLOAD_FIELD)
            try:
                if payload is None:
                    raise ProtocolError(f"entry has no {PAYLOAD_FIELD.decode()!r} field")
                deliveries.append(Delivery(stream, entry_id, decode(payload)))
            except ProtocolError as exc:
                await self.dead_letter(stream, entry_id, payload, str(exc))
                if group is not None:
                    await self.ack(stream, group, entry_id)
        return deliveries
