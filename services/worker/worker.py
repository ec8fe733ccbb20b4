"""A worker process: the bus side of an engine (mixed, prefill or decode role).

receive  (inbox: Dispatch / Reserve / Cancel)   -> commands to the engine-core process
step     (the engine-core process, continuously) -> a StepBatch per step, back over its socket
emit     (per gateway one OutputBatch, the requests' delivered records and the scheduler's Finished
          reports: one script call; KV to decode instances)

The engine runs in its own process (`engine_core.py`), so this process's interpreter lock is never
what a step waits for, and publishing never waits for a step.

Each request runs here under the epoch of its placement (`Dispatch.epoch`). The publish refuses
rows of a placement that is no longer current (the scheduler took this instance for dead and placed
the request elsewhere, or here again); a request found *fenced* that way is stopped here without a
word to its client or the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from redis.exceptions import RedisError

from services.engine.kv_export import KVExport, KVStreamMessage, KVStreamStart
from services.kv_transport import (
    KVExpectation,
    KVHeader,
    KVSendSession,
    KVTransferCancelled,
    KVTransferError,
    KVTransport,
    LayerShape,
    ReceivedLayer,
    ReceivedTransfer,
    TensorSpec,
    make_transport,
)
from services.kv_transport.base import dtype_name
from services.kv_transport.ipc import KVSharedUnusable
from services.kv_transport.ipc_buffer import SharedKV
from services.kv_transport.tls import TlsFiles
from services.worker.core_client import EngineCoreClient, EngineCoreDied
from services.worker.core_messages import Reply, StepBatch, concat
from services.worker.metrics import WorkerMetrics
from shared import trace
from shared.bus import (
    APPEND_AT_END,
    END_BYTES,
    RECORD_TTL_RENEW_S,
    TRANSIENT_ERRORS,
    Bus,
    Delivery,
    reraise_if_cancelled,
    retry_transient,
    stop_tasks,
    until_stopped_or_dead,
)
from shared.keys import WORKER_GROUP
from shared.protocol import (
    Cancel,
    Dispatch,
    ErrorInfo,
    Finished,
    GenerateRequest,
    InstanceInfo,
    Message,
    OutputBatch,
    Reserve,
    ReserveReply,
    TokenEvent,
    encode,
)

logger = logging.getLogger(__name__)

Role = Literal["mixed", "prefill", "decode"]
Outcome = Literal["done", "handed_off", "failed", "cancelled", "returned"]
HEARTBEATS_PER_TTL = 3


@dataclass
class WorkerOptions:
    instance_id: str
    role: Role
    model_name: str
    ttl_s: float
    kv_transport: str = "tcp"
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    kv_advertise_host: str | None = None
    kv_secret: bytes | None = None
    """The mesh's shared KV secret: both ends of every KV connection prove it (None: no check)."""
    kv_tls: TlsFiles | None = None
    drain_timeout_s: float = 60.0


@dataclass
class Running:
    """A request placed here, and the epoch of that placement (its rows are published under it)."""

    request: GenerateRequest
    epoch: int
    cancelled: bool = False
    """Told to stop (its client left, or it was placed elsewhere): being fenced is no surprise."""
    fenced: bool = False
    """Cancelled, and its rows refused since (the scheduler ended it at once): none is sent any
    more, and its end row, which the abort brings, retires it as any."""
    record_renewed_at: float = float("-inf")
    """When (time.monotonic) a publish last renewed its delivered record's TTL."""


StreamItem = tuple[int, int, torch.Tensor, torch.Tensor] | KVExport | None
"""A streamed target layer's part (index, first block, key, value); the request's export, which ends
the transfer; or None: the request ended here before its hand-off."""


@dataclass
class KVStream:
    """Prefill role: a request's transfer, open while its prefill runs (`Worker._stream_kv`)."""

    epoch: int
    items: asyncio.Queue[StreamItem]
    exported: bool = False
    """Its export came: the request left the engine, handed off."""


