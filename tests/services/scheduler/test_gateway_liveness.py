"""Requests of a gateway that is gone, against a real Redis: those of a gateway incarnation that no
longer holds its liveness (expired, or replaced by a restart under the same id) are aborted, freeing
their slots, with a Cancel to their worker, an error on the gateway's stream and the metric counted;
those of live incarnations, and requests that name none, are kept."""

from __future__ import annotations

from typing import Any

from services.scheduler.scheduler import SplitwiseScheduler
from shared.bus import Bus
from shared.protocol import PAYLOAD_FIELD, Cancel, GenerateRequest, OutputBatch, decode
from shared.sampling_params import SamplingParams
from tests.services.scheduler.test_placement import scheduler


def request(request_id: str, gateway_id: str, incarnation: str | None) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        prompt_token_ids=[5, 6],
        params=SamplingParams(max_tokens=4),
        gateway_id=gateway_id,
        gateway_incarnation=incarnation,
    )


async def cancels_to(bus: Bus, instance_id: str) -> list[str]:
    entries: Any = await bus.client.xrange(bus.keys.inbox(instance_id))
    return [m.request_id for _, f in entries if isinstance(m := decode(f[PAYLOAD_FIELD]), Cancel)]


async def errors_to(bus: Bus, gateway_id: str) -> list[str]:
    entries: Any = await bus.client.xrange(bus.keys.outputs(gateway_id))
    batches = [decode(f[PAYLOAD_FIELD]) for _, f in entries]
    return [e.request_id for b in batches if isinstance(b, OutputBatch) for e in b.events() if e.error]


def orphans_aborted(s: SplitwiseScheduler) -> float:
    return s.metrics.registry.get_sample_value("specmesh_scheduler_orphans_aborted_total") or 0.0


async def test_requests_of_an_incarnation_without_liveness_are_aborted_and_no_others(bus: Bus) -> None:
    s = scheduler(bus)
    await bus.hold_lease(bus.keys.gateway_liveness("g"), 30, "g-second")  # g restarted: its 2nd life
    await bus.hold_lease(bus.keys.gateway_liveness("h"), 30, "h-first")
    requests = [
        request("of-g-first", "g", "g-first"),
        request("of-g-second", "g", "g-second"),
        request("of-h", "h", "h-first"),
        request("no-incarnation", "g", None),
    ]
    for r in requests:
        await s._admit(r)
    assert await bus.gateway_requests("g") == {"of-g-first": "g-first", "of-g-second": "g-second"}

    await s._abort_orphans()
    assert await bus.placement("of-g-first") is None
    assert all([await bus.placement(r.request_id) for r in requests[1:]])
    assert await cancels_to(bus, "w1") == ["of-g-first"]
    assert await bus.client.smembers(bus.keys.assignments("w1")) == {
        b"of-g-second",
        b"of-h",
        b"no-incarnation",
    }
    assert await errors_to(bus, "g") == ["of-g-first"]
    assert orphans_aborted(s) == 1
    assert await bus.gateway_requests("g") == {"of-g-second": "g-second"}

    await bus.client.delete(bus.keys.gateway_liveness("h"))  # h died: its liveness expired
    await s._abort_orphans()
    assert await bus.placement("of-h") is None and orphans_aborted(s) == 2
    assert await bus.client.smembers(bus.keys.gateways) == {b"g"}  # h has nothing left
    assert int(await bus.client.get(bus.keys.queue_depth)) == 2

    await s._abort_orphans()  # nothing more to abort
    assert orphans_aborted(s) == 2


async def test_a_finished_request_leaves_its_gateway_s_list(bus: Bus) -> None:
    s = scheduler(bus)
    await bus.hold_lease(bus.keys.gateway_liveness("g"), 30, "g-first")
    await s._admit(request("r", "g", "g-first"))
    await bus.release("r", "w1")
    assert await bus.gateway_requests("g") == {}
    assert await bus.forget_gateway("g")
    assert await bus.client.smembers(bus.keys.gateways) == set()
