"""A worker's emitter against a real Redis: a step's outputs for 64 requests reach their gateway
as ONE bus message, each request's delivered record holds what its gateway was sent, and the
scheduler hears every ended request in the same command; rows of a placement that is no longer
current reach nobody."""

from __future__ import annotations

from typing import Any

import numpy as np

from services.worker.core_messages import EngineInfo, EngineLoad, RowEnd, StepBatch
from services.worker.metrics import WorkerMetrics
from services.worker.worker import Running, Worker, WorkerOptions
from shared.bus import OUTPUT_TTL_S, RECORD_TTL_RENEW_S, Bus
from shared.protocol import (
    PAYLOAD_FIELD,
    TOKEN_DTYPE,
    Finished,
    GenerateRequest,
    OutputBatch,
    Submit,
    decode,
)
from shared.sampling_params import SamplingParams


class IdleCore:
    """Stands in for the engine core: the emitter reads its info and load, and aborts requests."""

    info = EngineInfo(max_model_len=512, total_kv_blocks=64, block_size=16)
    load = EngineLoad()

    def __init__(self) -> None:
        self.aborted: list[tuple[str, bool]] = []

    async def abort(self, request_id: str, emit: bool = True) -> None:
        self.aborted.append((request_id, emit))


def worker(bus: Bus) -> Worker:
    options = WorkerOptions(instance_id="w", role="mixed", model_name="m", ttl_s=5.0)
    return Worker(IdleCore(), bus, options, WorkerMetrics("w", "mixed"))  # type: ignore[arg-type]


def admit(w: Worker, request_id: str, gateway_id: str, epoch: int = 1) -> None:
    request = GenerateRequest(
        request_id=request_id, prompt_token_ids=[1], params=SamplingParams(), gateway_id=gateway_id
    )
    w.requests[request_id] = Running(request, epoch)


def one_token_step(
    request_ids: list[str], step: int, ends: list[RowEnd] | None = None, epochs: list[int] | None = None
) -> StepBatch:
    n = len(request_ids)
    return StepBatch(
        request_ids=request_ids,
        cu_num_tokens=np.arange(n + 1, dtype=TOKEN_DTYPE),
        token_ids=np.arange(n, dtype=TOKEN_DTYPE) + 1000 * step,
        texts=["x"] * n,
        num_output_tokens=np.full(n, step + 1, TOKEN_DTYPE),
        epochs=epochs or [1] * n,
        ends=ends or [],
        logprobs=[],
        handoffs=[],
        step_s=[0.01],
        load=EngineLoad(),
    )


async def batches_on(bus: Bus, gateway_id: str) -> list[OutputBatch]:
    entries: Any = await bus.client.xrange(bus.keys.outputs(gateway_id))
    batches = [decode(fields[PAYLOAD_FIELD]) for _, fields in entries]
    assert all(isinstance(b, OutputBatch) for b in batches)
    return batches  # type: ignore[return-value]


async def test_a_step_of_64_requests_is_one_message_to_their_gateway(bus: Bus) -> None:
    w = worker(bus)
    ids = [f"r{i}" for i in range(64)]
    for request_id in ids:
        admit(w, request_id, "g1")
    for step in range(3):
        ends = [RowEnd(row=i, finish_reason="length") for i in range(64)] if step == 2 else None
        batch = one_token_step(ids, step, ends)
        await w._publish(batch)
        w._retire(batch)
    [first, second, last] = await batches_on(bus, "g1")
    assert first.request_ids == ids and len(first.events()) == 64
    assert [e.token_ids for e in second.events()] == [[1000 + i] for i in range(64)]
    assert all(e.finished and e.finish_reason == "length" for e in last.events())
    assert await bus.delivered_tokens("r5") == ([5, 1005, 2005], True)
    reports = [decode(f[PAYLOAD_FIELD]) for _, f in await bus.client.xrange(bus.keys.scheduler_replies)]
    assert sorted(r.request_id for r in reports if isinstance(r, Finished) and r.outcome == "done") == sorted(
        ids
    )
    assert w.requests == {}


async def test_rows_go_to_each_request_s_own_gateway(bus: Bus) -> None:
    w = worker(bus)
    for i in range(6):
        admit(w, f"r{i}", f"g{i % 2}")
    await w._publish(one_token_step([f"r{i}" for i in range(6)], 0))
    for gateway, expected in (("g0", ["r0", "r2", "r4"]), ("g1", ["r1", "r3", "r5"])):
        [batch] = await batches_on(bus, gateway)
        assert [(e.request_id, e.token_ids) for e in batch.events()] == [(r, [int(r[1:])]) for r in expected]