class Worker:
    def __init__(self, core: EngineCoreClient, bus: Bus, options: WorkerOptions, metrics: WorkerMetrics):
        self.core = core
        self.bus = bus
        self.options = options
        self.metrics = metrics
        self.keys = bus.keys
        self.inbox = self.keys.inbox(options.instance_id)
        self.transport: KVTransport | None = None
        self.kv_address: str | None = None
        self.handoff_targets: dict[str, str] = {}
        """Prefill role: request id -> the decode instance's KV address."""
        self.bytes_to: set[str] = set()
        """Prefill role: decode instances shared KV could not go to (said once in the log)."""
        self.streams: dict[str, KVStream] = {}
        """Prefill role, KV streamed by the core: each request's transfer under way."""
        core.on_kv_stream = self._on_kv_stream
        self.received_kv: dict[str, list[tuple[str, int, torch.Tensor, torch.Tensor]]] = {}
        """Decode role: the layers of each transfer under way, handed to the core in one command at
        its end (one command per request, not per layer, between the core's steps)."""
        self.requests: dict[str, Running] = {}
        """Requests in the engine (or reserved there), until their last row is published."""
        self.draining = False
        self.pending: set[asyncio.Task[None]] = set()

    # ---- life cycle -------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> int:
        """Serves until `stop` (drains, returns 0) or until the engine core or one of the worker's loops
        dies (leaves the mesh, returns 1)."""
        if self.options.role in ("prefill", "decode"):
            options: dict[str, Any] = {"secret": self.options.kv_secret, "tls": self.options.kv_tls}
            if self.options.kv_transport == "ipc" and self.options.role == "decode":
                options["import_shared"] = self._import_shared
            self.transport = make_transport(self.options.kv_transport, **options)
            if self.options.role == "decode":
                self.kv_address = await self.transport.start(
                    self.options.kv_host, self.options.kv_port, advertise_host=self.options.kv_advertise_host
                )
        await self.bus.ensure_group(self.inbox, WORKER_GROUP)
        await self._heartbeat()
        tasks = [
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._receive_loop(stop), name="receive"),
            asyncio.create_task(self._emit_loop(), name="emit"),
        ]
        logger.info(
            "worker ready",
            extra={"instance": self.options.instance_id, "role": self.options.role, "kv": self.kv_address},
        )
        core_died = asyncio.create_task(self.core.died.wait(), name="engine core")
        dead = await until_stopped_or_dead(stop, [core_died, *tasks])
        await stop_tasks([core_died])
        if dead is not None and dead is not core_died:
            logger.error(
                "leaving the mesh without its %s loop; the scheduler re-dispatches this instance's "
                "%d request(s)",
                dead.get_name(),
                len(self.requests),
            )
        elif self.core.alive:
            await self._drain()
        else:
            logger.error(
                "the engine core died (exit code %s): leaving the mesh; the scheduler re-dispatches "
                "this instance's %d request(s)",
                self.core.exit_code,
                len(self.requests),
            )
        await stop_tasks(tasks)
        await self.close()
        return 0 if dead is None and self.core.exit_code in (None, 0) else 1

    async def _drain(self) -> None:
        """SIGTERM: take no more work, finish what is running (bounded), leave the registry."""
        self.draining = True
        await self._heartbeat()
        deadline = time.monotonic() + self.options.drain_timeout_s
        while (self.requests or not self.core.batches.empty()) and time.monotonic() < deadline:
            if not self.core.alive:
                break
            await asyncio.sleep(0.05)
        if self.pending:
            await asyncio.wait(self.pending, timeout=max(0.0, deadline - time.monotonic()))
        logger.info(
            "worker drained", extra={"instance": self.options.instance_id, "left": len(self.requests)}
        )

    async def close(self) -> None:
        await self.core.shutdown()
        if self.transport is not None:
            await self.transport.close()
        with contextlib.suppress(RedisError):
            await self.bus.client.delete(self.keys.heartbeat(self.options.instance_id))

    # ---- receive --------------------------------------------------------------------------------------------

    async def _receive_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                deliveries = await self.bus.read_group(
                    self.inbox, WORKER_GROUP, self.options.instance_id, block_ms=200
                )
                for delivery in deliveries:
                    await self._handle(delivery)
                await self.bus.ack(self.inbox, WORKER_GROUP, *(d.entry_id for d in deliveries))
            except RedisError as exc:
                reraise_if_cancelled(exc)
                logger.warning("bus read failed, retrying", extra={"error": str(exc)})
                self.bus.reread_pending(self.inbox, WORKER_GROUP, self.options.instance_id)
                await asyncio.sleep(0.5)

    async def _handle(self, delivery: Delivery) -> None:
        message = delivery.message
        try:
            if isinstance(message, Dispatch):
                await self._dispatch(message)
            elif isinstance(message, Reserve):
                await self._reserve(message)
            elif isinstance(message, Cancel):
                await self._cancel(message.request_id, message.epoch)
            else:
                await self.bus.dead_letter(
                    delivery.stream, delivery.entry_id, None, f"a worker does not handle {message.kind!r}"
                )
        except RedisError:
            raise
        except Exception as exc:  # one bad message never stops the worker
            logger.exception("handling %s failed", message.kind)
            await self.bus.dead_letter(delivery.stream, delivery.entry_id, None, f"{message.kind}: {exc}")

    async def _dispatch(self, message: Dispatch) -> None:
        request, epoch = message.request, message.epoch
        trace.hop("worker.read", request.request_id)
        if not await self._make_room(request.request_id, epoch):
            return  # a redelivery, or a placement older than the one running here
        if self.draining:
            await self._refuse(request, epoch, 503, "instance is draining")
            return
        if message.role == "prefill":
            if not message.decode_kv_address:
                await self._refuse(request, epoch, 500, "prefill dispatch without a decode KV address")
                return
            self.handoff_targets[request.request_id] = message.decode_kv_address
        self.requests[request.request_id] = Running(request, epoch)
        await self.core.add_request(request, epoch, handoff=message.role == "prefill")
        trace.hop("worker.to_core", request.request_id)
        self.metrics.requests_received.inc()

    async def _make_room(self, request_id: str, epoch: int) -> bool:
        """Whether the placement of `epoch` may start here: not if it (a redelivery) or a later one
        runs here already. An earlier one here is stopped silently first: the request was placed
        again while this instance was taken for dead, and its rows are fenced off anyway."""
        running = self.requests.get(request_id)
        if running is None:
            return True
        if running.epoch >= epoch:
            return False
        logger.warning(
            "placed here again: the earlier placement stops",
            extra={"request_id": request_id, "epoch": epoch, "earlier": running.epoch},
        )
        await self._drop([request_id])
        return True

    async def _reserve(self, message: Reserve) -> None:
        """Sends the reservation to the core now (in order with later commands for the request);
        its answer goes back to the scheduler from a task, so this loop never waits for a step."""
        request, epoch = message.request, message.epoch
        reply = ReserveReply(request_id=request.request_id, instance_id=self.options.instance_id, ok=False)
        running = self.requests.get(request.request_id)
        if running is not None and running.epoch == epoch:
            reply.ok, reply.kv_address = True, self.kv_address
        elif running is not None and running.epoch > epoch:
            reply.error, reply.code = "a later placement of the request runs here", 503
        elif self.draining or self.transport is None:
            reply.error = "instance is draining" if self.draining else "this instance does not decode"
            reply.code = 503
        else:
            await self._make_room(request.request_id, epoch)
            self.requests[request.request_id] = Running(request, epoch)
            answer = await self.core.reserve(request, epoch)
            self._spawn(self._answer_reserve(message, answer, reply))
            return
        await self.bus.publish(message.reply_to, reply, maxlen=10_000)

    async def _answer_reserve(
        self, message: Reserve, answer: asyncio.Future[Reply], reply: ReserveReply
    ) -> None:
        request_id, epoch = message.request.request_id, message.epoch
        result = await answer
        if result.error is not None:
            if self._is_current(request_id, epoch):
                self.requests.pop(request_id)
            reply.error, reply.code = result.error.message, result.error.code
        else:
            assert self.transport is not None
            self.transport.expect(
                request_id,
                on_layer=self._on_kv_layer,
                on_done=self._on_kv_done,
                on_error=lambda error: self._on_kv_error(request_id, epoch, error),
                timeout_s=message.timeout_s,
                expectation=KVExpectation(extras={"epoch": epoch}),
            )
            reply.ok, reply.kv_address = True, self.kv_address
        await self.bus.publish(message.reply_to, reply, maxlen=10_000)

    def _on_kv_layer(self, layer: ReceivedLayer) -> None:
        received = self.received_kv.setdefault(layer.request_id, [])
        received.append((layer.cache, layer.index, layer.key, layer.value))

    async def _import_shared(self, request_id: str, shared: SharedKV) -> dict[str, torch.Tensor]:
        """Decode role, ipc transport: the core copies the KV from the prefill instance's buffer."""
        reply = await (await self.core.import_shared(request_id, shared))
        if reply.error is not None:
            raise KVSharedUnusable(reply.error.message, request_id)
        return reply.tensors

    async def _on_kv_done(self, transfer: ReceivedTransfer) -> None:
        request_id = transfer.header.request_id
        layers = self.received_kv.pop(request_id, [])
        if layers:  # none when they came by handle: the core has them already
            await self.core.import_kv(request_id, layers)
        await self.core.activate(request_id, int(transfer.extras["first_token_id"]))
        self.metrics.kv_received_bytes.inc(transfer.header.num_bytes)

    async def _on_kv_error(self, request_id: str, epoch: int, error: KVTransferError) -> None:
        """The request goes back to the scheduler, to be placed again (nothing reaches its client)."""
        if not self._is_current(request_id, epoch):
            return  # stopped here meanwhile
        self.received_kv.pop(request_id, None)
        logger.warning("KV transfer failed", extra={"request_id": request_id, "error": str(error)})
        await self.core.abort(request_id, emit=False)
        self.requests.pop(request_id, None)
        await self._report(request_id, epoch, "failed", f"KV transfer failed: {error}")

    async def _cancel(self, request_id: str, epoch: int | None) -> None:
        """Aborts the request (its blocks are freed at once); its final row follows its earlier ones.
        A cancel of an earlier placement than the one running here is ignored."""
        running = self.requests.get(request_id)
        if running is None or (epoch is not None and running.epoch > epoch):
            return
        running.cancelled = True
        self._stop_receiving(request_id)
        await self.core.abort(request_id)

    def _stop_receiving(self, request_id: str) -> None:
        """Forget a transfer of the request's KV under way (its sender is told)."""
        if self.transport is not None:
            self.transport.cancel(request_id)
        self.received_kv.pop(request_id, None)

    def _is_current(self, request_id: str, epoch: int) -> bool:
        running = self.requests.get(request_id)
        return running is not None and running.epoch == epoch

    # ---- emit ------------------------------------------------------------------------------------------------

    async def _emit_loop(self) -> None:
        """Publishes the core's step batches in order. A publish that fails for a transient Redis
        error is retried (with backoff) together with the batches that queued behind it, so they
        go out in one script call, in order; nothing is dropped. If Redis stays unreachable past
        the heartbeat TTL, the scheduler takes this instance for dead, so it acts dead: it stops
        its requests and gives them back for re-dispatch (`_abandon`)."""
        while True:
            backlog = await self.core.next_batches()
            try:
                publish = functools.partial(self._publish_backlog, backlog)
                batch = await retry_transient(publish, "publishing step outputs", self.options.ttl_s)
            except TRANSIENT_ERRORS as exc:
                reraise_if_cancelled(exc)
                self._observe(backlog)
                await self._abandon(f"the bus was unreachable for {self.options.ttl_s:g} s ({exc})")
                continue
            except Exception as exc:  # a bug in one batch must not stop every later one
                reraise_if_cancelled(exc)
                logger.exception("publishing step outputs failed")
                batch = concat(backlog)
            self._observe(backlog)  # after the publish: the rows wait for no metrics
            self._retire(batch)

    async def _publish_backlog(self, backlog: list[StepBatch]) -> StepBatch:
        """Publishes `backlog` and the batches queued since (added to `backlog`), as one; returns
        what went out."""
        backlog.extend(self.core.queued_batches())
        batch = concat(backlog)
        await self._publish(batch)
        return batch

    def _observe(self, batches: list[StepBatch]) -> None:
        for batch in batches:
            self.metrics.observe_step(batch.step_s, batch.load)

    async def _abandon(self, reason: str) -> None:
        """Stops every request here without a word to its client (its unpublished rows are dropped,
        its delivered record is where a re-dispatch resumes) and reports it `returned` once the
        bus answers again. The scheduler may already have re-dispatched it for a missed heartbeat:
        then the report's epoch is stale and it is ignored; either way it resumes once, from its
        delivered record."""
        running = dict(self.requests)
        logger.error("giving back %d request(s): %s", len(running), reason)
        await self._drop(list(running))
        reports: list[tuple[str, Message]] = [
            (self.keys.scheduler_replies, self._finished(request_id, r.epoch, "returned", reason=reason))
            for request_id, r in running.items()
        ]
        self._spawn(self._send_reports(reports, "returning requests"))

    async def _send_reports(self, reports: list[tuple[str, Message]], what: str) -> None:
        """Sends `reports` in one command, however long the bus is down."""
        await retry_transient(lambda: self.bus.publish_step([], [], reports), what, None)

    async def _drop(self, request_ids: list[str]) -> None:
        """Stops requests here without a word to anyone."""
        for request_id in request_ids:  # first, so rows already stepped for them are not published
            self.requests.pop(request_id, None)
            self.handoff_targets.pop(request_id, None)
            self._end_stream(request_id)
            self._stop_receiving(request_id)
        for request_id in request_ids:
            await self.core.abort(request_id, emit=False)

    async def _fence(self, request_ids: list[str]) -> None:
        """The bus refused these requests' rows: each was placed again since (or ended: a client
        that left, a placement the scheduler gave up). They stop here, silently."""
        dropped = []
        for request_id in request_ids:
            running = self.requests.get(request_id)
            if running is not None and running.cancelled:
                running.fenced = True
                continue
            if running is not None:
                self.metrics.requests_fenced.inc()
                logger.warning(
                    "fenced off: the request was placed again since; stopping it here",
                    extra={"request_id": request_id, "epoch": running.epoch},
                )
            dropped.append(request_id)
        await self._drop(dropped)

    async def _publish(self, batch: StepBatch) -> None:
        """One OutputBatch per gateway, the rows' tokens appended to their requests' delivered
        records, and a Finished report per ended request: one command (safe to repeat). Rows of
        requests no longer here (given back), or of an earlier placement than the one here, are
        left out; requests the bus fences off are dropped, and the rest published again."""
        while fenced := await self._publish_current(batch):
            await self._fence(fenced)
        if trace.ENABLED:
            for request_id, num_output_tokens in zip(batch.request_ids, batch.num_output_tokens.tolist()):
                trace.hop("worker.published", request_id, num_output_tokens)

    async def _publish_current(self, batch: StepBatch) -> list[str]:
        """Publishes the rows of the current placements here; returns the requests fenced off
        (then nothing was published)."""
        now = time.monotonic()
        rows_of: dict[str, list[int]] = {}
        renew_ttl = np.zeros(batch.num_rows, bool)  # [num_rows]
        renewing: list[Running] = []
        for row, request_id in enumerate(batch.request_ids):
            running = self._current_row(batch, row)
            if running is None or running.fenced:
                continue
            if running.request.gateway_id is None:
                logger.error("a row of %s, which has no gateway: dropped", request_id)
                continue
            rows_of.setdefault(running.request.gateway_id, []).append(row)
            if now >= running.record_renewed_at + RECORD_TTL_RENEW_S:
                renew_ttl[row] = True
                renewing.append(running)
        kept = np.asarray(sorted(row for rows in rows_of.values() for row in rows), np.int64)
        whole = len(kept) == batch.num_rows
        outputs = [
            (gateway, encode(batch.output_batch(None if whole and len(rows_of) == 1 else np.asarray(rows))))
            for gateway, rows in rows_of.items()
        ]
        records = batch.delivered_records(None if whole else kept, renew_ttl)
        kept_rows = set(kept.tolist())
        reports: list[tuple[str, Message]] = [
            (
                self.keys.scheduler_replies,
                self._finished(batch.request_ids[end.row], batch.epochs[end.row], end.outcome, end.error),
            )
            for end in batch.ends
            if not end.handoff and end.row in kept_rows
        ]
        fenced = await self.bus.publish_step(outputs, records, reports)
        if not fenced:
            for running in renewing:
                running.record_renewed_at = now
        return fenced

    def _current_row(self, batch: StepBatch, row: int) -> Running | None:
        """The request of `row`, if the row belongs to its placement here."""
        running = self.requests.get(batch.request_ids[row])
        return running if running is not None and running.epoch == batch.epochs[row] else None

    def _retire(self, batch: StepBatch) -> None:
        """After publishing: requests that ended leave, prefilled ones are handed off."""
        handing_off = {}
        for end in batch.ends:
            running = self._current_row(batch, end.row)
            if running is None:
                continue  # dropped here: given back, or fenced off
            if end.handoff:
                handing_off[batch.request_ids[end.row]] = running
                continue
            self.requests.pop(batch.request_ids[end.row])
            self._end_stream(batch.request_ids[end.row])
            if end.error is None:
                self.metrics.observe_finished(end, int(batch.num_output_tokens[end.row]))
        for handoff in batch.handoffs:  # the first token is out: the decode instance may continue now
            if handoff.request_id in handing_off and handoff.streamed:
                self._end_stream(handoff.request_id, handoff, handing_off[handoff.request_id].epoch)
            elif handoff.request_id in handing_off:
                self._spawn(self._hand_off(handoff, handing_off[handoff.request_id].epoch))
            elif handoff.shared is not None:  # dropped here meanwhile: its buffer goes now
                self._spawn(self._release_shared(handoff))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _hand_off(self, handoff: KVExport, epoch: int) -> None:
        """Prefill role: send the KV layer by layer to the decode instance, then step aside."""
        address = self.handoff_targets.pop(handoff.request_id, None)
        self.requests.pop(handoff.request_id, None)
        if address is None or self.transport is None:
            await self._release_shared(handoff)
            await self._report(handoff.request_id, epoch, "failed", "no decode instance to hand the KV to")
            return
        started = time.perf_counter()
        header = kv_header(handoff, epoch)
        session: KVSendSession | None = None
        try:
            session = await self.transport.open(address, header)
            async with session:
                path = await self._send_kv(session, handoff, address)
                await session.close(extras={"first_token_id": handoff.first_token_id})
        except KVTransferError as exc:
            await self._report(handoff.request_id, epoch, "failed", f"KV handoff failed: {exc}")
            return
        finally:  # acknowledged, failed, cancelled or timed out
            if session is not None and session.shared_unanswered:  # the decode side may still read it
                logger.warning("shared KV of %s unanswered: held until its deadline", handoff.request_id)
            else:
                await self._release_shared(handoff)
        self.metrics.kv_sent_bytes.inc(header.num_bytes)
        self.metrics.kv_handoffs.labels(**self.metrics.labels, path=path).inc()
        self.metrics.kv_transfer_seconds.observe(time.perf_counter() - started)
        await self._report(handoff.request_id, epoch, "handed_off")

    async def _send_kv(
        self, session: KVSendSession, handoff: KVExport, address: str
    ) -> Literal["shared", "bytes"]:
        """By handle where the KV is shared and the receiver (at `address`) takes it; else the bytes,
        layer by layer. Returns which."""
        if handoff.shared is not None:
            refusal = await session.send_shared(handoff.shared)
            if refusal is None:
                return "shared"
            if address not in self.bytes_to:
                self.bytes_to.add(address)
                logger.warning("KV to %s goes over TCP, not shared memory: %s", address, refusal)
            reply = await (await self.core.fetch_kv(handoff.request_id))
            if reply.export is None:
                message = reply.error.message if reply.error else "no export"
                raise KVTransferCancelled(message, handoff.request_id)
            handoff = reply.export
        for cache, index, key, value in handoff.layers:
            await session.send_layer(cache, index, key, value)
        for name, tensor in handoff.tensors.items():
            await session.send_tensor(name, tensor)
        return "bytes"

    # ---- streamed KV (prefill role) ----------------------------------------------------------------------

    def _on_kv_stream(self, message: KVStreamMessage) -> None:
        """A request's transfer opens as its prefill starts; each target layer goes as it comes."""
        if isinstance(message, KVStreamStart):
            self._open_stream(message)
            return
        parts = zip(message.request_ids, message.first_blocks, message.keys, message.values)
        for request_id, first_block, key, value in parts:
            if (stream := self.streams.get(request_id)) is not None:
                stream.items.put_nowait((message.index, first_block, key, value))

    def _open_stream(self, start: KVStreamStart) -> None:
        running = self.requests.get(start.request_id)
        address = self.handoff_targets.get(start.request_id)
        if running is None or address is None or self.transport is None:
            return  # dropped meanwhile (or no decode instance: its hand-off fails)
        self._end_stream(start.request_id)  # an earlier placement's, if one is left
        stream = KVStream(running.epoch, asyncio.Queue())
        self.streams[start.request_id] = stream
        self._spawn(self._stream_kv(start, stream, address))

    def _end_stream(self, request_id: str, export: KVExport | None = None, epoch: int = 0) -> None:
        """Ends the request's transfer: with its export (handed off under placement `epoch`: the
        request leaves this worker), or silently (None: it ended here)."""
        stream = self.streams.pop(request_id, None)
        if export is None:
            if stream is not None:
                stream.items.put_nowait(None)
            return
        self.requests.pop(request_id, None)
        self.handoff_targets.pop(request_id, None)
        if stream is None or stream.epoch != epoch:  # its transfer failed already, or never opened
            if stream is not None:
                stream.items.put_nowait(None)
            self._spawn(self._report(request_id, epoch, "failed", "no KV transfer open for the request"))
            return
        stream.exported = True
        stream.items.put_nowait(export)

    async def _stream_kv(self, start: KVStreamStart, stream: KVStream, address: str) -> None:
        """Opens the request's transfer at once and sends each layer as it comes, then what its
        export adds (the drafting model's layers) and the first token at close. A transfer that
        fails fails the request: stopped in the core if its prefill still runs."""
        assert self.transport is not None
        request_id, started = start.request_id, time.perf_counter()
        header = stream_header(start, stream.epoch)
        try:
            session = await self.transport.open(address, header)
            async with session:
                while not isinstance(item := await stream.items.get(), KVExport):
                    if item is None:
                        raise KVTransferCancelled("the request ended before its hand-off", request_id)
                    await send_target_part(session, *item)
                for cache, index, key, value in item.layers:
                    await session.send_layer(cache, index, key, value)
                for name, tensor in item.tensors.items():
                    await session.send_tensor(name, tensor)
                await session.close(extras={"first_token_id": item.first_token_id})
        except KVTransferError as exc:
            await self._fail_stream(request_id, stream, exc)
            return
        self.metrics.kv_sent_bytes.inc(header.num_bytes)
        self.metrics.kv_handoffs.labels(**self.metrics.labels, path="streamed").inc()
        self.metrics.kv_transfer_seconds.observe(time.perf_counter() - started)
        await self._report(request_id, stream.epoch, "handed_off")

    async def _fail_stream(self, request_id: str, stream: KVStream, error: KVTransferError) -> None:
        """A failed transfer: nothing to say where the request ended here; else it fails, stopped
        in the core first where its prefill still runs (its rows are no longer published)."""
        if not stream.exported and self.streams.get(request_id) is not stream:
            return  # it ended here (its end row went out), or was dropped
        if not stream.exported:
            del self.streams[request_id]
            self.requests.pop(request_id, None)
            self.handoff_targets.pop(request_id, None)
            with contextlib.suppress(EngineCoreDied):
                await self.core.abort(request_id, emit=False)
        await self._report(request_id, stream.epoch, "failed", f"KV handoff failed: {error}")

    async def _release_shared(self, handoff: KVExport) -> None:
        """Frees the engine core's buffer of a shared export (its deadline frees it if this cannot)."""
        if handoff.shared is not None:
            with contextlib.suppress(EngineCoreDied):
                await self.core.release_kv(handoff.request_id)

    def _finished(
        self,
        request_id: str,
        epoch: int,
        outcome: str,
        error: ErrorInfo | None = None,
        reason: str | None = None,
    ) -> Finished:
        return Finished(
            request_id=request_id,
            instance_id=self.options.instance_id,
            outcome=outcome,  # type: ignore[arg-type]
            epoch=epoch,
            error=error.message if error else reason,
        )

    async def _report(self, request_id: str, epoch: int, outcome: Outcome, error: str | None = None) -> None:
        """Tells the scheduler, however long the bus is down: a lost `failed` would leave the
        request's client waiting for ever."""
        message = Finished(
            request_id=request_id,
            instance_id=self.options.instance_id,
            outcome=outcome,
            epoch=epoch,
            error=error,
        )
        await retry_transient(
            lambda: self.bus.publish(self.keys.scheduler_replies, message), f"reporting {outcome}", None
        )

    async def _refuse(self, request: GenerateRequest, epoch: int, code: int, message: str) -> None:
        """Ends a request this worker will not run: an error to its client, `failed` to the
        scheduler (unless the placement is no longer current: then nothing)."""
        error = ErrorInfo(
            code=code, type="invalid_request_error" if code == 400 else "server_error", message=message
        )
        event = TokenEvent(request_id=request.request_id, finished=True, finish_reason="error", error=error)
        outputs = [(request.gateway_id, encode(OutputBatch.of([event])))] if request.gateway_id else []
        report = (self.keys.scheduler_replies, self._finished(request.request_id, epoch, "failed", error))
        record = (request.request_id, epoch, APPEND_AT_END, END_BYTES)
        if await self.bus.publish_step(outputs, [record], [report]):
            logger.info("refused a placement no longer current", extra={"request_id": request.request_id})

    # ---- heartbeat --------------------------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.options.ttl_s / HEARTBEATS_PER_TTL)
            try:
                await self._heartbeat()
            except RedisError as exc:
                reraise_if_cancelled(exc)
                logger.warning("heartbeat failed", extra={"error": str(exc)})

    async def _heartbeat(self) -> None:
        load, info = self.core.load, self.core.info
        if load.suffix_cache:
            self.metrics.observe_suffix_cache(load.suffix_cache)
        heartbeat = InstanceInfo(
            instance_id=self.options.instance_id,
            role=self.options.role,
            model=self.options.model_name,
            max_model_len=info.max_model_len,
            kv_address=self.kv_address,
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            queued_tokens=load.queued_tokens,
            free_kv_blocks=load.free_kv_blocks,
            total_kv_blocks=info.total_kv_blocks,
            block_size=info.block_size,
            speculative_method=info.speculative_method,
            draining=self.draining,
        )
        async with self.bus.client.pipeline(transaction=False) as pipe:
            pipe.set(
                self.keys.heartbeat(self.options.instance_id),
                encode(heartbeat),
                px=int(self.options.ttl_s * 1000),
            )
            pipe.sadd(self.keys.instances, self.options.instance_id)
            await pipe.execute()

    async def health(self) -> tuple[bool, str]:
        if not self.core.alive:
            return False, f"the engine core exited with code {self.core.exit_code}"
        try:
            await self.bus.client.ping()
        except RedisError as exc:
            return False, f"redis: {exc}"
        return (not self.draining), "draining" if self.draining else "ok"


