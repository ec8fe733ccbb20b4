"""The splitwise scheduler: admits requests, places them on instances by load, heals after deaths.

    receive  (requests: Submit / Cancel;  scheduler-replies: ReserveReply / Finished)
    place    (mixed instance, or a decode reservation then a prefill dispatch)
    watch    (heartbeats; re-dispatch the work of instances that stopped beating)

All state a replacement scheduler needs lives in Redis (request hashes, assignment sets), and every
handler is idempotent by request id, so scheduler replicas can share the consumer group. Each
replica holds a lease (`Keys.scheduler_lease`, renewed every third of --scheduler-ttl); once a
replica's lease is gone, another takes over the messages it left pending on its next read.

Every placement of a request claims the next *epoch* (`Bus.claim_epoch`), and its dispatch goes out
only while that epoch is still current (`Bus.dispatch`): of two replicas, or a report and a dead
instance's burial, placing one request at once, one wins, and workers of an older epoch are
fenced off from the request's output (`Bus.publish_step`). Reports of an older epoch are ignored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.registry import Registry
from shared import trace
from shared.bus import (
    APPEND_AT_END,
    END_BYTES,
    FIRST_EPOCH,
    TRANSIENT_ERRORS,
    Admission,
    Bus,
    Delivery,
    LoopDied,
    Placement,
    as_bytes,
    as_text,
    reraise_if_cancelled,
    retry_transient,
    stop_tasks,
    until_stopped_or_dead,
)
from shared.keys import SCHEDULER_GROUP
from shared.protocol import (
    Cancel,
    Dispatch,
    ErrorInfo,
    Finished,
    GenerateRequest,
    InstanceInfo,
    OutputBatch,
    Reserve,
    ReserveReply,
    Submit,
    TokenEvent,
    decode,
    encode,
)

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
"""Placements of one request (first try plus re-dispatches) before it fails."""
REGISTRY_REFRESH_S = 0.25
DISPATCH_RETRY_S = 10.0
"""How long a dispatch is retried through a Redis outage before the request fails (503)."""
LEASE_RENEWALS_PER_TTL = 3
MAX_REDISPATCHING = 64
"""Requests of dead instances placed again at once; the others wait their turn in a queue. A dead
instance can hold every admitted request (up to --max-queue-len): placed all at once, each would
hold a coroutine chain and its decoded request, and poll Redis every REGISTRY_REFRESH_S, while no
instance is live; the process would keep that peak's memory afterwards."""


@dataclass
class SchedulerOptions:
    consumer: str
    """This replica's name in the consumer group (and its lease's)."""
    ttl_s: float = 5.0
    """How long this replica's lease lasts unless renewed: other replicas take over its pending
    messages once it has lapsed."""
    max_queue_len: int = 1024
    reserve_timeout_s: float = 10.0
    """How long a decode instance may take to reserve blocks for a split request."""
    kv_timeout_s: float = 60.0
    """How long a decode instance waits for the KV of a request it reserved blocks for."""
    dispatch_timeout_s: float = 30.0
    """How long a request may wait for any instance to be live before it fails (503)."""


@dataclass(frozen=True)
class Retry:
    """A request being placed again under its claimed `epoch`, after `previous` failed on `failed`."""

    request_id: str
    epoch: int
    attempts: int
    previous: Placement
    failed: str
    reason: str
    place_anywhere: bool
    deadline: float | None = None
    """When waiting for an instance ends (`time.monotonic()`); None: `dispatch_timeout_s` from now."""


@dataclass(frozen=True)
class Reservation:
    """A Reserve sent to `decode` for a split placement whose prefill goes to `prefill`."""

    decode: InstanceInfo
    prefill: InstanceInfo
    reply: asyncio.Future[ReserveReply]
    """The decode instance's answer (`_follow_reservations` sets it)."""


@dataclass(frozen=True)
class Orphan:
    """A request of a dead instance, waiting to be placed again."""

    request_id: str
    instance_id: str
    """The instance that died."""
    deadline: float
    """`dispatch_timeout_s` after the instance was buried (`time.monotonic()`): however long the
    request queued here, it waits no longer for an instance than it would have unqueued."""


