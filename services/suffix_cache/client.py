"""A decode worker's handle on the suffix-cache service: the `GlobalIndex` of its `SuffixProposer`.

The engine step runs in its own thread; the worker's bus runs on an asyncio loop in another. A
look-up is built in the engine thread, published through the loop, and waited for at most
`deadline_s`: an answer that comes later is worth nothing to a step that has moved on, so the step
drafts from the per-request indexes alone (every query answers None) and the late reply is dropped
when it arrives. While the service's heartbeat key is missing, look-ups are not even sent.

Terms: a *look-up* is one `SuffixLookup` (all of a step's queries); its *round trip* is from
building it in the engine thread to the engine thread holding the reply; it is *answered* when the
reply came within the deadline, *late* when not, *skipped* when the service was down.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Coroutine
from typing import Any

from redis.exceptions import RedisError

from services.engine.spec_decode.suffix_tree import SuffixDraft
from shared.bus import Bus, reraise_if_cancelled, stop_tasks
from shared.protocol import (
    PAYLOAD_FIELD,
    ProtocolError,
    SuffixLookup,
    SuffixQuery,
    SuffixReply,
    SuffixUpdate,
    decode,
)

logger = logging.getLogger(__name__)

DEFAULT_DEADLINE_S = 0.002
LOOKUP_MAXLEN = 1000
"""Look-ups are answered within a second or dropped as stale: the stream needs no long history."""
UPDATE_MAXLEN = 20_000
"""Finished sequences kept in the update stream for a restarted service to re-index."""

ReplyFuture = concurrent.futures.Future[SuffixReply]


class RemoteSuffixIndex:
    """`GlobalIndex` backed by the suffix-cache service, for one decode worker (`instance_id`).

    Construct and `await start()` on the worker's loop; call `speculate_batch` and `add_sequence`
    from the engine thread (`add_sequence` also from the loop); `await close()` on shutdown.
    The service applies its own tree depth and draft limits (its `--max-*` flags); drafts come
    back with token ids and score only (`probs` empty, `match_len` 0).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        bus: Bus,
        instance_id: str,
        deadline_s: float = DEFAULT_DEADLINE_S,
        heartbeat_poll_s: float = 0.5,
        reply_block_ms: int = 100,
        latency_window: int = 1024,
    ) -> None:
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.loop = loop
        self.bus = bus
        self.keys = bus.keys
        self.instance_id = instance_id
        self.deadline_s = deadline_s
        self.heartbeat_poll_s = heartbeat_poll_s
        self.reply_block_ms = reply_block_ms
        self.service_up = False
        """Whether the service's heartbeat key was there at the last poll."""
        self.num_answered = 0
        self.num_late = 0
        self.num_skipped = 0
        self.num_late_replies = 0
        """Replies that arrived after their look-up gave up (or for look-ups this client never sent)."""
        self.num_updates = 0
        self.num_errors = 0
        """Publishes that failed and replies that did not fit their look-up."""
        self._round_trips_s: deque[float] = deque(maxlen=latency_window)
        self._pending: dict[int, ReplyFuture] = {}
        # random start: a restarted worker with the same instance id never matches an old reply
        self._lookup_ids = itertools.count(random.getrandbits(40))
        self._last_reply_id = "$"
        self._loop_thread: int | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # ---- lifecycle (on the loop) -------------------------------------------------------------------

    async def start(self) -> None:
        """Checks the heartbeat once, then follows replies and the heartbeat in background tasks."""
        self._loop_thread = threading.get_ident()
        await self._poll_heartbeat()
        self._last_reply_id = await self._newest_reply_id()
        self._tasks = [
            asyncio.create_task(self._follow_replies(), name="suffix-replies"),
            asyncio.create_task(self._follow_heartbeat(), name="suffix-heartbeat"),
        ]

    async def close(self) -> None:
        self.service_up = False
        await stop_tasks(self._tasks)
        self._tasks = []

    # ---- GlobalIndex (from the engine thread) ------------------------------------------------------

    def add_sequence(self, seq_id: str, token_ids: list[int]) -> None:
        """Publishes a finished sequence, fire-and-forget (the stream keeps it while the service is down)."""
        update = SuffixUpdate(sequence_id=seq_id, token_ids=token_ids)
        self._submit(self.bus.publish(self.keys.suffix_updates, update, maxlen=UPDATE_MAXLEN))
        self.num_updates += 1

    def speculate_batch(self, queries: list[tuple[list[int], int]]) -> list[SuffixDraft | None]:
        """The service's draft per (context, max_spec_tokens), or None for all after `deadline_s`."""
        if not queries:
            return []
        if not self.service_up:
            self.num_skipped += 1
            return [None] * len(queries)
        if threading.get_ident() == self._loop_thread:
            raise RuntimeError("speculate_batch waits for the loop: call it from the engine thread")
        started = time.perf_counter()
        lookup = SuffixLookup(
            lookup_id=next(self._lookup_ids),
            instance_id=self.instance_id,
            queries=[SuffixQuery(request_id="", context=c, max_spec_tokens=k) for c, k in queries],
        )
        future: ReplyFuture = concurrent.futures.Future()
        self._pending[lookup.lookup_id] = future
        self._submit(self.bus.publish(self.keys.suffix_lookups, lookup, maxlen=LOOKUP_MAXLEN))
        try:
            reply = future.result(timeout=self.deadline_s - (time.perf_counter() - started))
        except concurrent.futures.TimeoutError:
            self._pending.pop(lookup.lookup_id, None)
            self.num_late += 1
            return [None] * len(queries)
        self._round_trips_s.append(time.perf_counter() - started)
        return self._drafts(reply, queries)

    # ---- statistics ----------------------------------------------------------------------------------

    def round_trip_quantile_s(self, q: float) -> float | None:
        """The q-quantile (nearest rank) of the last `latency_window` answered round trips."""
        window = sorted(self._round_trips_s)
        if not window:
            return None
        return window[min(len(window) - 1, int(q * len(window)))]

    @property
    def round_trip_p50_s(self) -> float | None:
        return self.round_trip_quantile_s(0.5)

    @property
    def round_trip_p99_s(self) -> float | None:
        return self.round_trip_quantile_s(0.99)

    def stats(self) -> dict[str, Any]:
        """A snapshot for the worker's metrics."""
        return {
            "service_up": self.service_up,
            "num_answered": self.num_answered,
            "num_late": self.num_late,
            "num_skipped": self.num_skipped,
            "num_late_replies": self.num_late_replies,
            "num_updates": self.num_updates,
            "num_errors": self.num_errors,
            "round_trip_p50_s": self.round_trip_p50_s,
            "round_trip_p99_s": self.round_trip_p99_s,
        }

    # ---- helpers -------------------------------------------------------------------------------------

    def _drafts(self, reply: SuffixReply, queries: list[tuple[list[int], int]]) -> list[SuffixDraft | None]:
        if len(reply.drafts) != len(queries):
            logger.error(
                "suffix reply %d has %d drafts for %d queries",
                reply.lookup_id,
                len(reply.drafts),
                len(queries),
            )
            self.num_errors += 1
            return [None] * len(queries)
        self.num_answered += 1
        # never longer than asked: the engine sizes k so that a step cannot pass max_tokens
        return [
            SuffixDraft(token_ids=draft.token_ids[:k], score=draft.score)
            for draft, (_, k) in zip(reply.drafts, queries)
        ]

    def _submit(self, coro: Coroutine[Any, Any, Any]) -> None:
        try:
            done = asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError:  # the loop is closed: the worker is shutting down
            coro.close()
            self.num_errors += 1
            return
        done.add_done_callback(self._check_published)

    def _check_published(self, done: concurrent.futures.Future[Any]) -> None:
        if not done.cancelled() and done.exception() is not None:
            self.num_errors += 1
            logger.warning("suffix-cache publish failed: %s", done.exception())

    async def _newest_reply_id(self) -> str:
        """Where following the reply stream starts: after its newest entry (older ones are not ours)."""
        newest: Any = await self.bus.client.xrevrange(self.keys.suffix_replies(self.instance_id), count=1)
        if not newest:
            return "0-0"
        raw_id = newest[0][0]
        return raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)

    async def _follow_replies(self) -> None:
        stream = self.keys.suffix_replies(self.instance_id)
        while True:
            try:
                response: Any = await self.bus.client.xread(
                    {stream: self._last_reply_id}, count=256, block=self.reply_block_ms
                )
            except (RedisError, OSError) as exc:
                reraise_if_cancelled(exc)
                logger.warning("reading suffix replies failed (%s); retrying", exc)
                await asyncio.sleep(0.2)
                continue
            for raw_id, fields in response[0][1] if response else []:
                # advance past every entry, also undecodable ones, so none is read twice
                self._last_reply_id = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
                await self._resolve(stream, fields.get(PAYLOAD_FIELD))

    async def _resolve(self, stream: str, payload: bytes | None) -> None:
        try:
            if payload is None:
                raise ProtocolError(f"entry has no {PAYLOAD_FIELD.decode()!r} field")
            reply = decode(payload)
            if not isinstance(reply, SuffixReply):
                raise ProtocolError(f"expected a suffix_reply, got {reply.kind!r}")
        except ProtocolError as exc:
            await self.bus.dead_letter(stream, self._last_reply_id, payload, str(exc))
            return
        future = self._pending.pop(reply.lookup_id, None)
        if future is None:
            self.num_late_replies += 1
            return
        future.set_result(reply)

    async def _follow_heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_poll_s)
            await self._poll_heartbeat()

    async def _poll_heartbeat(self) -> None:
        try:
            up = bool(await self.bus.client.exists(self.keys.suffix_cache_heartbeat))
        except (RedisError, OSError) as exc:
            reraise_if_cancelled(exc)
            logger.warning("checking the suffix-cache heartbeat failed: %s", exc)
            up = False
        if up != self.service_up:
            logger.info("suffix-cache service is %s", "up" if up else "down: look-ups skipped")
        self.service_up = up
