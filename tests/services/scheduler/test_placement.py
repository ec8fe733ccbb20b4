"""Placement under epochs against a real Redis: an excluded instance is chosen when no other could
run the request, a report of an earlier placement changes nothing, and two replicas placing one
request again at once send one dispatch."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.scheduler import SchedulerOptions, SplitwiseScheduler
from shared.bus import Bus
from shared.protocol import (
    PAYLOAD_FIELD,
    Dispatch,
    Finished,
    GenerateRequest,
    InstanceInfo,
    Reserve,
    ReserveReply,
    Submit,
    decode,
)
from shared.sampling_params import SamplingParams

REQUEST = GenerateRequest(
    request_id="r", prompt_token_ids=[5, 6], params=SamplingParams(max_tokens=4), gateway_id="g"
)


def scheduler(bus: Bus, consumer: str = "s1", live: tuple[str, ...] = ("w1",)) -> SplitwiseScheduler:
    made = SplitwiseScheduler(bus, SchedulerOptions(consumer=consumer), SchedulerMetrics())
    for instance_id in live:
        made.registry.live[instance_id] = InstanceInfo(
            instance_id=instance_id, role="mixed", model="m", max_model_len=512, free_kv_blocks=64
        )
    return made


def split_scheduler(bus: Bus, options: SchedulerOptions | None = None) -> SplitwiseScheduler:
    """A scheduler that sees one prefill (p0) and one decode (d0) instance live."""
    made = SplitwiseScheduler(bus, options or SchedulerOptions(consumer="s1"), SchedulerMetrics())
    for instance_id, role in (("p0", "prefill"), ("d0", "decode")):
        made.registry.live[instance_id] = InstanceInfo(
            instance_id=instance_id,
            role=role,
            model="m",
            max_model_len=512,
            free_kv_blocks=64,  # type: ignore[arg-type]
        )
    return made


async def dispatches_to(bus: Bus, instance_id: str) -> list[Dispatch]:
    entries: Any = await bus.client.xrange(bus.keys.inbox(instance_id))
    return [m for _, f in entries if isinstance(m := decode(f[PAYLOAD_FIELD]), Dispatch)]


async def reserves_to(bus: Bus, instance_id: str) -> list[Reserve]:
    entries: Any = await bus.client.xrange(bus.keys.inbox(instance_id))
    return [m for _, f in entries if isinstance(m := decode(f[PAYLOAD_FIELD]), Reserve)]


async def admit_split(s: SplitwiseScheduler, request: GenerateRequest) -> None:
    """`_admit` on a split pair, with d0's reservation answered as soon as it is awaited."""
    admitting = asyncio.create_task(s._admit(request))
    while request.request_id not in s.reservations:
        assert not admitting.done(), "placed without a reservation"
        await asyncio.sleep(0.005)
    reply = ReserveReply(request_id=request.request_id, instance_id="d0", ok=True, kv_address="127.0.0.1:1")
    s.reservations[request.request_id].set_result(reply)
    await asyncio.wait_for(admitting, 10)