class SplitwiseScheduler:
    def __init__(self, bus: Bus, options: SchedulerOptions, metrics: SchedulerMetrics):
        self.bus = bus
        self.keys = bus.keys
        self.options = options
        self.metrics = metrics
        self.registry = Registry()
        self.reservations: dict[str, asyncio.Future[ReserveReply]] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.placing: set[str] = set()
        """Requests this replica is placing now (a redelivered Submit leaves them alone)."""
        self.orphans: deque[Orphan] = deque()
        """Requests of dead instances not yet being placed again (`MAX_REDISPATCHING` are at once)."""
        self.num_redispatchers = 0

    async def run(self, stop: asyncio.Event) -> None:
        await self._hold_lease()  # before the first read: a consumer without one is taken for dead
        for stream in (self.keys.requests, self.keys.scheduler_replies):
            await self.bus.ensure_group(stream, SCHEDULER_GROUP)
        await self.registry.refresh(self.bus)
        loops = [
            asyncio.create_task(self._consume(self.keys.requests, stop), name="requests"),
            asyncio.create_task(self._consume(self.keys.scheduler_replies, stop), name="replies"),
            asyncio.create_task(self._watch(stop), name="watch"),
            asyncio.create_task(self._follow_reservations(stop), name="reservations"),
            asyncio.create_task(self._keep_lease(stop), name="lease"),
        ]
        logger.info("scheduler ready", extra={"consumer": self.options.consumer})
        dead = await until_stopped_or_dead(stop, loops)
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=5)
        await stop_tasks(loops)
        try:  # what is still pending here goes to the other replicas (or a successor) at once
            await self.bus.forget_scheduler(self.options.consumer)
        except RedisError as exc:
            logger.warning("could not give up the lease", extra={"error": str(exc)})
        if dead is not None:
            raise LoopDied(f"the scheduler's {dead.get_name()} loop died")

    async def _hold_lease(self) -> None:
        await self.bus.hold_lease(self.keys.scheduler_lease(self.options.consumer), self.options.ttl_s)

    async def _keep_lease(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(self.options.ttl_s / LEASE_RENEWALS_PER_TTL)
            try:
                await self._hold_lease()
            except RedisError as exc:
                reraise_if_cancelled(exc)
                logger.warning("renewing the lease failed", extra={"error": str(exc)})

    # ---- receive ------------------------------------------------------------------------------------------

    async def _consume(self, stream: str, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                deliveries = await self.bus.read_group(
                    stream,
                    SCHEDULER_GROUP,
                    self.options.consumer,
                    block_ms=200,
                    lease_prefix=self.keys.scheduler_lease(""),
                )
            except RedisError as exc:
                reraise_if_cancelled(exc)
                logger.warning("bus read failed, retrying", extra={"error": str(exc)})
                await asyncio.sleep(0.5)
                continue
            for delivery in deliveries:
                self._spawn(self._handle(delivery))
            if deliveries:  # each handler sends its first command (an admission) before the next read
                await asyncio.sleep(0)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _handle(self, delivery: Delivery) -> None:
        """Handles one message and acknowledges it afterwards (so a crash leaves it pending). One
        that failed for a Redis outage is left pending too and read again first once the bus
        answers (every handler is idempotent)."""
        message = delivery.message
        try:
            if isinstance(message, Submit):
                trace.hop("scheduler.read", message.request.request_id)
                await self._admit(message.request)
            elif isinstance(message, Cancel):
                await self._cancel(message.request_id, message.reason)
            elif isinstance(message, Finished):
                await self._finished(message)
            else:
                await self.bus.dead_letter(
                    delivery.stream,
                    delivery.entry_id,
                    None,
                    f"the scheduler does not handle {message.kind!r}",
                )
        except TRANSIENT_ERRORS as exc:
            reraise_if_cancelled(exc)
            logger.warning("handling %s failed; left pending", message.kind, extra={"error": str(exc)})
            self.bus.reread_pending(delivery.stream, SCHEDULER_GROUP, self.options.consumer)
            return
        except Exception as exc:
            logger.exception("handling %s failed", message.kind)
            await self.bus.dead_letter(
                delivery.stream, delivery.entry_id, encode(message), f"{message.kind}: {exc}"
            )
        await self.bus.ack(delivery.stream, SCHEDULER_GROUP, delivery.entry_id)

    async def _follow_reservations(self, stop: asyncio.Event) -> None:
        """Answers to this replica's reservations (its own stream: replicas never see each other's)."""
        # an explicit start id (not "$"), so replies arriving between two reads are never skipped
        stream, last_id = self.keys.reservation_replies(self.options.consumer), f"{int(time.time() * 1000)}-0"
        while not stop.is_set():
            try:
                deliveries, last_id = await self.bus.read_stream(stream, last_id, block_ms=200)
            except RedisError as exc:
                reraise_if_cancelled(exc)
                logger.warning("bus read failed, retrying", extra={"error": str(exc)})
                await asyncio.sleep(0.5)
                continue
            for delivery in deliveries:
                reply = delivery.message
                waiter = self.reservations.get(reply.request_id) if isinstance(reply, ReserveReply) else None
                if waiter is not None and not waiter.done():
                    waiter.set_result(reply)  # type: ignore[arg-type]

    # ---- admission and placement --------------------------------------------------------------------------

    async def _admit(self, request: GenerateRequest) -> None:
        """Admits the request and places it: with a mixed instance at hand, both in one round trip;
        with a prefill and a decode instance, the admission and the decode's Reserve in one."""
        if request.gateway_id is None:
            raise ValueError("a submit without a gateway_id: nowhere to send its outputs")
        mixed = self.registry.pick_least_loaded("mixed", frozenset())
        pair = None if mixed is not None else self._split_pair(request, frozenset())
        reservation = None
        if mixed is not None:
            admission = await self._admit_on(request, mixed.instance_id)
        elif pair is not None:
            admission, reservation = await self._admit_reserving(request, pair)
        else:
            submit = Submit(request=request)
            admission = await self.bus.admit(request.request_id, submit, self.options.max_queue_len)
        trace.hop("scheduler.admitted", request.request_id)
        if admission == "ended":
            return  # a late repeat of the Submit of a request that has ended
        if admission == "admitted" and mixed is not None:
            return  # dispatched with its admission
        if reservation is not None:
            await self._place(request, FIRST_EPOCH, reservation=reservation)
            return
        if admission == "duplicate" and (request.request_id in self.placing or await self._placed(request)):
            return  # a redelivered Submit: already placed, or being placed here
        if admission == "queue_full":
            self.metrics.rejected.inc()
            await self._fail(
                request, 429, f"server is busy: {self.options.max_queue_len} requests already queued"
            )
            return
        epoch = await self.bus.claim_epoch(request.request_id)
        trace.hop("scheduler.claimed", request.request_id)
        if epoch is not None:
            await self._place(request, epoch)

    async def _admit_on(self, request: GenerateRequest, instance_id: str) -> Admission:
        """`Bus.admit`, and for a request admitted now its first placement, dispatched to the
        mixed instance `instance_id` in the same round trip."""
        started = time.perf_counter()
        dispatch = Dispatch(role="mixed", request=request, epoch=FIRST_EPOCH)
        admission = await self.bus.admit_and_dispatch(
            request.request_id, Submit(request=request), self.options.max_queue_len, instance_id, dispatch
        )
        if admission == "admitted":
            self.registry.note_dispatch(instance_id)
            self.metrics.dispatched.labels(role="mixed").inc()
            self.metrics.placement_seconds.observe(time.perf_counter() - started)
        return admission

    async def _admit_reserving(
        self, request: GenerateRequest, pair: tuple[InstanceInfo, InstanceInfo]
    ) -> tuple[Admission, Reservation | None]:
        """`Bus.admit`, and for a request admitted now its first placement's epoch and the Reserve to
        the decode instance of `pair` (decode, prefill), in the same round trip; the reservation
        (None where nothing was sent)."""
        decode_info, prefill_info = pair
        reservation = Reservation(decode_info, prefill_info, self._expect_reservation(request.request_id))
        try:
            admission = await self.bus.admit_and_reserve(
                request.request_id,
                Submit(request=request),
                self.options.max_queue_len,
                decode_info.instance_id,
                self._reserve_message(request, FIRST_EPOCH),
            )
        except BaseException:
            self.reservations.pop(request.request_id, None)
            raise
        if admission != "admitted":
            self.reservations.pop(request.request_id, None)
            return admission, None
        return admission, reservation

    async def _placed(self, request: GenerateRequest) -> bool:
        """Whether a dispatch of the request went out (its placement is recorded with it), or it
        needs none any more (it ended)."""
        placement = await self.bus.placement(request.request_id)
        return placement is None or bool(placement.instance_ids)

    async def _current(self, request_id: str, epoch: int) -> bool:
        """Whether the placement of `epoch` is still the request's (not ended, not placed again)."""
        placement = await self.bus.placement(request_id)
        return placement is not None and placement.epoch == epoch

    async def _place(
        self,
        request: GenerateRequest,
        epoch: int,
        exclude: frozenset[str] = frozenset(),
        deadline: float | None = None,
        reservation: Reservation | None = None,
    ) -> None:
        self.placing.add(request.request_id)
        try:
            await self._place_once(request, epoch, exclude, deadline, reservation)
        finally:
            self.placing.discard(request.request_id)

    async def _place_once(
        self,
        request: GenerateRequest,
        epoch: int,
        exclude: frozenset[str],
        deadline: float | None,
        reservation: Reservation | None = None,
    ) -> None:
        """Waits until `deadline` (None: `dispatch_timeout_s` from now) for an instance to place the
        request on; a Redis outage meanwhile is waited out too (a worker and Redis may be
        restarting together). `reservation`: a Reserve already sent for this epoch, tried first."""
        started = time.perf_counter()
        if deadline is None:
            deadline = time.monotonic() + self.options.dispatch_timeout_s
        while not await self._try_place(request, epoch, exclude, reservation):
            reservation = None
            if time.monotonic() > deadline:
                await self._give_up(request, epoch, 503, "no worker instance is available to run the request")
                return
            await asyncio.sleep(REGISTRY_REFRESH_S)
            if not await self._still_current(request.request_id, epoch):
                return  # cancelled, or placed by another replica, while waiting
        self.metrics.placement_seconds.observe(time.perf_counter() - started)

    async def _still_current(self, request_id: str, epoch: int) -> bool:
        """`_current`, or True while Redis is down (the wait goes on)."""
        try:
            return await self._current(request_id, epoch)
        except TRANSIENT_ERRORS as exc:
            reraise_if_cancelled(exc)
            return True

    async def _try_place(
        self,
        request: GenerateRequest,
        epoch: int,
        exclude: frozenset[str],
        reservation: Reservation | None = None,
    ) -> bool:
        """Places the placement of `epoch` (or finds it superseded, or gives up); False to retry.
        `exclude` is a preference: an excluded instance is chosen when no other could run it (a
        prefill whose KV handoff failed because its decode instance died is not to blame)."""
        if reservation is not None:
            return await self._dispatch_split(request, epoch, exclude, reservation)
        if exclude and not self._placeable(exclude):
            exclude = frozenset()
        mixed = self.registry.pick_least_loaded("mixed", exclude)
        if mixed is not None:
            await self._dispatch_mixed(request, epoch, mixed.instance_id)
            return True
        return self._placeable(exclude) and await self._dispatch_split(request, epoch, exclude)

    def _placeable(self, exclude: frozenset[str]) -> bool:
        """Whether live instances outside `exclude` can run a request: a mixed one, or a pair."""
        candidates = self.registry.candidates
        return bool(
            candidates("mixed", exclude) or (candidates("prefill", exclude) and candidates("decode", exclude))
        )

    async def _dispatch_mixed(self, request: GenerateRequest, epoch: int, instance_id: str) -> None:
        dispatch = Dispatch(role="mixed", request=request, epoch=epoch)
        if await self._dispatch(request, epoch, [instance_id], dispatch):
            self.registry.note_dispatch(instance_id)
            self.metrics.dispatched.labels(role="mixed").inc()

    async def _dispatch_split(
        self,
        request: GenerateRequest,
        epoch: int,
        exclude: frozenset[str],
        reservation: Reservation | None = None,
    ) -> bool:
        """Reserve blocks on a decode instance first (unless `reservation`: that Reserve went out
        already), then send the prefill there; False to retry."""
        if reservation is None:
            pair = self._split_pair(request, exclude)
            if pair is None:
                return False
            reservation = await self._send_reserve(request, epoch, pair)
        decode_info, prefill_info = reservation.decode, reservation.prefill
        reply = await self._reserve(request, epoch, reservation)
        if reply is not None and not reply.ok and reply.code == 400:
            await self._give_up(request, epoch, 400, reply.error or "invalid request")
            return True
        if reply is None or not reply.ok:
            return reply is None  # None: it timed out, and the request failed
        dispatch = Dispatch(
            role="prefill",
            request=request,
            epoch=epoch,
            decode_instance=decode_info.instance_id,
            decode_kv_address=reply.kv_address,
        )
        instance_ids = [decode_info.instance_id, prefill_info.instance_id]
        if not await self._dispatch(request, epoch, instance_ids, dispatch):
            cancel = Cancel(request_id=request.request_id, reason="placed again", epoch=epoch)
            await self.bus.publish(self.keys.inbox(decode_info.instance_id), cancel)
            return True
        self.registry.note_dispatch(prefill_info.instance_id)
        self.registry.note_dispatch(decode_info.instance_id)
        self.metrics.dispatched.labels(role="split").inc()
        return True

    async def _dispatch(
        self, request: GenerateRequest, epoch: int, instance_ids: list[str], dispatch: Dispatch
    ) -> bool:
        """Records the placement and sends the dispatch to the last of `instance_ids`, through a
        Redis outage of up to `DISPATCH_RETRY_S` (a repeat is harmless: a worker ignores a request
        it already runs); past that the error propagates and the Submit stays pending. False, with
        nothing sent, if the request ended or was placed again meanwhile."""
        inbox = self.keys.inbox(instance_ids[-1])
        sent = await retry_transient(
            lambda: self.bus.dispatch(request.request_id, epoch, instance_ids, inbox, dispatch),
            f"dispatching {request.request_id}",
            DISPATCH_RETRY_S,
        )
        trace.hop("scheduler.dispatched", request.request_id)
        if not sent:
            logger.info("placement superseded", extra={"request_id": request.request_id, "epoch": epoch})
        return sent

    def _split_pair(
        self, request: GenerateRequest, exclude: frozenset[str]
    ) -> tuple[InstanceInfo, InstanceInfo] | None:
        """The decode instance (with room for the request) and the prefill instance to run it on."""
        num_tokens = len(request.prompt_token_ids) + len(request.resumed_token_ids) + 1
        decode_info = self.registry.pick_decode(num_tokens, exclude)
        prefill_info = self.registry.pick_least_loaded("prefill", exclude)
        if decode_info is None or prefill_info is None:
            return None
        return decode_info, prefill_info

    def _reserve_message(self, request: GenerateRequest, epoch: int) -> Reserve:
        return Reserve(
            request=request,
            epoch=epoch,
            timeout_s=self.options.kv_timeout_s,
            reply_to=self.keys.reservation_replies(self.options.consumer),
        )

    def _expect_reservation(self, request_id: str) -> asyncio.Future[ReserveReply]:
        """The future of the answer to a Reserve about to be sent (registered first: it may come
        back before the send's own reply does)."""
        waiter: asyncio.Future[ReserveReply] = asyncio.get_running_loop().create_future()
        self.reservations[request_id] = waiter
        return waiter

    async def _send_reserve(
        self, request: GenerateRequest, epoch: int, pair: tuple[InstanceInfo, InstanceInfo]
    ) -> Reservation:
        reservation = Reservation(*pair, self._expect_reservation(request.request_id))
        try:
            await self.bus.publish(
                self.keys.inbox(pair[0].instance_id), self._reserve_message(request, epoch)
            )
        except BaseException:
            self.reservations.pop(request.request_id, None)
            raise
        return reservation

    async def _reserve(
        self, request: GenerateRequest, epoch: int, reservation: Reservation
    ) -> ReserveReply | None:
        """The decode instance's answer; None if it gave none in time (the request has failed),
        unless it died meanwhile (its heartbeat is gone): then a refusal, to place it elsewhere."""
        decode_id = reservation.decode.instance_id
        try:
            return await asyncio.wait_for(reservation.reply, self.options.reserve_timeout_s)
        except asyncio.TimeoutError:
            self.metrics.reserve_timeouts.inc()
            logger.warning(
                "reservation timed out", extra={"request_id": request.request_id, "decode": decode_id}
            )
            await self.bus.publish(
                self.keys.inbox(decode_id),
                Cancel(request_id=request.request_id, reason="reservation timed out", epoch=epoch),
            )
            if not await self.bus.client.exists(self.keys.heartbeat(decode_id)):
                return ReserveReply(
                    request_id=request.request_id,
                    instance_id=decode_id,
                    ok=False,
                    code=503,
                    error=f"decode instance {decode_id} died",
                )
            await self._give_up(
                request,
                epoch,
                504,
                f"decode instance {decode_id} did not reserve KV blocks within {self.options.reserve_timeout_s:g} s",
            )
            return None
        finally:
            self.reservations.pop(request.request_id, None)

    # ---- completion, cancellation, failure ----------------------------------------------------------------

    async def _finished(self, message: Finished) -> None:
        placement = await self.bus.placement(message.request_id)
        if placement is not None and placement.epoch != message.epoch:
            logger.info(
                "report of an earlier placement ignored",
                extra={"request_id": message.request_id, "epoch": message.epoch, "outcome": message.outcome},
            )
            return
        if message.outcome in ("handed_off", "failed", "returned"):
            await self.bus.client.srem(self.keys.assignments(message.instance_id), message.request_id)
        if message.outcome in ("failed", "returned"):
            await self._retry(
                message.request_id,
                message.instance_id,
                message.error or message.outcome,
                place_anywhere=message.outcome == "returned",
                seen=message.epoch,
            )
        elif message.outcome != "handed_off":
            await self.bus.release(message.request_id, message.instance_id)

    async def _cancel(self, request_id: str, reason: str = "client disconnected") -> None:
        """Stops the request where it runs and ends it (off its instances' assignments too: the
        fenced worker reports nothing)."""
        placement = await self.bus.placement(request_id)
        instance_ids = placement.instance_ids if placement else []
        for instance_id in instance_ids:
            await self.bus.publish(self.keys.inbox(instance_id), Cancel(request_id=request_id, reason=reason))
        await self.bus.release(request_id, *instance_ids)

    async def _retry(
        self,
        request_id: str,
        failed: str,
        reason: str,
        place_anywhere: bool = False,
        seen: int | None = None,
        deadline: float | None = None,
    ) -> None:
        """Places a request again (after its instance `failed`, died or gave it back), resuming after
        the tokens its gateway already has; gives up after MAX_ATTEMPTS. Only if the placement that
        failed is still current: the one of epoch `seen`, or (None) one on `failed`. `failed` is
        not told to cancel it, and is not chosen again unless `place_anywhere` (an instance that
        lost the bus, or missed heartbeats, is fine once it is back). `deadline`: as `_place_once`'s."""
        placement = await self.bus.placement(request_id)
        if placement is None or (seen is None and failed not in placement.instance_ids):
            return  # ended, or placed elsewhere since
        epoch = await self.bus.claim_epoch(request_id, placement.epoch if seen is None else seen)
        if epoch is None:
            return  # placed again meanwhile (another report, another replica)
        # from here on nothing else would place it (a report read again is of an earlier epoch
        # now, and ignored): a Redis outage is waited out here, until the scheduler stops
        attempts = await retry_transient(
            lambda: self._count_attempt(request_id), f"counting the attempts of {request_id}", None
        )
        again = Retry(request_id, epoch, attempts, placement, failed, reason, place_anywhere, deadline)
        await retry_transient(lambda: self._place_again(again), f"placing {request_id} again", None)

    async def _count_attempt(self, request_id: str) -> int:
        return int(await self.bus.client.hincrby(self.keys.request_state(request_id), "attempts", 1))

    async def _place_again(self, again: Retry) -> None:
        """Places the claimed epoch `again.epoch`, resuming after the delivered tokens (safe to repeat)."""
        request_id, epoch = again.request_id, again.epoch
        raw = await self.bus.client.hget(self.keys.request_state(request_id), "request")
        if raw is None:
            return
        message = decode(as_bytes(raw))
        assert isinstance(message, Submit)
        delivered, finished = await self.bus.delivered_tokens(request_id)  # final: the old epoch is fenced
        if finished:
            await self.bus.release(request_id)
            return
        if again.attempts >= MAX_ATTEMPTS:
            error = f"request failed {again.attempts} times; last error: {again.reason}"
            await self._give_up(message.request, epoch, 500, error)
            return
        previous = again.previous
        for instance_id in set(previous.instance_ids) - {again.failed}:
            cancel = Cancel(request_id=request_id, reason="re-dispatched", epoch=previous.epoch)
            await self.bus.publish(self.keys.inbox(instance_id), cancel)
            await self.bus.client.srem(self.keys.assignments(instance_id), request_id)
        request = message.request.model_copy(update={"resumed_token_ids": delivered})
        self.metrics.redispatched.inc()
        logger.warning(
            "re-dispatching",
            extra={
                "request_id": request_id,
                "reason": again.reason,
                "resumed": len(delivered),
                "epoch": epoch,
            },
        )
        exclude = frozenset() if again.place_anywhere else frozenset({again.failed})
        await self._place(request, epoch, exclude=exclude, deadline=again.deadline)

    async def _give_up(self, request: GenerateRequest, epoch: int, code: int, message: str) -> None:
        """Ends the placement of `epoch` with an error, unless it is no longer current."""
        if await self._fail(request, code, message, epoch):
            await self.bus.release(request.request_id)

    async def _fail(
        self, request: GenerateRequest, code: int, message: str, epoch: int | None = None
    ) -> bool:
        """Ends the request with an error its gateway answers with; given the placement's `epoch`,
        only while it is current (False if not: nothing was sent)."""
        kind = {429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}.get(code, "server_error")
        event = TokenEvent(
            request_id=request.request_id,
            finished=True,
            finish_reason="error",
            error=ErrorInfo(code=code, type=kind, message=message),
        )
        assert request.gateway_id is not None  # checked at admission
        outputs = [(request.gateway_id, encode(OutputBatch.of([event])))]
        records = [] if epoch is None else [(request.request_id, epoch, APPEND_AT_END, END_BYTES)]
        return not await self.bus.publish_step(outputs, records)

    # ---- watching instances -------------------------------------------------------------------------------

    async def _watch(self, stop: asyncio.Event) -> None:
        bus_lost_at = time.monotonic()  # a fresh replica cannot tell whether Redis just came back
        while not stop.is_set():
            try:
                await self.registry.refresh(self.bus)
                self.metrics.observe_registry(self.registry)
                self.metrics.queue_depth.set(int(await self.bus.client.get(self.keys.queue_depth) or 0))
                for instance_id in self.registry.dead:
                    await self._bury(instance_id)
                if time.monotonic() - bus_lost_at >= self.options.ttl_s:
                    await self._abort_orphans()
            except RedisError as exc:
                reraise_if_cancelled(exc)
                bus_lost_at = time.monotonic()
                logger.warning("registry refresh failed", extra={"error": str(exc)})
            await asyncio.sleep(REGISTRY_REFRESH_S)

    async def _abort_orphans(self) -> None:
        """Aborts the requests of gateway incarnations that no longer hold their liveness (the
        process died, or was restarted: its clients are gone), freeing their slots and KV. Only
        once this replica has seen the bus answer for a whole TTL (see `_watch`): a gateway that
        was only cut off by a Redis outage has renewed its liveness by then."""
        for gateway_id, live in (await self.bus.gateway_owners()).items():
            owned = await self.bus.gateway_requests(gateway_id)
            orphans = [rid for rid, incarnation in owned.items() if incarnation != live]
            for request_id in orphans:
                await self._abort_orphan(gateway_id, request_id)
            if live is None and len(orphans) == len(owned):
                await self.bus.forget_gateway(gateway_id)

    async def _abort_orphan(self, gateway_id: str, request_id: str) -> None:
        """Ends a request whose gateway is gone, as a client's cancel would, and says so on the
        gateway's stream (a gateway wrongly taken for dead answers its client with the error)."""
        if await self.bus.placement(request_id) is None:
            return  # ended meanwhile
        logger.warning(
            "aborting a request of a gateway gone", extra={"request_id": request_id, "gateway": gateway_id}
        )
        await self._cancel(request_id, reason=f"gateway {gateway_id} stopped renewing its liveness")
        self.metrics.orphans_aborted.inc()
        message = f"request aborted: its gateway ({gateway_id}) was taken for dead"
        event = TokenEvent(
            request_id=request_id,
            finished=True,
            finish_reason="error",
            error=ErrorInfo(code=503, type="service_unavailable", message=message),
        )
        await self.bus.publish_step([(gateway_id, encode(OutputBatch.of([event])))])

    async def _bury(self, instance_id: str) -> None:
        """An instance stopped heart-beating: one scheduler (holding the lock) re-dispatches its work."""
        lock = self.keys.request_state(f"bury:{instance_id}")
        if not await self.bus.client.set(lock, self.options.consumer, nx=True, ex=60):
            return
        request_ids = [as_text(r) for r in await self.bus.client.smembers(self.keys.assignments(instance_id))]
        logger.warning("instance died", extra={"instance": instance_id, "requests": len(request_ids)})
        await self.bus.client.srem(self.keys.instances, instance_id)
        # its inbox too: what is left there is for placements now made again, and a worker started
        # again has a new instance id (one that only lost the bus makes its group anew)
        await self.bus.client.delete(self.keys.assignments(instance_id), self.keys.inbox(instance_id))
        deadline = time.monotonic() + self.options.dispatch_timeout_s
        self.orphans.extend(Orphan(request_id, instance_id, deadline) for request_id in request_ids)
        while self.num_redispatchers < min(MAX_REDISPATCHING, len(self.orphans)):
            self.num_redispatchers += 1
            self._spawn(self._redispatch_orphans())

    async def _redispatch_orphans(self) -> None:
        """Places queued orphans again, one after another, until none is left."""
        try:
            while self.orphans:
                orphan = self.orphans.popleft()
                try:
                    await self._redispatch(orphan)
                except Exception:  # a bug with one request must not leave the others queued
                    logger.exception("re-dispatching failed", extra={"request_id": orphan.request_id})
        finally:
            self.num_redispatchers -= 1

    async def _redispatch(self, orphan: Orphan) -> None:
        """Places a dead instance's request again. No bus message is pending for it (the
        assignment set is gone), so a Redis outage is waited out here, or the request is lost.
        Anywhere: an instance that only lost the bus comes back (fenced off from what it ran)."""
        request_id, instance_id = orphan.request_id, orphan.instance_id
        reason = f"instance {instance_id} stopped responding"
        await retry_transient(
            lambda: self._retry(
                request_id, instance_id, reason, place_anywhere=True, deadline=orphan.deadline
            ),
            f"re-dispatching {request_id}",
            None,
        )

    async def health(self) -> tuple[bool, str]:
        try:
            await self.bus.client.ping()
        except RedisError as exc:
            return False, f"redis: {exc}"
        return True, f"{len(self.registry.live)} live instances"
