"""The gateway's view of the mesh: submit a request, follow its token events, cancel it, check health.

`RedisBackend` is the real one: it XADDs `Submit` / `Cancel` to the requests stream and follows
every open request's `out:{request_id}` stream with ONE reader task doing one multiplexed blocking
XREAD over all of them, dispatching each decoded `TokenEvent` to its request's queue in order.
The reader remembers the last entry id of every stream, so after a Redis reconnect it resumes
where it was (output streams outlive their requests by `OUTPUT_TTL_S`) and nothing is lost or
repeated.

A blocking XREAD only watches the streams it was given. A request that starts while the reader is
blocked must not wait out the block, so the reader also watches this gateway's own wake stream;
a submit that finds the reader blocked XADDs to it in the same round trip as the `Submit`. The
wake entry is read by id, so it works even when it lands before the XREAD reaches Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from redis.typing import KeyT, StreamIdT

from shared.bus import Bus, RedisSettings, connect, reraise_if_cancelled, stop_tasks
from shared.protocol import (
    PAYLOAD_FIELD,
    Cancel,
    ErrorInfo,
    GenerateRequest,
    ProtocolError,
    Submit,
    TokenEvent,
    decode,
    encode,
)

logger = logging.getLogger(__name__)

DEFAULT_REQUEST_TIMEOUT_S = 600.0
"""A request with no event for this long ends with a 504."""
READ_BLOCK_MS = 1000
"""Longest one XREAD blocks (keep it under redis-py's 5 s socket timeout); new requests wake the
reader, so this bounds nothing a client waits for."""
READ_COUNT = 256
"""Most entries one XREAD returns per stream."""
WAKE_MAXLEN = 16
WAKE_TTL_S = 3600
"""A crashed gateway's wake stream disappears after this long."""
RECONNECT_BACKOFF_S = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


class MeshBackend(Protocol):
    """What the HTTP layer needs from the mesh."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def submit(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Sends the request into the mesh when iteration starts; yields its events (deltas) in
        order, the last one `finished` or carrying an `error`. Closing the iterator early stops
        following the request but does not cancel it: call `cancel` for that."""
        ...

    async def cancel(self, request_id: str, reason: str = "client disconnected") -> None:
        """Tells the mesh to stop the request and free its KV blocks; never raises."""
        ...

    async def health(self) -> tuple[bool, str]:
        """(ok, reason): ok when the bus answers and at least one worker is alive."""
        ...


def error_event(request_id: str, code: int, type: str, message: str) -> TokenEvent:
    """The last event of a request the gateway ends itself (timeout, bus down)."""
    return TokenEvent(
        request_id=request_id, finished=True, error=ErrorInfo(code=code, type=type, message=message)
    )


def wake_stream(settings: RedisSettings, gateway_id: str) -> str:
    """This gateway's wake stream (read only by its own reader)."""
    return settings.keys.gateway_wake(gateway_id)


@dataclass
class _Follow:
    """One open request: where its output stream is and what has been read of it."""

    request_id: str
    stream: str
    last_id: str = "0-0"
    queue: asyncio.Queue[TokenEvent] = field(default_factory=asyncio.Queue)


class RedisBackend:
    def __init__(
        self,
        settings: RedisSettings,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        read_block_ms: int = READ_BLOCK_MS,
    ):
        self.settings = settings
        self.keys = settings.keys
        self.request_timeout_s = request_timeout_s
        self.read_block_ms = read_block_ms
        self.gateway_id = uuid.uuid4().hex[:12]
        self.wake_stream = wake_stream(settings, self.gateway_id)
        self._client: aioredis.Redis | None = None
        self._bus: Bus | None = None
        self._reader: asyncio.Task[None] | None = None
        self._follows: dict[str, _Follow] = {}
        """Open requests by output stream key."""
        self._has_follows = asyncio.Event()
        self._reading = False
        """The reader is in (or about to send) an XREAD whose stream set is already fixed."""
        self._wake_pending = False
        self._wake_last_id = "0-0"

    # ---- lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> None:
        self._client = await connect(self.settings)
        self._bus = Bus(self._client, self.keys)
        self._reader = asyncio.create_task(self._read_outputs(), name="gateway-output-reader")
        logger.info("gateway %s follows outputs on %s", self.gateway_id, self.settings.describe())

    async def close(self) -> None:
        if self._reader is not None:
            await stop_tasks([self._reader])
            self._reader = None
        if self._client is not None:
            with contextlib.suppress(RedisError):
                await self._client.delete(self.wake_stream)
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

    async def submit(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        request_id = request.request_id
        follow = self._follow(request_id)
        try:
            try:
                await self._publish_submit(request)
            except RedisError as exc:
                yield error_event(
                    request_id, 503, "service_unavailable", f"cannot reach the request bus (Redis): {exc}"
                )
                return
            while True:
                try:
                    event = await asyncio.wait_for(follow.queue.get(), self.request_timeout_s)
                except asyncio.TimeoutError:
                    message = f"no answer from the mesh for {self.request_timeout_s:g} s"
                    await self.cancel(request_id, reason=f"gateway timeout: {message}")
                    yield error_event(request_id, 504, "timeout", message)
                    return
                yield event
                if event.finished or event.error is not None:
                    return
        finally:
            self._unfollow(follow.stream)

    async def cancel(self, request_id: str, reason: str = "client disconnected") -> None:
        try:
            await self.bus.publish(self.keys.requests, Cancel(request_id=request_id, reason=reason))
        except RedisError as exc:
            logger.warning("could not cancel %s (%s): %s", request_id, reason, exc)

    async def health(self) -> tuple[bool, str]:
        if self._client is None:
            return False, "not started"
        if self._reader is None or self._reader.done():
            return False, "the output reader has stopped"
        try:
            raw_ids: Any = await self._client.smembers(self.keys.instances)
            instance_ids = sorted(i.decode() if isinstance(i, bytes) else str(i) for i in raw_ids)
            if not instance_ids:
                return False, f"no worker has registered on topic {self.settings.topic!r}"
            num_live = int(await self._client.exists(*(self.keys.heartbeat(i) for i in instance_ids)))
        except RedisError as exc:
            return False, f"Redis at {self.settings.describe()} does not answer: {exc}"
        if num_live == 0:
            return False, f"no live worker: the heartbeats of all {len(instance_ids)} registered ones expired"
        return True, f"{num_live} live worker(s)"

    def _follow(self, request_id: str) -> _Follow:
        follow = _Follow(request_id, self.keys.output(request_id))
        if follow.stream in self._follows:
            raise ValueError(f"request id {request_id!r} is already open")
        self._follows[follow.stream] = follow
        self._has_follows.set()
        return follow

    def _unfollow(self, stream: str) -> None:
        self._follows.pop(stream, None)
        if not self._follows:
            self._has_follows.clear()

    async def _publish_submit(self, request: GenerateRequest) -> None:
        """XADD the Submit, and (same round trip) wake the reader if it is blocked without us."""
        wake = self._reading and not self._wake_pending
        if not wake:
            await self.bus.publish(self.keys.requests, Submit(request=request))
            return
        self._wake_pending = True
        assert self._client is not None
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.xadd(self.keys.requests, {PAYLOAD_FIELD: encode(Submit(request=request))})
            pipe.xadd(self.wake_stream, {b"w": b""}, maxlen=WAKE_MAXLEN, approximate=True)
            pipe.expire(self.wake_stream, WAKE_TTL_S)
            await pipe.execute()

    # ---- the one reader ------------------------------------------------------------------------------

    async def _read_outputs(self) -> None:
        """Multiplexed XREAD over every open request's output stream, until cancelled."""
        failures = 0
        while True:
            await self._has_follows.wait()
            self._reading = True
            streams: dict[KeyT, StreamIdT] = {
                stream: follow.last_id for stream, follow in self._follows.items()
            }
            streams[self.wake_stream] = self._wake_last_id
            try:
                assert self._client is not None
                response: Any = await self._client.xread(streams, count=READ_COUNT, block=self.read_block_ms)
                await self._dispatch(response)
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
            finally:
                self._reading = False
                self._wake_pending = False

    async def _dispatch(self, response: Any) -> None:
        items = response.items() if isinstance(response, dict) else (response or [])
        for raw_stream, entries in items:
            stream = raw_stream.decode() if isinstance(raw_stream, bytes) else str(raw_stream)
            if stream == self.wake_stream:
                self._wake_last_id = _text(entries[-1][0])
                continue
            for raw_id, fields in entries:
                follow = self._follows.get(stream)
                if follow is None:  # closed meanwhile (client gone): the rest is nobody's
                    break
                follow.last_id = _text(raw_id)
                event = await self._decode_event(stream, follow.last_id, fields)
                if event is None:
                    continue
                follow.queue.put_nowait(event)
                if event.finished or event.error is not None:
                    self._unfollow(stream)

    async def _decode_event(
        self, stream: str, entry_id: str, fields: dict[bytes, bytes]
    ) -> TokenEvent | None:
        payload = fields.get(PAYLOAD_FIELD)
        try:
            if payload is None:
                raise ProtocolError(f"entry has no {PAYLOAD_FIELD.decode()!r} field")
            message = decode(payload)
            if not isinstance(message, TokenEvent):
                raise ProtocolError(f"expected a token event, got {message.kind!r}")
            return message
        except ProtocolError as exc:
            with contextlib.suppress(RedisError):
                await self.bus.dead_letter(stream, entry_id, payload, str(exc))
            return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