async def test_a_handed_off_request_is_not_reported_done(bus: Bus) -> None:
    w = worker(bus)
    admit(w, "p", "g")
    await w._publish(one_token_step(["p"], 0, [RowEnd(row=0, handoff=True)]))
    [batch] = await batches_on(bus, "g")
    assert not batch.events()[0].finished
    assert await bus.delivered_tokens("p") == ([0], False)
    assert await bus.client.xlen(bus.keys.scheduler_replies) == 0


async def place(bus: Bus, request_id: str, times: int = 1) -> None:
    """Admits the request and places it `times` times (epochs 1 .. times), as the scheduler does."""
    request = GenerateRequest(request_id=request_id, prompt_token_ids=[1], params=SamplingParams())
    await bus.admit(request_id, Submit(request=request), max_queue_len=64)
    for _ in range(times):
        await bus.claim_epoch(request_id)


async def test_a_fenced_request_stops_here_silently_and_the_others_go_out(bus: Bus) -> None:
    """ "a" was placed elsewhere while this worker was taken for dead: its row is refused, it stops
    here without a report or an error row, and "b"'s row of the same step is published."""
    w = worker(bus)
    await place(bus, "a", times=2)
    await place(bus, "b")
    admit(w, "a", "g")
    admit(w, "b", "g")
    batch = one_token_step(["a", "b"], 0, [RowEnd(row=0, finish_reason="length")])
    await w._publish(batch)
    w._retire(batch)
    [published] = await batches_on(bus, "g")
    assert [e.request_id for e in published.events()] == ["b"]
    assert await bus.delivered_tokens("a") == ([], False)
    assert await bus.delivered_tokens("b") == ([1], False)
    assert await bus.client.xlen(bus.keys.scheduler_replies) == 0
    assert list(w.requests) == ["b"]
    assert w.core.aborted == [("a", False)]  # type: ignore[attr-defined]


async def test_rows_of_an_earlier_placement_here_are_left_out(bus: Bus) -> None:
    """The request was placed here again (epoch 2) while rows stepped for epoch 1 were in flight:
    only the epoch-2 row is published, and the epoch-1 end does not retire the request."""
    w = worker(bus)
    await place(bus, "a", times=2)
    admit(w, "a", "g", epoch=2)
    batch = one_token_step(["a", "a"], 0, [RowEnd(row=0, finish_reason="length")], epochs=[1, 2])
    await w._publish(batch)
    w._retire(batch)
    [published] = await batches_on(bus, "g")
    assert [(e.request_id, e.token_ids, e.finished) for e in published.events()] == [("a", [1], False)]
    assert list(w.requests) == ["a"]


async def test_a_cancelled_request_s_fenced_rows_go_nowhere_until_its_end_retires_it(bus: Bus) -> None:
    """The scheduler ended the cancelled request at once: its rows are refused, it stays (sending
    nothing) until the abort's end row, which retires it."""
    w = worker(bus)
    await place(bus, "a")
    admit(w, "a", "g")
    w.requests["a"].cancelled = True
    await bus.release("a")
    await w._publish(one_token_step(["a"], 0))
    assert w.requests["a"].fenced
    last = one_token_step(["a"], 1, [RowEnd(row=0, finish_reason="abort")])
    await w._publish(last)
    w._retire(last)
    assert w.requests == {}
    assert not await bus.client.exists(bus.keys.outputs("g"), bus.keys.scheduler_replies)
    assert w.core.aborted == []  # type: ignore[attr-defined]  # the abort was the cancel's, not the fence's


async def test_a_running_request_s_record_ttl_is_renewed_once_a_period_not_every_step(bus: Bus) -> None:
    w = worker(bus)
    admit(w, "a", "g")
    key = bus.keys.delivered("a")
    await w._publish(one_token_step(["a"], 0))
    assert 0 < await bus.client.ttl(key) <= OUTPUT_TTL_S
    await bus.client.expire(key, 100)
    await w._publish(one_token_step(["a"], 1))
    assert 0 < await bus.client.ttl(key) <= 100
    w.requests["a"].record_renewed_at -= RECORD_TTL_RENEW_S  # a period has passed
    await w._publish(one_token_step(["a"], 2))
    assert 100 < await bus.client.ttl(key) <= OUTPUT_TTL_S
    assert await bus.delivered_tokens("a") == ([0, 1000, 2000], False)
