"""`specmesh suffix-cache`: the global suffix index of SuffixDecoding, shared by every decode worker.

SuffixDecoding (Oliaro et al. 2024, arXiv:2411.04975) drafts from a global suffix tree over
earlier requests' outputs. Here that tree lives in a CPU process, so a request on one decode
worker drafts from what any worker produced. Two consumers on one asyncio loop share the index:

- *updates* (`suffix:updates`, a plain XREAD, no consumer group): finished sequences, indexed
  whole; re-adding a sequence id replaces it, so reading one twice is harmless. Every replica
  reads every update, so each holds the whole index and any one can answer any look-up. The
  index holds the newest `--max-cached-requests` sequences; a (re)started replica first indexes
  them from the stream's tail, then reads on after the newest. Nothing is acknowledged: the
  index lives in the replica's memory and dies with it, so a consumer group would keep
  delivery state in Redis that nothing needs, and leave it behind when a replica is killed.
- *look-ups* (`suffix:lookups`, group `suffix-cache` shared by the replicas, read without
  acknowledgement: an answer is only useful within milliseconds, so a look-up lost in a crash
  needs no redelivery): each `SuffixLookup` goes to one replica and gets one `SuffixReply` on
  `suffix:replies:{instance}`. Look-ups older than `--stale-lookup-s` are dropped: the worker
  that sent them gave up long ago.

The heartbeat key (TTL `--scheduler-ttl`), renewed by every replica, tells workers to send
look-ups at all; a replica that stops deletes it only if it wrote it last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from redis.exceptions import RedisError

from services.engine.spec_decode.suffix_tree import (
    DEFAULT_MAX_TREE_DEPTH,
    GlobalSuffixIndex,
    check_spec_params,
    check_tree_params,
)
from services.runtime import (
    add_redis_args,
    bound_port,
    redis_settings,
    setup_logging,
    start_status_server,
    stop_event_on_signals,
)
from shared.bus import Bus, Delivery, RedisSettings, as_text, connect, reraise_if_cancelled, stop_tasks
from shared.keys import SUFFIX_GROUP
from shared.protocol import (
    PAYLOAD_FIELD,
    ProtocolError,
    SuffixDraftOut,
    SuffixLookup,
    SuffixReply,
    SuffixUpdate,
    decode,
    encode,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_CACHED = 10_000
"""As `suffix_decoding_max_cached_requests`: the service is the one global tree of the deployment."""
REPLY_MAXLEN = 1000
REPLY_TTL_S = 60
"""A worker's reply stream expires this long after the last reply (workers that died leave none)."""
SERVICE_S_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 0.1)


