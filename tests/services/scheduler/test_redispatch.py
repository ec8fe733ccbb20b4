"""A dead instance's requests against a real Redis: all placed again, at most MAX_REDISPATCHING at
once, each waiting for an instance no longer than `dispatch_timeout_s` from the death however long it
queued, and nothing per request left behind once they ended (in the scheduler or in Redis)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from services.scheduler import scheduler as scheduler_module
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.scheduler import Orphan, SchedulerOptions, SplitwiseScheduler
from shared.bus import ENDED_TTL_S, Bus
from shared.protocol import (
    PAYLOAD_FIELD,
    Dispatch,
    Finished,
    GenerateRequest,
    InstanceInfo,
    OutputBatch,
    Submit,
    decode,
    encode,
)
from shared.sampling_params import SamplingParams

NUM_REQUESTS = 24
MAX_AT_ONCE = 4


def request(request_id: str) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id, prompt_token_ids=[5, 6], params=SamplingParams(max_tokens=4), gateway_id="g"
    )


def scheduler(bus: Bus, live: tuple[str, ...], dispatch_timeout_s: float = 30.0) -> SplitwiseScheduler:
    options = SchedulerOptions(consumer="s1", dispatch_timeout_s=dispatch_timeout_s)
    made = SplitwiseScheduler(bus, options, SchedulerMetrics())
    for instance_id in live:
        made.registry.live[instance_id] = InstanceInfo(
            instance_id=instance_id, role="mixed", model="m", max_model_len=512, free_kv_blocks=64
        )
    return made


async def place_on_dead_instance(s: SplitwiseScheduler, request_ids: list[str]) -> None:
    """Admits the requests and dispatches them all to w0, which then dies (no heartbeat)."""
    for request_id in request_ids:
        await s.bus.admit(request_id, Submit(request=request(request_id)), max_queue_len=1000)
        epoch = await s.bus.claim_epoch(request_id)
        assert epoch is not None
        dispatch = Dispatch(role="mixed", request=request(request_id), epoch=epoch)
        await s.bus.dispatch(request_id, epoch, ["w0"], s.keys.inbox("w0"), dispatch)
    await s.bus.client.sadd(s.keys.instances, "w0")


async def settled(s: SplitwiseScheduler) -> None:
    while s.tasks:
        await asyncio.wait(set(s.tasks))


async def dispatches_to(bus: Bus, instance_id: str) -> list[Dispatch]:
    entries: Any = await bus.client.xrange(bus.keys.inbox(instance_id))
    return [m for _, f in entries if isinstance(m := decode(f[PAYLOAD_FIELD]), Dispatch)]


async def per_request_keys(bus: Bus) -> dict[str, int]:
    """Keys of the topic by kind (`request`, `delivered`, ...), the shared ones left out."""
    kinds: dict[str, int] = {}
    async for key in bus.client.scan_iter(match=bus.keys.pattern, count=1000):
        kind = key.decode().split(":")[2]
        if kind not in ("inbox", "instances", "queue-depth", "out"):
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


async def test_a_dead_instance_s_requests_are_all_placed_again_a_few_at_a_time_and_leave_nothing(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scheduler_module, "MAX_REDISPATCHING", MAX_AT_ONCE)
    s = scheduler(bus, live=("w1",))
    request_ids = [f"r{i}" for i in range(NUM_REQUESTS)]
    await place_on_dead_instance(s, request_ids)
    redispatch, at_once, most_at_once = s._redispatch, 0, 0

    async def counted(orphan: Orphan) -> None:
        nonlocal at_once, most_at_once
        at_once += 1
        most_at_once = max(most_at_once, at_once)
        try:
            await redispatch(orphan)
        finally:
            at_once -= 1

    monkeypatch.setattr(s, "_redispatch", counted)
    await s._bury("w0")
    assert not await bus.client.exists(bus.keys.inbox("w0"), bus.keys.assignments("w0"))
    await settled(s)
    assert most_at_once == MAX_AT_ONCE
    placed = await dispatches_to(bus, "w1")
    assert sorted(d.request.request_id for d in placed) == sorted(request_ids)
    assert {d.epoch for d in placed} == {2}

    for dispatch in placed:  # w1 finishes them all
        done = Finished(request_id=dispatch.request.request_id, instance_id="w1", outcome="done", epoch=2)
        await s._finished(done)
    assert (s.tasks, s.placing, list(s.orphans), s.reservations, s.num_redispatchers) == (
        set(),
        set(),
        [],
        {},
        0,
    )
    assert await per_request_keys(bus) == {"request": NUM_REQUESTS + 1}  # and the burial's lock
    for request_id in request_ids:  # only the `ended` mark, expiring
        assert await bus.client.hgetall(bus.keys.request_state(request_id)) == {b"ended": b"1"}
        assert 0 < await bus.client.ttl(bus.keys.request_state(request_id)) <= ENDED_TTL_S
    assert int(await bus.client.get(bus.keys.queue_depth)) == 0


async def test_queued_orphans_wait_for_an_instance_from_the_death_not_from_their_turn(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No instance comes back: every request fails with 503 once `dispatch_timeout_s` has passed
    since the death, the ones that queued behind the first too (not one timeout after another)."""
    monkeypatch.setattr(scheduler_module, "MAX_REDISPATCHING", 1)
    timeout_s = 0.25
    s = scheduler(bus, live=(), dispatch_timeout_s=timeout_s)
    request_ids = [f"r{i}" for i in range(12)]
    await place_on_dead_instance(s, request_ids)
    started = time.monotonic()
    await s._bury("w0")
    await settled(s)
    elapsed_s = time.monotonic() - started
    assert elapsed_s < len(request_ids) * timeout_s  # what one timeout after another takes at least
    entries: Any = await bus.client.xrange(bus.keys.outputs("g"))
    errors = [event for _, fields in entries for event in decode(fields[PAYLOAD_FIELD]).events()]  # type: ignore[union-attr]
    assert sorted(e.request_id for e in errors) == sorted(request_ids)
    assert {e.error.code for e in errors if e.error} == {503}
    assert all(isinstance(decode(f[PAYLOAD_FIELD]), OutputBatch) for _, f in entries)


async def test_the_registry_forgets_instances_that_are_gone(bus: Bus) -> None:
    """Each worker serve restarts has a new instance id: nothing of the old one may stay."""
    s = scheduler(bus, live=())
    info = InstanceInfo(instance_id="w0", role="mixed", model="m", max_model_len=512, free_kv_blocks=64)
    await bus.client.set(bus.keys.heartbeat("w0"), encode(info))
    await bus.client.sadd(bus.keys.instances, "w0")
    await s.registry.refresh(bus)
    s.registry.note_dispatch("w0")
    assert s.registry.in_flight == {"w0": 1}
    await bus.client.delete(bus.keys.heartbeat("w0"))
    await s.registry.refresh(bus)
    assert s.registry.dead == ["w0"]
    await s._bury("w0")
    await s.registry.refresh(bus)
    assert (s.registry.live, s.registry.dead, s.registry.in_flight) == ({}, [], {})