async def send_target_part(
    session: KVSendSession, index: int, first_block: int, key: torch.Tensor, value: torch.Tensor
) -> None:
    """A streamed part of target layer `index`: whole (one LAYER frame) where it is all the layer."""
    spec = session.header.layer_shapes[session.header.layer_position("target", index)]
    if first_block == 0 and key.shape[0] == spec.num_blocks:
        await session.send_layer("target", index, key, value)
    else:
        await session.send_layer_part("target", index, first_block, key, value)


def stream_header(start: KVStreamStart, epoch: int) -> KVHeader:
    """The header of a transfer the core streams: every layer it will carry, known as prefill starts."""
    return KVHeader(
        request_id=start.request_id,
        extras={"epoch": epoch},
        num_tokens=start.num_tokens,
        block_size=start.layer_shapes[0][2][1],
        dtype=dtype_name(start.dtype),
        layer_shapes=[LayerShape(cache=c, index=i, shape=shape) for c, i, shape in start.layer_shapes],
    )


def kv_header(handoff: KVExport, epoch: int) -> KVHeader:
    if handoff.shared is not None:
        shared = handoff.shared
        return KVHeader(
            request_id=handoff.request_id,
            extras={"epoch": epoch},
            num_tokens=handoff.num_tokens,
            block_size=shared.caches[0].shape[3],
            dtype=shared.dtype,
            layer_shapes=shared.layer_shapes(),
            tensors=shared.tensor_specs(),
        )
    first_key = handoff.layers[0][2]
    return KVHeader(
        request_id=handoff.request_id,
        extras={"epoch": epoch},
        num_tokens=handoff.num_tokens,
        block_size=int(first_key.shape[1]),
        dtype=dtype_name(first_key.dtype),
        layer_shapes=[LayerShape(cache=c, index=i, shape=tuple(k.shape)) for c, i, k, _ in handoff.layers],  # type: ignore[arg-type]
        tensors=[
            TensorSpec(name=n, shape=tuple(t.shape), dtype=dtype_name(t.dtype))
            for n, t in handoff.tensors.items()
        ],
    )