@dataclass(frozen=True)
class SuffixCacheSettings:
    redis: RedisSettings = field(default_factory=RedisSettings)
    max_tree_depth: int = DEFAULT_MAX_TREE_DEPTH
    """Longest path of the global tree, and so the longest match."""
    max_cached_requests: int = DEFAULT_MAX_CACHED
    """Finished sequences indexed, oldest evicted first."""
    max_spec_factor: float = 1.0
    """A match of m tokens drafts at most floor(max_spec_factor * m) tokens."""
    min_token_prob: float = 0.1
    """Drafts stop before their cumulative probability falls below this."""
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    """Port of /health and /metrics; 0 picks a free one."""
    heartbeat_ttl_s: float = 3.0
    stale_lookup_s: float = 1.0
    block_ms: int = 200
    """Longest a read blocks: how soon a stop request is noticed."""
    consumer: str = field(default_factory=lambda: f"suffix-cache-{socket.gethostname()}-{os.getpid()}")

    def __post_init__(self) -> None:
        check_tree_params(self.max_tree_depth, self.max_cached_requests)
        check_spec_params(0, self.max_spec_factor, self.min_token_prob)
        for name in ("heartbeat_ttl_s", "stale_lookup_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class SuffixCacheMetrics:
    """Prometheus series of one service, in its own registry."""

    def __init__(self, index: GlobalSuffixIndex, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        prefix, reg = "specmesh_suffix_cache", self.registry
        self.lookups = Counter(f"{prefix}_lookups", "Look-ups answered", registry=reg)
        self.queries = Counter(f"{prefix}_queries", "Queries (one per request) answered", registry=reg)
        self.stale_lookups = Counter(f"{prefix}_stale_lookups", "Look-ups dropped as stale", registry=reg)
        self.updates = Counter(f"{prefix}_updates", "Finished sequences indexed", registry=reg)
        self.dead_letters = Counter(f"{prefix}_dead_letters", "Messages dead-lettered", registry=reg)
        self.service_s = Histogram(
            f"{prefix}_lookup_service_seconds",
            "Time to answer one look-up (all its queries)",
            buckets=SERVICE_S_BUCKETS,
            registry=reg,
        )
        sizes: dict[str, tuple[str, Callable[[], float]]] = {
            "sequences": ("Sequences indexed", lambda: len(index)),
            "nodes": ("Nodes of the global tree", lambda: index.tree.num_nodes),
            "tokens": ("Tokens indexed", lambda: index.tree.num_tokens),
        }
        for name, (doc, read) in sizes.items():
            Gauge(f"{prefix}_{name}", doc, registry=reg).set_function(read)


class SuffixCacheService:
    """The global index, fed by the update stream and read by the look-up stream."""

    def __init__(self, bus: Bus, settings: SuffixCacheSettings, stop: asyncio.Event | None = None) -> None:
        self.bus = bus
        self.keys = bus.keys
        self.settings = settings
        self.index = GlobalSuffixIndex(
            settings.max_tree_depth,
            settings.max_cached_requests,
            settings.max_spec_factor,
            settings.min_token_prob,
        )
        self.metrics = SuffixCacheMetrics(self.index)
        self.stop = stop if stop is not None else asyncio.Event()
        """Set to drain: each consumer finishes its current batch and returns."""
        self.serving = False
        self._status: bytes | None = None
        """The heartbeat's value as this replica last wrote it."""

    async def health(self) -> tuple[bool, str]:
        """For /health: serving (with the index's size), or why not."""
        if self.serving:
            return True, f"{len(self.index)} sequences, {self.index.tree.num_nodes} nodes"
        return False, "draining" if self.stop.is_set() else "starting"

    async def run(self) -> None:
        """Serves until `stop` is set, then signs off (workers stop asking at once if it was the
        last replica)."""
        await self.bus.ensure_group(self.keys.suffix_lookups, SUFFIX_GROUP, start_id="$")
        await self._beat()
        tasks = [
            asyncio.create_task(self._consume_lookups(), name="suffix-lookups"),
            asyncio.create_task(self._consume_updates(), name="suffix-updates"),
            asyncio.create_task(self._keep_heartbeat(), name="suffix-heartbeat"),
        ]
        self.serving = True
        logger.info("suffix-cache serving on %s", self.settings.redis.describe())
        try:
            await asyncio.gather(*tasks)
        finally:
            self.serving = False
            await stop_tasks(tasks)
            await self._sign_off()

    async def _sign_off(self) -> None:
        """Removes this consumer from the look-up group (look-ups are never pending), and the
        heartbeat unless another replica renewed it since this one did."""
        try:
            if self._status is not None:
                await self.bus.delete_if_equal(self.keys.suffix_cache_heartbeat, self._status)
            await self.bus.client.xgroup_delconsumer(
                self.keys.suffix_lookups, SUFFIX_GROUP, self.settings.consumer
            )
        except (RedisError, OSError) as exc:  # the heartbeat expires on its own
            logger.warning("suffix-cache sign-off failed: %s", exc)

    # ---- look-ups ------------------------------------------------------------------------------------

    async def _consume_lookups(self) -> None:
        stream = self.keys.suffix_lookups
        while not self.stop.is_set():
            lookups = await self._read_lookups(stream)
            replies = [await self._answer(entry_id, lookup) for entry_id, lookup in lookups]
            await self._send_replies([reply for reply in replies if reply is not None])

    async def _answer(self, entry_id: str, lookup: SuffixLookup) -> tuple[str, SuffixReply] | None:
        try:
            return self.answer(lookup)
        except Exception as exc:  # a bug answering one look-up must not stop the others
            logger.exception("answering look-up %s failed", entry_id)
            await self._dead_letter(self.keys.suffix_lookups, entry_id, encode(lookup), repr(exc))
            return None

    def answer(self, lookup: SuffixLookup) -> tuple[str, SuffixReply] | None:
        """The reply to a look-up and the stream it goes to; None for a stale look-up."""
        if time.time() - lookup.sent_at > self.settings.stale_lookup_s:
            self.metrics.stale_lookups.inc()
            return None
        started = time.perf_counter()
        drafts = self.index.speculate_batch([(q.context, q.max_spec_tokens) for q in lookup.queries])
        reply = SuffixReply(
            lookup_id=lookup.lookup_id,
            drafts=[
                SuffixDraftOut(token_ids=d.token_ids, score=d.score) if d else SuffixDraftOut()
                for d in drafts
            ],
            service_s=time.perf_counter() - started,
        )
        self.metrics.lookups.inc()
        self.metrics.queries.inc(len(lookup.queries))
        self.metrics.service_s.observe(reply.service_s)
        return self.keys.suffix_replies(lookup.instance_id), reply

    async def _read_lookups(self, stream: str) -> list[tuple[str, SuffixLookup]]:
        """New look-ups, without acknowledgement (NOACK) and without reclaiming others' (all stale)."""
        try:
            response: Any = await self.bus.client.xreadgroup(
                SUFFIX_GROUP,
                self.settings.consumer,
                {stream: ">"},
                count=64,
                block=self.settings.block_ms,
                noack=True,
            )
        except (RedisError, OSError) as exc:
            await self._backoff(stream, exc)
            return []
        lookups = []
        for raw_id, fields in response[0][1] if response else []:
            entry_id = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
            payload = fields.get(PAYLOAD_FIELD)
            try:
                lookups.append((entry_id, self._expect(SuffixLookup, payload)))
            except ProtocolError as exc:
                await self._dead_letter(stream, entry_id, payload, str(exc))
        return lookups

    async def _send_replies(self, replies: list[tuple[str, SuffixReply]]) -> None:
        """All replies of a batch in one round trip; each reply stream trimmed and expiring."""
        if not replies:
            return
        async with self.bus.client.pipeline(transaction=False) as pipe:
            for stream, reply in replies:
                pipe.xadd(stream, {PAYLOAD_FIELD: encode(reply)}, maxlen=REPLY_MAXLEN, approximate=True)
                pipe.expire(stream, REPLY_TTL_S)
            try:
                await pipe.execute()
            except (RedisError, OSError) as exc:
                await self._backoff("suffix replies", exc)

    # ---- updates -------------------------------------------------------------------------------------

    async def _consume_updates(self) -> None:
        stream = self.keys.suffix_updates
        last_id = await self._reindex_tail(stream)
        while not self.stop.is_set():
            try:
                deliveries, last_id = await self.bus.read_stream(
                    stream, last_id, block_ms=self.settings.block_ms, count=32
                )
            except (RedisError, OSError) as exc:
                await self._backoff(stream, exc)
                continue
            for delivery in deliveries:
                await self._apply(delivery)
                await asyncio.sleep(0)  # let look-ups in between long sequences

    async def _apply(self, delivery: Delivery) -> None:
        update = delivery.message
        if not isinstance(update, SuffixUpdate):
            await self._dead_letter(
                delivery.stream,
                delivery.entry_id,
                encode(update),
                f"expected a suffix_update, got {update.kind!r}",
            )
            return
        self._index(update)

    def _index(self, update: SuffixUpdate) -> None:
        self.index.add_sequence(update.sequence_id, update.token_ids)
        self.metrics.updates.inc()

    async def _reindex_tail(self, stream: str) -> str:
        """Indexes the newest `max_cached_requests` updates in the stream, oldest first, so a
        (re)started replica drafts at once; returns the id to read on after ("0-0": none yet)."""
        entries = await self._tail(stream)
        for _, fields in reversed(entries):
            try:
                update = self._expect(SuffixUpdate, fields.get(PAYLOAD_FIELD))
            except ProtocolError:
                continue  # dead-lettered when it was first read
            self._index(update)
            await asyncio.sleep(0)
        if entries:
            logger.info("re-indexed %d sequence(s) from %s", len(self.index), stream)
        return as_text(entries[0][0]) if entries else "0-0"

    async def _tail(self, stream: str, page: int = 256) -> list[Any]:
        """The newest `max_cached_requests` entries of `stream`, newest first; retried until Redis
        answers (none if the service is stopped first)."""
        while not self.stop.is_set():
            entries: list[Any] = []
            newest = "+"
            try:
                while len(entries) < self.settings.max_cached_requests:
                    count = min(page, self.settings.max_cached_requests - len(entries))
                    batch: Any = await self.bus.client.xrevrange(stream, max=newest, min="-", count=count)
                    if not batch:
                        break
                    entries.extend(batch)
                    newest = "(" + as_text(batch[-1][0])
                return entries
            except (RedisError, OSError) as exc:
                await self._backoff(f"re-indexing {stream}", exc)
        return []

    # ---- liveness and helpers ------------------------------------------------------------------------

    async def _keep_heartbeat(self) -> None:
        while not self.stop.is_set():
            try:
                await asyncio.wait_for(self.stop.wait(), timeout=self.settings.heartbeat_ttl_s / 3)
            except asyncio.TimeoutError:
                await self._beat()

    async def _beat(self) -> None:
        status = {
            "consumer": self.settings.consumer,
            "sequences": len(self.index),
            "nodes": self.index.tree.num_nodes,
            "max_tree_depth": self.settings.max_tree_depth,
            "max_spec_factor": self.settings.max_spec_factor,
            "min_token_prob": self.settings.min_token_prob,
            "at": time.time(),
        }
        value = json.dumps(status).encode()
        try:
            await self.bus.client.set(
                self.keys.suffix_cache_heartbeat, value, px=int(self.settings.heartbeat_ttl_s * 1000)
            )
            self._status = value
        except (RedisError, OSError) as exc:
            logger.warning("suffix-cache heartbeat failed: %s", exc)

    @staticmethod
    def _expect(kind: type[SuffixLookup] | type[SuffixUpdate], payload: bytes | None) -> Any:
        if payload is None:
            raise ProtocolError(f"entry has no {PAYLOAD_FIELD.decode()!r} field")
        message = decode(payload)
        if not isinstance(message, kind):
            raise ProtocolError(f"expected a {kind.__name__}, got {message.kind!r}")
        return message

    async def _dead_letter(self, stream: str, entry_id: str, payload: bytes | None, reason: str) -> None:
        self.metrics.dead_letters.inc()
        await self.bus.dead_letter(stream, entry_id, payload, reason)

    async def _backoff(self, what: str, exc: Exception) -> None:
        reraise_if_cancelled(exc)
        logger.warning("suffix-cache: %s failed (%s); retrying", what, exc)
        await asyncio.sleep(0.5)


# ---- the process -----------------------------------------------------------------------------------------


async def serve(
    settings: SuffixCacheSettings, ready: Callable[[SuffixCacheService, int], None] | None = None
) -> None:
    """Connects, serves /health and /metrics, and the index until SIGTERM/SIGINT; drains and closes.

    `ready(service, metrics_port)` is called once everything listens (tests, embedding).
    """
    client = await connect(settings.redis)
    service = SuffixCacheService(Bus(client, settings.redis.keys), settings, stop=stop_event_on_signals())
    runner = await start_status_server(
        settings.metrics_host, settings.metrics_port, service.metrics.registry, service.health
    )
    port = bound_port(runner)
    logger.info("status server", extra={"role": "suffix-cache", "port": port})
    try:
        if ready is not None:
            ready(service, port)
        await service.run()
    finally:
        await runner.cleanup()
        await client.aclose()
    logger.info("suffix-cache stopped with %d sequence(s) indexed", len(service.index))


def settings_from_args(args: argparse.Namespace) -> SuffixCacheSettings:
    return SuffixCacheSettings(
        redis=redis_settings(args),
        max_tree_depth=args.max_tree_depth,
        max_cached_requests=args.max_cached_requests,
        max_spec_factor=args.max_spec_factor,
        min_token_prob=args.min_token_prob,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        heartbeat_ttl_s=args.scheduler_ttl,
        stale_lookup_s=args.stale_lookup_s,
    )


def run_suffix_cache(args: argparse.Namespace) -> int:
    """The `suffix-cache` handler: 0 after a clean stop, 1 when Redis cannot be reached."""
    setup_logging(args.suffix_cache_log_level, "suffix-cache")
    settings = settings_from_args(args)
    logger.info("suffix-cache starting on %s", settings.redis.describe())
    try:
        _run(serve(settings))
    except ConnectionError as exc:
        logger.error("%s", exc)
        return 1
    return 0


def _run(main: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop
    except ImportError:  # not on Windows
        asyncio.run(main)
        return
    uvloop.run(main)


def add_suffix_cache_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds `specmesh suffix-cache` to the CLI's subparsers (`add_subparsers()`'s result)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "suffix-cache", help="serve the global suffix index shared by decode workers (SuffixDecoding)"
    )
    add_redis_args(parser)  # --scheduler-ttl is the heartbeat's TTL
    index = parser.add_argument_group("index")
    index.add_argument("--max-tree-depth", type=int, default=DEFAULT_MAX_TREE_DEPTH, help="longest match")
    index.add_argument("--max-cached-requests", type=int, default=DEFAULT_MAX_CACHED, help="sequences kept")
    index.add_argument("--max-spec-factor", type=float, default=1.0, help="draft length per matched token")
    index.add_argument("--min-token-prob", type=float, default=0.1, help="drafts stop below this probability")
    index.add_argument(
        "--stale-lookup-s",
        type=float,
        default=1.0,
        help="drop look-ups older than this (the worker moved on)",
    )
    parser.add_argument("--metrics-host", default="127.0.0.1")
    parser.add_argument(
        "--metrics-port", type=int, default=0, help="/health and /metrics (0 picks a free port)"
    )
    parser.add_argument("--log-level", dest="suffix_cache_log_level", default="INFO")
    parser.set_defaults(handler=run_suffix_cache)
    return parser
