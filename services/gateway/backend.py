"""The gateway's view of the mesh: submit a request, follow its token events, cancel it, check health.

`RedisBackend` is the real one: it XADDs `Submit` / `Cancel` to the requests stream, stamped with
this gateway's id, and workers send the outputs of every request of this gateway to one stream,
the gateway's own (`out:{gateway_id}`): each entry is an `OutputBatch`, a step's new tokens for
all of this gateway's requests that the step touched. ONE reader task follows that stream with a
blocking XREAD, decodes each batch once, and hands every row to its request, in order; a request
takes every row queued for it at once, as one event.
The reader remembers the last entry id, so after a Redis reconnect it resumes where it was: it
alone trims the stream, and only of entries it has read. Each request checks the continuity of its
rows (`continuity.py`): repeats are dropped, and a gap is waited on (a bounded time) for a replay,
never finished over. Health is probed in the background, so `/health` answers at once, even while
Redis does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.gateway.continuity import DEFAULT_REPLAY_TIMEOUT_S, Continuity
from shared import trace
from shared.bus import Bus, RedisSettings, connect, reraise_if_cancelled, retry_transient, stop_tasks
from shared.protocol import (
    PAYLOAD_FIELD,
    Cancel,
    ErrorInfo,
    GenerateRequest,
    OutputBatch,
    ProtocolError,
    Submit,
    TokenEvent,
    decode,
)

logger = logging.getLogger(__name__)

DEFAULT_REQUEST_TIMEOUT_S = 600.0
"""A request with no event for this long ends with a 504."""
READ_BLOCK_MS = 1000
"""Longest one XREAD blocks (keep it under redis-py's 5 s socket timeout)."""
READ_COUNT = 256
"""Most entries (batches) one XREAD returns."""
RECONNECT_BACKOFF_S = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
TRIM_EVERY_S = 1.0
"""How often the reader drops the entries it has read from its stream."""
SUBMIT_RETRY_S = 5.0
"""How long a submit is retried through a Redis outage before the client gets a 503."""
HEALTH_EVERY_S = 1.0
"""How often the background health probe asks Redis."""
HEALTH_PROBE_TIMEOUT_S = 2.0
"""A probe that takes longer than this counts as Redis not answering."""
DEFAULT_LIVENESS_TTL_S = 5.0
LIVENESS_RENEWALS_PER_TTL = 3


class MeshBackend(Protocol):
    """What the HTTP layer needs from the mesh."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def submit(self, request: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        """Sends the request into the mesh when iteration starts; yields its events (deltas) in
        order, the last one `finished` or carrying an `error`. Closing the iterator early stops
        following the request but does not cancel it: call `cancel` for that."""
        ...

    async def cancel(self, request_id: str, reason: str = "client disconnected") -> None:
        """Tells the mesh to stop the request and free its KV blocks; never raises."""
        ...

    async def health(self) -> tuple[bool, str]:
        """(ok, reason): ok when the bus answers and at least one worker is alive; answers at once
        (from the last probe), whatever state the bus is in."""
        ...


def error_event(request_id: str, code: int, type: str, message: str) -> TokenEvent:
    """The last event of a request the gateway ends itself (timeout, bus down)."""
    return TokenEvent(
        request_id=request_id, finished=True, error=ErrorInfo(code=code, type=type, message=message)
    )


@dataclass
class _Follow:
    """One open request and the rows read for it, not yet taken."""

    request_id: str
    rows: list[TokenEvent] = field(default_factory=list)
    waiter: asyncio.Future[None] | None = None

    def put(self, row: TokenEvent) -> None:
        self.rows.append(row)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def take(self, timeout_s: float) -> list[TokenEvent]:
        """Every row queued, at once (a request that fell behind catches up in one go), waiting
        up to `timeout_s` for one; none: the wait timed out."""
        if not self.rows:
            loop = asyncio.get_running_loop()
            self.waiter = loop.create_future()
            timer = loop.call_later(timeout_s, _wake, self.waiter)
            try:
                await self.waiter
            finally:
                timer.cancel()
                self.waiter = None
        rows, self.rows = self.rows, []
        return rows


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def coalesce(events: list[TokenEvent]) -> list[TokenEvent]:
    """Consecutive deltas of one request as one event (their tokens, text and logprobs in order,
    the last one's position and end), so a reader that fell behind writes one chunk for several
    steps; an error event (only ever the last) stays an event of its own."""
    ending = events[-1:] if events and events[-1].error is not None else []
    deltas = events[: len(events) - len(ending)]
    if len(deltas) < 2:
        return events
    last = deltas[-1]
    merged = TokenEvent(
        last.request_id,
        [token_id for event in deltas for token_id in event.token_ids],
        "".join(event.text for event in deltas),
        [logprob for event in deltas for logprob in event.logprobs],
        last.finished,
        last.finish_reason,
        last.stop_reason,
        last.num_output_tokens,
        last.spec_stats,
        prompt_logprobs=next((e.prompt_logprobs for e in deltas if e.prompt_logprobs is not None), None),
    )
    return [merged, *ending]


class RedisBackend:
    def __init__(
        self,
        settings: RedisSettings,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        read_block_ms: int = READ_BLOCK_MS,
        replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
        submit_retry_s: float = SUBMIT_RETRY_S,
        gateway_id: str | None = None,
        liveness_ttl_s: float = DEFAULT_LIVENESS_TTL_S,
    ):
        self.settings = settings
        self.keys = settings.keys
        self.request_timeout_s = request_timeout_s
        self.replay_timeout_s = replay_timeout_s
        self.submit_retry_s = submit_retry_s
        self.read_block_ms = read_block_ms
        self.gateway_id = gateway_id or uuid.uuid4().hex[:12]
        self.incarnation = uuid.uuid4().hex
        """This process's liveness value: a restart under the same `gateway_id` has another, so
        the requests of the one before are aborted while this one's are kept."""
        self.liveness_ttl_s = liveness_ttl_s
        self.stream = self.keys.outputs(self.gateway_id)
        self._client: aioredis.Redis | None = None
        self._bus: Bus | None = None
        self._reader: asyncio.Task[None] | None = None
        self._health_probe: asyncio.Task[None] | None = None
        self._liveness: asyncio.Task[None] | None = None
        self._health: tuple[bool, str] = (False, "not checked yet")
        self._follows: dict[str, _Follow] = {}
        """Open requests by id."""
        self._last_id = "0-0"

    # ---- lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> None:
        self._client = await connect(self.settings)
        self._bus = Bus(self._client, self.keys)
        await self._hold_liveness()  # before any submit: the scheduler aborts requests of the unknown
        self._liveness = asyncio.create_task(self._keep_liveness(), name="gateway-liveness")
        self._reader = asyncio.create_task(self._read_outputs(), name="gateway-output-reader")
        self._health = await self.check_health()
        self._health_probe = asyncio.create_task(self._probe_health(), name="gateway-health-probe")
        logger.info("gateway %s follows outputs on %s", self.gateway_id, self.settings.describe())

    async def close(self) -> None:
        tasks = (self._reader, self._health_probe, self._liveness)
        await stop_tasks([task for task in tasks if task is not None])
        self._reader = self._health_probe = self._liveness = None
        if self._client is not None:
            with contextlib.suppress(RedisError):
                await self._client.delete(self.stream)
                # what is left of ours is aborted at once (a successor's liveness is not ours to drop)
                await self.bus.delete_if_equal(self.keys.gateway_liveness(self.gateway_id), self.incarnation)
            await self._client.aclose()
            self._client = None

    @property
    def bus(self) -> Bus:
        if self._bus is None:
            raise RuntimeError("RedisBackend.start() has not been awaited")
        return self._bus

    @property
    def client(self) -> aioredis.Redis:
        return self.bus.client

    # ---- requests ------------------------------------------------------------------------------------

    async def submit(self, request: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        request_id = request.request_id
        follow = self._follow(request_id)
        continuity = Continuity(request_id, self.replay_timeout_s)
        try:
            try:
                stamp = {"gateway_id": self.gateway_id, "gateway_incarnation": self.incarnation}
                submit = Submit(request=request.model_copy(update=stamp))
                # a repeat is harmless: the scheduler admits a request id once
                await retry_transient(
                    lambda: self.bus.publish(self.keys.requests, submit), "submitting", self.submit_retry_s
                )
                trace.hop("gateway.submitted", request_id)
            except RedisError as exc:
                yield error_event(
                    request_id, 503, "service_unavailable", f"cannot reach the request bus (Redis): {exc}"
                )
                return
            while True:
                rows = await follow.take(continuity.wait_s(self.request_timeout_s))
                if not rows:
                    message = f"no answer from the mesh for {self.request_timeout_s:g} s"
                    ending = continuity.timeout_error() or error_event(request_id, 504, "timeout", message)
                    assert ending.error is not None
                    await self.cancel(request_id, reason=f"gateway timeout: {ending.error.message}")
                    yield ending
                    return
                for ready in coalesce(continuity.accept_all(rows)):
                    yield ready
                    if ready.finished or ready.error is not None:
                        return
        finally:
            self._follows.pop(request_id, None)

    async def cancel(self, request_id: str, reason: str = "client disconnected") -> None:
        try:
            await self.bus.publish(self.keys.requests, Cancel(request_id=request_id, reason=reason))
        except RedisError as exc:
            logger.warning("could not cancel %s (%s): %s", request_id, reason, exc)

    async def health(self) -> tuple[bool, str]:
        """Unhealthy too once a background loop has stopped: without its output reader the gateway
        answers nothing, without its liveness the scheduler aborts its requests, without its probe
        this answer goes stale."""
        if self._client is None:
            return False, "not started"
        for task, what in (
            (self._reader, "the output reader"),
            (self._liveness, "the liveness renewal"),
            (self._health_probe, "the health probe"),
        ):
            if task is None or task.done():
                return False, f"{what} has stopped"
        return self._health

    async def check_health(self) -> tuple[bool, str]:
        """Asks Redis now whether a worker is alive (a slow answer, past
        `HEALTH_PROBE_TIMEOUT_S`, counts as none)."""
        if self._client is None:
            return False, "not started"
        try:
            num_registered, num_live = await asyncio.wait_for(
                self._count_workers(self._client), HEALTH_PROBE_TIMEOUT_S
            )
        except (RedisError, asyncio.TimeoutError) as exc:
            reraise_if_cancelled(exc)
            reason = str(exc) or f"no answer in {HEALTH_PROBE_TIMEOUT_S:g} s"
            return False, f"Redis at {self.settings.describe()} does not answer: {reason}"
        if num_registered == 0:
            return False, f"no worker has registered on topic {self.settings.topic!r}"
        if num_live == 0:
            return False, f"no live worker: the heartbeats of all {num_registered} registered ones expired"
        return True, f"{num_live} live worker(s)"

    async def _count_workers(self, client: aioredis.Redis) -> tuple[int, int]:
        """(registered, live) worker instances."""
        raw_ids: Any = await client.smembers(self.keys.instances)
        if not raw_ids:
            return 0, 0
        return len(raw_ids), int(await client.exists(*(self.keys.heartbeat(_text(i)) for i in raw_ids)))

    async def _probe_health(self) -> None:
        """Keeps `health()`'s answer fresh (every `HEALTH_EVERY_S`), until cancelled."""
        while True:
            await asyncio.sleep(HEALTH_EVERY_S)
            self._health = await self.check_health()

    async def _hold_liveness(self) -> None:
        key = self.keys.gateway_liveness(self.gateway_id)
        await self.bus.hold_lease(key, self.liveness_ttl_s, self.incarnation)

    async def _keep_liveness(self) -> None:
        """Renews the liveness every third of its TTL, until cancelled; through a Redis outage it
        retries each turn (the scheduler waits a TTL after an outage before it judges)."""
        while True:
            await asyncio.sleep(self.liveness_ttl_s / LIVENESS_RENEWALS_PER_TTL)
            try:
                await self._hold_liveness()
            except RedisError as exc:
                reraise_if_cancelled(exc)
                logger.warning("renewing the gateway's liveness failed: %s", exc)

    def _follow(self, request_id: str) -> _Follow:
        if request_id in self._follows:
            raise ValueError(f"request id {request_id!r} is already open")
        follow = self._follows[request_id] = _Follow(request_id)
        return follow

    # ---- the one reader ------------------------------------------------------------------------------

    async def _read_outputs(self) -> None:
        """Blocking XREADs of this gateway's output stream, until cancelled."""
        failures, trimmed_at = 0, time.monotonic()
        while True:
            try:
                assert self._client is not None
                response: Any = await self._client.xread(
                    {self.stream: self._last_id}, count=READ_COUNT, block=self.read_block_ms
                )
                for _, entries in response.items() if isinstance(response, dict) else response or []:
                    for raw_id, fields in entries:
                        self._last_id = _text(raw_id)
                        await self._dispatch(self._last_id, fields.get(PAYLOAD_FIELD))
                if time.monotonic() - trimmed_at > TRIM_EVERY_S:
                    await self.bus.trim_read(self.stream, self._last_id)
                    trimmed_at = time.monotonic()
                failures = 0
            except Exception as exc:  # Redis gone (redis-py reconnects on the next call), or a bug
                reraise_if_cancelled(exc)
                delay_s = RECONNECT_BACKOFF_S[min(failures, len(RECONNECT_BACKOFF_S) - 1)]
                failures += 1
                if isinstance(exc, RedisError):
                    logger.warning("output read failed (%s); retrying in %.2f s", exc, delay_s)
                else:
                    logger.exception("output reader error; retrying in %.2f s", delay_s)
                await asyncio.sleep(delay_s)

    async def _dispatch(self, entry_id: str, payload: bytes | None) -> None:
        """Hands each row of one batch to its request (rows of requests no longer open are dropped:
        their clients went away)."""
        try:
            if payload is None:
                raise ProtocolError(f"entry has no {PAYLOAD_FIELD.decode()!r} field")
            batch = decode(payload)
            if not isinstance(batch, OutputBatch):
                raise ProtocolError(f"expected an output batch, got {batch.kind!r}")
        except ProtocolError as exc:
            with contextlib.suppress(RedisError):
                await self.bus.dead_letter(self.stream, entry_id, payload, str(exc))
            return
        for event in batch.events():
            trace.hop("gateway.read", event.request_id, event.num_output_tokens)
            follow = self._follows.get(event.request_id)
            if follow is not None:
                follow.put(event)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
