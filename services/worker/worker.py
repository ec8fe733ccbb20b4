"""A worker process: an engine (mixed, prefill or decode role) on the bus.

receive  (inbox: Dispatch / Reserve / Cancel)  -> engine thread
step     (engine thread, continuously)
emit     (TokenEvents to out:{id}, Finished to the scheduler, KV to decode instances)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Literal

from redis.exceptions import RedisError

from services.engine.engine import CapacityError, KVExport, LLMEngine, RequestError, RequestOutput
from services.kv_transport import (
    KVHeader,
    KVTransferError,
    KVTransport,
    LayerShape,
    ReceivedLayer,
    ReceivedTransfer,
    TensorSpec,
    make_transport,
)
from services.kv_transport.base import dtype_name
from services.worker.engine_thread import EngineThread, StepResult
from services.worker.metrics import WorkerMetrics
from shared.bus import OUTPUT_TTL_S, Bus, Delivery, reraise_if_cancelled, stop_tasks
from shared.keys import WORKER_GROUP
from shared.protocol import (
    Cancel,
    Dispatch,
    ErrorInfo,
    Finished,
    GenerateRequest,
    InstanceInfo,
    Reserve,
    ReserveReply,
    TokenEvent,
    TokenLogprob,
    encode,
)

logger = logging.getLogger(__name__)

Role = Literal["mixed", "prefill", "decode"]
Outcome = Literal["done", "handed_off", "failed", "cancelled"]
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
    drain_timeout_s: float = 60.0


class Worker:
    def __init__(self, engine: LLMEngine, bus: Bus, options: WorkerOptions, metrics: WorkerMetrics):
        self.engine = engine
        self.bus = bus
        self.options = options
        self.metrics = metrics
        self.keys = bus.keys
        self.inbox = self.keys.inbox(options.instance_id)
        self.thread: EngineThread | None = None
        self.transport: KVTransport | None = None
        self.kv_address: str | None = None
        self.handoff_targets: dict[str, str] = {}
        """Prefill role: request id -> the decode instance's KV address."""
        self.requests: dict[str, GenerateRequest] = {}
        self.draining = False
        self.steps: asyncio.Queue[StepResult] = asyncio.Queue()
        """Step results in order; one emitter publishes them, so a request's events never reorder."""
        self.pending: set[asyncio.Task[None]] = set()

    # ---- life cycle -------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        self.thread = EngineThread(self.engine, loop, self._on_step)
        self.thread.start()
        if self.options.role in ("prefill", "decode"):
            self.transport = make_transport(self.options.kv_transport)
            if self.options.role == "decode":
                self.kv_address = await self.transport.start(
                    self.options.kv_host, self.options.kv_port, advertise_host=self.options.kv_advertise_host
                )
        await self.bus.ensure_group(self.inbox, WORKER_GROUP)
        await self._heartbeat()
        tasks = [
            asyncio.create_task(self._heartbeat_loop()),
            asyncio.create_task(self._receive_loop(stop)),
            asyncio.create_task(self._emit_loop()),
        ]
        logger.info(
            "worker ready",
            extra={"instance": self.options.instance_id, "role": self.options.role, "kv": self.kv_address},
        )
        await stop.wait()
        await self._drain()
        await stop_tasks(tasks)
        await self.close()

    async def _drain(self) -> None:
        """SIGTERM: take no more work, finish what is running (bounded), leave the registry."""
        self.draining = True
        await self._heartbeat()
        deadline = time.monotonic() + self.options.drain_timeout_s
        while (
            self.thread is not None and self.thread.busy or not self.steps.empty()
        ) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.pending:
            await asyncio.wait(self.pending, timeout=max(0.0, deadline - time.monotonic()))
        logger.info(
            "worker drained", extra={"instance": self.options.instance_id, "left": len(self.engine.sequences)}
        )

    async def close(self) -> None:
        if self.thread is not None:
            await asyncio.to_thread(self.thread.stop)
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
            except RedisError as exc:
                reraise_if_cancelled(exc)
                logger.warning("bus read failed, retrying", extra={"error": str(exc)})
                await asyncio.sleep(0.5)
                continue
            for delivery in deliveries:
                await self._handle(delivery)
                await self.bus.ack(self.inbox, WORKER_GROUP, delivery.entry_id)

    async def _handle(self, delivery: Delivery) -> None:
        message = delivery.message
        try:
            if isinstance(message, Dispatch):
                await self._dispatch(message)
            elif isinstance(message, Reserve):
                await self._reserve(message)
            elif isinstance(message, Cancel):
                await self._cancel(message.request_id)
            else:
                await self.bus.dead_letter(
                    delivery.stream, delivery.entry_id, None, f"a worker does not handle {message.kind!r}"
                )
        except Exception as exc:  # one bad message never stops the worker
            logger.exception("handling %s failed", message.kind)
            await self.bus.dead_letter(delivery.stream, delivery.entry_id, None, f"{message.kind}: {exc}")

    async def _dispatch(self, message: Dispatch) -> None:
        request = message.request
        if request.request_id in self.requests:
            return  # a redelivery: already running here
        if self.draining:
            await self._fail(request, 503, "instance is draining")
            return
        if message.role == "prefill":
            if not message.decode_kv_address:
                await self._fail(request, 500, "prefill dispatch without a decode KV address")
                return
            self.handoff_targets[request.request_id] = message.decode_kv_address
        self.requests[request.request_id] = request
        assert self.thread is not None
        try:
            await self.thread.call(
                lambda e: e.add_request(
                    request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    params=request.params,
                    resumed_token_ids=request.resumed_token_ids,
                    handoff=message.role == "prefill",
                )
            )
            self.metrics.requests_received.inc()
        except RequestError as exc:
            await self._fail(request, 400, str(exc))

    async def _reserve(self, message: Reserve) -> None:
        request = message.request
        reply = ReserveReply(request_id=request.request_id, instance_id=self.options.instance_id, ok=False)
        if request.request_id in self.requests:
            reply.ok, reply.kv_address = True, self.kv_address
        elif self.draining or self.transport is None:
            reply.error = "instance is draining" if self.draining else "this instance does not decode"
            reply.code = 503
        else:
            reply = await self._reserve_blocks(request, message.timeout_s, reply)
        await self.bus.publish(message.reply_to, reply, maxlen=10_000)

    async def _reserve_blocks(
        self, request: GenerateRequest, timeout_s: float, reply: ReserveReply
    ) -> ReserveReply:
        assert self.thread is not None and self.transport is not None
        try:
            await self.thread.call(
                lambda e: e.reserve(
                    request.request_id, request.prompt_token_ids, request.params, request.resumed_token_ids
                )
            )
        except RequestError as exc:
            reply.error = str(exc)
            reply.code = 503 if isinstance(exc, CapacityError) else 400
            return reply
        self.requests[request.request_id] = request
        request_id = request.request_id
        self.transport.expect(
            request_id,
            on_layer=self._on_kv_layer,
            on_done=self._on_kv_done,
            on_error=lambda error: self._on_kv_error(request_id, error),
            timeout_s=timeout_s,
        )
        reply.ok, reply.kv_address = True, self.kv_address
        return reply

    async def _on_kv_layer(self, layer: ReceivedLayer) -> None:
        assert self.thread is not None
        await self.thread.call(
            lambda e: e.import_kv(layer.request_id, layer.cache, layer.index, layer.key, layer.value)
        )

    async def _on_kv_done(self, transfer: ReceivedTransfer) -> None:
        assert self.thread is not None
        request_id = transfer.header.request_id
        first_token = int(transfer.extras["first_token_id"])
        await self.thread.call(lambda e: e.activate(request_id, first_token))
        self.metrics.kv_received_bytes.inc(transfer.header.num_bytes)

    async def _on_kv_error(self, request_id: str, error: KVTransferError) -> None:
        logger.warning("KV transfer failed", extra={"request_id": request_id, "error": str(error)})
        await self._abort(request_id)
        await self._report(request_id, "failed", f"KV transfer failed: {error}")

    async def _cancel(self, request_id: str) -> None:
        """Aborts the request (its blocks are freed at once); its final event follows its earlier ones."""
        if self.transport is not None:
            self.transport.cancel(request_id)
        output = await self._abort(request_id)
        if output is not None:
            self._on_step(StepResult([output], [], 0.0))

    async def _abort(self, request_id: str) -> RequestOutput | None:
        assert self.thread is not None
        output = await self.thread.call(lambda e: e.abort_request(request_id))
        self.requests.pop(request_id, None)
        self.handoff_targets.pop(request_id, None)
        return output

    # ---- emit ------------------------------------------------------------------------------------------------

    def _on_step(self, result: StepResult) -> None:
        """Called on the loop after each step: queue it for the emitter, never blocking the engine."""
        self.metrics.observe_step(result, self.thread.load if self.thread else None)
        self.steps.put_nowait(result)

    async def _emit_loop(self) -> None:
        while True:
            result = await self.steps.get()
            try:
                await self._emit(result)
            except RedisError as exc:
                reraise_if_cancelled(exc)
                logger.error("publishing step outputs failed", extra={"error": str(exc)})

    async def _emit(self, result: StepResult) -> None:
        events = [(self.keys.output(o.request_id), self._event(o)) for o in result.outputs]
        await self.bus.publish_many(events)
        for request_id, error in result.failed:
            await self._fail_by_id(request_id, 500, error)
        for output in result.outputs:
            if output.finished and output.finish_reason != "handoff":
                await self._finished(output)
        for export in result.handoffs:  # the first token is out: the decode instance may continue now
            task = asyncio.create_task(self._hand_off(export))
            self.pending.add(task)
            task.add_done_callback(self.pending.discard)

    def _event(self, output: RequestOutput) -> TokenEvent:
        request = self.requests.get(output.request_id)
        num_new = len(output.new_token_ids)
        logprobs = [
            TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=list(lp.top.items()))
            for lp in (output.logprobs or [])[-num_new:]
            if num_new
        ]
        handoff = output.finish_reason == "handoff"
        return TokenEvent(
            request_id=output.request_id,
            token_ids=output.new_token_ids,
            text=output.new_text,
            logprobs=logprobs,
            finished=output.finished and not handoff,
            finish_reason=None if handoff else output.finish_reason,
            stop_reason=output.stop_reason,
            num_prompt_tokens=len(request.prompt_token_ids) if request else len(output.prompt_token_ids),
            num_output_tokens=len(output.token_ids),
            # cumulative: the last event's are the request's (a stream of 64 requests sends a
            # thousand events a second; the stats would be most of their bytes)
            spec_stats=output.spec_stats if output.finished else {},
        )

    async def _finished(self, output: RequestOutput) -> None:
        self.metrics.observe_finished(output)
        await self.bus.client.expire(self.keys.output(output.request_id), OUTPUT_TTL_S)
        self.requests.pop(output.request_id, None)
        outcome: Outcome = "cancelled" if output.finish_reason == "abort" else "done"
        await self._report(output.request_id, outcome)

    async def _hand_off(self, export: KVExport) -> None:
        """Prefill role: send the KV layer by layer to the decode instance, then step aside."""
        address = self.handoff_targets.pop(export.request_id, None)
        self.requests.pop(export.request_id, None)
        if address is None or self.transport is None:
            await self._report(export.request_id, "failed", "no decode instance to hand the KV to")
            return
        started = time.perf_counter()
        try:
            session = await self.transport.open(address, kv_header(export))
            async with session:
                for cache, index, key, value in export.layers:
                    await session.send_layer(cache, index, key, value)
                for name, tensor in export.tensors.items():
                    await session.send_tensor(name, tensor)
                await session.close(extras={"first_token_id": export.first_token_id})
        except KVTransferError as exc:
            await self._report(export.request_id, "failed", f"KV handoff failed: {exc}")
            return
        self.metrics.kv_sent_bytes.inc(sum(2 * k.numel() * k.element_size() for _, _, k, _ in export.layers))
        self.metrics.kv_transfer_seconds.observe(time.perf_counter() - started)
        await self._report(export.request_id, "handed_off")

    async def _report(self, request_id: str, outcome: Outcome, error: str | None = None) -> None:
        message = Finished(
            request_id=request_id, instance_id=self.options.instance_id, outcome=outcome, error=error
        )
        await self.bus.publish(self.keys.scheduler_replies, message)

    async def _fail(self, request: GenerateRequest, code: int, message: str) -> None:
        await self._fail_by_id(request.request_id, code, message)

    async def _fail_by_id(self, request_id: str, code: int, message: str) -> None:
        error = ErrorInfo(
            code=code, type="invalid_request_error" if code == 400 else "server_error", message=message
        )
        event = TokenEvent(request_id=request_id, finished=True, finish_reason="error", error=error)
        await self.bus.publish(self.keys.output(request_id), event)
        await self.bus.client.expire(self.keys.output(request_id), OUTPUT_TTL_S)
        self.requests.pop(request_id, None)
        await self._report(request_id, "failed", message)

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
        suffix_index = self.engine.drafter.suffix.global_index
        if hasattr(suffix_index, "stats"):
            self.metrics.observe_suffix_cache(suffix_index.stats())
        load = self.thread.load if self.thread else None
        info = InstanceInfo(
            instance_id=self.options.instance_id,
            role=self.options.role,
            model=self.options.model_name,
            max_model_len=self.engine.max_model_len,
            kv_address=self.kv_address,
            num_running=load.num_running if load else 0,
            num_waiting=load.num_waiting if load else 0,
            queued_tokens=load.queued_tokens if load else 0,
            free_kv_blocks=load.free_kv_blocks if load else self.engine.block_manager.num_free_blocks,
            total_kv_blocks=self.engine.block_manager.num_blocks,
            block_size=self.engine.config.block_size,
            speculative_method=self.engine.config.speculative_config.method,
            draining=self.draining,
        )
        async with self.bus.client.pipeline(transaction=False) as pipe:
            pipe.set(
                self.keys.heartbeat(self.options.instance_id), encode(info), px=int(self.options.ttl_s * 1000)
            )
            pipe.sadd(self.keys.instances, self.options.instance_id)
            await pipe.execute()

    async def health(self) -> tuple[bool, str]:
        alive = self.thread is not None and self.thread._thread.is_alive()
        if not alive:
            return False, "engine thread is not running"
        try:
            await self.bus.client.ping()
        except RedisError as exc:
            return False, f"redis: {exc}"
        return (not self.draining), "draining" if self.draining else "ok"


def kv_header(export: KVExport) -> KVHeader:
    first_key = export.layers[0][2]
    return KVHeader(
        request_id=export.request_id,
        num_tokens=export.num_tokens,
        block_size=int(first_key.shape[1]),
        dtype=dtype_name(first_key.dtype),
        layer_shapes=[LayerShape(cache=c, index=i, shape=tuple(k.shape)) for c, i, k, _ in export.layers],  # type: ignore[arg-type]
        tensors=[
            TensorSpec(name=n, shape=tuple(t.shape), dtype=dtype_name(t.dtype))
            for n, t in export.tensors.items()
        ],
    )