async def test_a_new_request_is_admitted_and_dispatched_in_one_round_trip(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a mixed instance live; a redelivered Submit then sends no second dispatch."""
    s = scheduler(bus)
    await s._admit(REQUEST.model_copy(update={"request_id": "warm"}))  # loads the script
    commands: list[Any] = []
    execute = bus.client.execute_command

    async def counted(*args: Any, **options: Any) -> Any:
        commands.append(args[0])
        return await execute(*args, **options)

    monkeypatch.setattr(bus.client, "execute_command", counted)
    await s._admit(REQUEST)
    assert commands == ["EVALSHA"]
    monkeypatch.undo()
    await s._admit(REQUEST)
    assert [d.epoch for d in await dispatches_to(bus, "w1")] == [1, 1]  # warm's and r's
    placement = await bus.placement("r")
    assert placement is not None and (placement.epoch, placement.instance_ids) == (1, ["w1"])


async def test_a_new_split_request_is_admitted_and_reserved_in_one_round_trip(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a prefill and a decode instance live: the admission, the first epoch and the Reserve
    go in one script, then the prefill's dispatch in another (no `claim_epoch`, no separate XADD)."""
    s = split_scheduler(bus)
    await admit_split(s, REQUEST.model_copy(update={"request_id": "warm"}))  # loads the scripts
    commands: list[Any] = []
    execute = bus.client.execute_command

    async def counted(*args: Any, **options: Any) -> Any:
        commands.append(args[0])
        return await execute(*args, **options)

    monkeypatch.setattr(bus.client, "execute_command", counted)
    await admit_split(s, REQUEST)
    assert commands == ["EVALSHA", "EVALSHA"]
    monkeypatch.undo()
    assert [(r.request.request_id, r.epoch) for r in await reserves_to(bus, "d0")] == [("warm", 1), ("r", 1)]
    [_, dispatch] = await dispatches_to(bus, "p0")
    assert (dispatch.request.request_id, dispatch.epoch, dispatch.decode_instance) == ("r", 1, "d0")
    placement = await bus.placement("r")
    assert placement is not None and (placement.epoch, placement.instance_ids) == (1, ["d0", "p0"])


async def test_a_split_request_refused_by_its_decode_instance_is_reserved_again(bus: Bus) -> None:
    """The reservation sent with the admission is answered 503 (no room): the request is placed
    again under the same epoch, with a Reserve of its own."""
    s = split_scheduler(bus)
    admitting = asyncio.create_task(s._admit(REQUEST))
    answers = [True, False]  # the last answer first: a refusal, then a reservation
    while answers:
        while "r" not in s.reservations or s.reservations["r"].done():
            assert not admitting.done()
            await asyncio.sleep(0.005)
        ok = answers.pop()
        reply = ReserveReply(request_id="r", instance_id="d0", ok=ok, code=None if ok else 503, error="full")
        s.reservations["r"].set_result(reply)
    await asyncio.wait_for(admitting, 10)
    assert [r.epoch for r in await reserves_to(bus, "d0")] == [1, 1]
    assert [d.epoch for d in await dispatches_to(bus, "p0")] == [1]


async def test_an_excluded_instance_is_chosen_when_no_other_can_run_the_request(bus: Bus) -> None:
    await bus.admit("r", Submit(request=REQUEST), max_queue_len=8)
    epoch = await bus.claim_epoch("r")
    assert epoch is not None
    assert await scheduler(bus)._try_place(REQUEST, epoch, frozenset({"w1"}))
    assert [d.epoch for d in await dispatches_to(bus, "w1")] == [1]


async def test_a_report_of_an_earlier_placement_changes_nothing(bus: Bus) -> None:
    s = scheduler(bus)
    await s._admit(REQUEST)  # placed on w1 under epoch 1
    await s._retry("r", "w1", "stopped responding", place_anywhere=True)  # epoch 2, on w1 again
    await s._finished(Finished(request_id="r", instance_id="w1", outcome="done", epoch=1))
    placement = await bus.placement("r")
    assert placement is not None and placement.epoch == 2
    await s._finished(Finished(request_id="r", instance_id="w1", outcome="done", epoch=2))
    assert await bus.placement("r") is None
    assert int(await bus.client.get(bus.keys.queue_depth)) == 0


async def test_two_replicas_placing_a_request_again_at_once_send_one_dispatch(bus: Bus) -> None:
    """Both saw w0 die (or one saw the death, the other a `failed` report): one claims the next
    epoch, the other finds the placement gone from w0 or the epoch taken, and sends nothing."""
    first, second = scheduler(bus, "s1"), scheduler(bus, "s2")
    await bus.admit("r", Submit(request=REQUEST), max_queue_len=8)
    epoch = await bus.claim_epoch("r")
    assert epoch is not None
    await bus.dispatch("r", epoch, ["w0"], bus.keys.inbox("w0"), Submit(request=REQUEST))
    await asyncio.gather(
        first._retry("r", "w0", "w0 stopped responding"),
        second._retry("r", "w0", "failed", seen=epoch),
    )
    assert [d.epoch for d in await dispatches_to(bus, "w1")] == [2]


async def test_a_reservation_unanswered_by_a_dead_decode_instance_is_placed_again(bus: Bus) -> None:
    """A decode instance killed just before its reservation still looks live until its heartbeat
    expires: its silence sends the request back to placement, not to its client as a 504. A live
    instance's silence still fails the request."""
    s = split_scheduler(bus, SchedulerOptions(consumer="s1", reserve_timeout_s=0.1))
    await bus.admit("r", Submit(request=REQUEST), max_queue_len=8)
    epoch = await bus.claim_epoch("r")
    assert epoch is not None
    assert not await s._try_place(REQUEST, epoch, frozenset())  # d0 has no heartbeat: died
    assert not await bus.client.exists(bus.keys.outputs("g"))
    await bus.client.set(bus.keys.heartbeat("d0"), b"alive")
    assert await s._try_place(REQUEST, epoch, frozenset())
    [(_, fields)] = await bus.client.xrange(bus.keys.outputs("g"))
    [event] = decode(fields[PAYLOAD_FIELD]).events()  # type: ignore[union-attr]
    assert event.error is not None and event.error.code == 504
    assert await bus.placement("r") is None


async def test_a_returned_request_is_placed_through_an_outage_after_its_epoch_is_claimed(
    bus: Bus, monkeypatch: Any
) -> None:
    """Redis going away between the claim of the new epoch and the dispatch must not lose the
    request: read again, the report is of an earlier placement and ignored, so nothing else would
    ever place it."""
    s = scheduler(bus)
    await s._admit(REQUEST)  # placed on w1 under epoch 1
    delivered_tokens, failures = bus.delivered_tokens, [RedisConnectionError("Redis is restarting")]

    async def flaky(request_id: str) -> tuple[list[int], bool]:
        if failures:
            raise failures.pop()
        return await delivered_tokens(request_id)

    monkeypatch.setattr(bus, "delivered_tokens", flaky)
    returned = Finished(request_id="r", instance_id="w1", outcome="returned", epoch=1)
    await asyncio.wait_for(s._finished(returned), 10)
    await s._finished(returned)  # the report read again changes nothing
    assert [d.epoch for d in await dispatches_to(bus, "w1")] == [1, 2]
