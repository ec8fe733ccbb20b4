"""`Bus.read_group`: a dead consumer's pending messages are taken over; a deleted stream and
group are made again instead of failing every read."""

from __future__ import annotations

from shared.bus import Bus, as_text
from shared.protocol import Cancel


async def test_a_dead_consumer_s_pending_message_is_taken_over(bus: Bus) -> None:
    stream = bus.keys.inbox("w")
    await bus.ensure_group(stream, "g")
    for request_id in ("a", "b"):
        await bus.publish(stream, Cancel(request_id=request_id))
        [delivery] = await bus.read_group(stream, "g", "dead", count=1, block_ms=10)
        if request_id == "a":
            [taken] = await bus.read_group(stream, "g", "alive", block_ms=10, claim_idle_ms=0)
            assert taken.entry_id == delivery.entry_id and taken.message == Cancel(request_id="a")
            await bus.ack(stream, "g", taken.entry_id)
    assert await bus.read_group(stream, "g", "alive", block_ms=10, claim_idle_ms=0) == []  # looked just now
    bus._claimed_at.clear()  # as if CLAIM_EVERY_S had passed
    [taken] = await bus.read_group(stream, "g", "alive", block_ms=10, claim_idle_ms=0)
    assert taken.message == Cancel(request_id="b")


async def test_a_deleted_stream_gets_its_group_back(bus: Bus) -> None:
    stream = bus.keys.inbox("w")
    await bus.ensure_group(stream, "g")
    assert await bus.read_group(stream, "g", "c", block_ms=10) == []
    await bus.client.delete(stream)  # Redis restarted without persistence
    assert await bus.read_group(stream, "g", "c", block_ms=10) == []
    await bus.publish(stream, Cancel(request_id="r"))
    [delivery] = await bus.read_group(stream, "g", "c", block_ms=10)
    assert delivery.message == Cancel(request_id="r")


async def test_a_consumer_reads_what_it_failed_to_handle_again_first(bus: Bus) -> None:
    """Messages a consumer read but could not handle (a Redis outage) come back on its next read
    once it says so, not after `claim_idle_ms`; then reads go on with new messages."""
    stream = bus.keys.inbox("w")
    await bus.ensure_group(stream, "g")
    await bus.publish(stream, Cancel(request_id="a"))
    [failed] = await bus.read_group(stream, "g", "c", block_ms=10)
    await bus.publish(stream, Cancel(request_id="b"))
    bus.reread_pending(stream, "g", "c")
    [again] = await bus.read_group(stream, "g", "c", block_ms=10, claim_idle_ms=60_000)
    assert again.entry_id == failed.entry_id and again.message == Cancel(request_id="a")
    await bus.ack(stream, "g", again.entry_id)
    [new] = await bus.read_group(stream, "g", "c", block_ms=10, claim_idle_ms=60_000)
    assert new.message == Cancel(request_id="b")


async def test_a_consumer_whose_lease_is_gone_is_taken_over_at_once(bus: Bus) -> None:
    """Scheduler replicas hold leases: a message pending with a replica whose lease is gone (a
    restarted scheduler's predecessor) is taken over on the next read, not after `claim_idle_ms`;
    one pending with a replica that still holds its lease stays with it."""
    stream, lease = bus.keys.requests, bus.keys.scheduler_lease
    await bus.ensure_group(stream, "g")
    for consumer, request_id in (("dead", "a"), ("alive", "b")):
        await bus.hold_lease(lease(consumer), ttl_s=60)
        await bus.publish(stream, Cancel(request_id=request_id))
        await bus.read_group(stream, "g", consumer, count=1, block_ms=10, lease_prefix=lease(""))
    await bus.forget_scheduler("dead")
    await bus.hold_lease(lease("new"), ttl_s=60)
    [taken] = await bus.read_group(
        stream, "g", "new", block_ms=10, claim_idle_ms=60_000, lease_prefix=lease("")
    )
    assert taken.message == Cancel(request_id="a")
    pending = {as_text(c["name"]): c["pending"] for c in await bus.client.xinfo_consumers(stream, "g")}
    assert (pending["alive"], pending["new"], pending.get("dead", 0)) == (1, 1, 0)


async def test_a_stream_holds_only_what_is_unacknowledged(bus: Bus) -> None:
    """A long-running mesh's `requests`, `scheduler-replies` and inboxes must not grow with every
    message ever sent: an acknowledged entry leaves the stream; a pending one stays, and is still
    taken over."""
    stream = bus.keys.requests
    await bus.ensure_group(stream, "g")
    for request_id in ("a", "b", "c"):
        await bus.publish(stream, Cancel(request_id=request_id))
    deliveries = await bus.read_group(stream, "g", "c1", block_ms=10)
    await bus.ack(stream, "g", *(d.entry_id for d in deliveries[:2]))
    assert await bus.client.xlen(stream) == 1
    [taken] = await bus.read_group(stream, "g", "c2", block_ms=10, claim_idle_ms=0)
    assert taken.message == Cancel(request_id="c")
    await bus.ack(stream, "g", taken.entry_id)
    assert await bus.client.xlen(stream) == 0
