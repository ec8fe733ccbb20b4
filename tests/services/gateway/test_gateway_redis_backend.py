"""`RedisBackend` against a real redis-server: submissions, the one reader of the gateway's output
stream, timeouts, cancels, health, resuming after a dropped connection, and the gateway end to end
over Redis."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from gateway_fake_backend import sse_data

from services.gateway.app import GatewaySettings, create_app
from services.gateway.backend import HEALTH_EVERY_S, HEALTH_PROBE_TIMEOUT_S, RedisBackend, coalesce
from services.gateway.prepare import ServedModel
from shared.bus import Bus, RedisSettings, stop_tasks
from shared.protocol import (
    Cancel,
    ErrorInfo,
    GenerateRequest,
    OutputBatch,
    Submit,
    TokenEvent,
    TokenLogprob,
    encode,
)
from shared.sampling_params import SamplingParams


@pytest.fixture
async def backend(redis_settings: RedisSettings) -> AsyncIterator[RedisBackend]:
    backend = RedisBackend(redis_settings, request_timeout_s=5.0)
    await backend.start()
    yield backend
    await backend.close()


def generate_request(request_id: str, max_tokens: int = 8) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id, prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=max_tokens)
    )


def token_event(request_id: str, i: int, last: bool = False) -> TokenEvent:
    return TokenEvent(
        request_id=request_id,
        token_ids=[i],
        text=f"<{request_id}:{i}>",
        finished=last,
        finish_reason="stop" if last else None,
        num_output_tokens=i + 1,
    )


async def collect(events: AsyncIterator[TokenEvent]) -> list[TokenEvent]:
    return [event async for event in events]


async def publish(bus: Bus, gateway_id: str, *events: TokenEvent) -> None:
    """One batch of these events to the gateway's output stream, as a worker's step sends them."""
    await bus.publish_step([(gateway_id, encode(OutputBatch.of(list(events))))])


async def requests_on_bus(bus: Bus, count: int, timeout_s: float = 5.0) -> list[Any]:
    """The first `count` messages on the requests stream."""
    deadline = time.monotonic() + timeout_s
    messages: list[Any] = []
    while len(messages) < count:
        assert time.monotonic() < deadline, f"only {len(messages)} of {count} messages on the requests stream"
        deliveries, _ = await bus.read_stream(bus.keys.requests, "0-0", block_ms=50, count=10_000)
        messages = [d.message for d in deliveries]
    return messages


class FakeWorker:
    """Answers every Submit on the requests stream with `num_events` events, interleaving requests."""

    def __init__(
        self, bus: Bus, num_events: int, events: Callable[[str, int, bool], TokenEvent] = token_event
    ):
        self.bus = bus
        self.num_events = num_events
        self.events = events
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        last_id = "0-0"
        while True:
            deliveries, last_id = await self.bus.read_stream(self.bus.keys.requests, last_id, block_ms=50)
            submitted = [d.message.request for d in deliveries if isinstance(d.message, Submit)]
            gateways = {r.gateway_id for r in submitted}
            for i in range(self.num_events):
                last = i == self.num_events - 1
                for gateway in gateways:
                    ids = [r.request_id for r in submitted if r.gateway_id == gateway]
                    assert gateway is not None
                    await publish(self.bus, gateway, *(self.events(rid, i, last) for rid in ids))

    async def stop(self) -> None:
        """Cancels the worker, again if need be: redis-py can swallow a cancel (`stop_tasks`), and
        a test waiting on a task that carried on would hang instead of failing."""
        await stop_tasks([self.task])
        assert self.task.cancelled(), "the fake worker did not stop, or died of an error (logged)"


async def test_events_published_by_hand_reach_the_submitter_in_order(backend: RedisBackend, bus: Bus) -> None:
    events = asyncio.create_task(collect(backend.submit(generate_request("r1"))))
    [submit] = await requests_on_bus(bus, 1)
    assert isinstance(submit, Submit) and submit.request == generate_request("r1").model_copy(
        update={
            "arrival_time": submit.request.arrival_time,
            "gateway_id": backend.gateway_id,
            "gateway_incarnation": backend.incarnation,
        }
    )
    for i in range(5):
        await publish(bus, backend.gateway_id, token_event("r1", i, last=i == 4))
    received = await asyncio.wait_for(events, 5)
    assert "".join(e.text for e in received) == "".join(f"<r1:{i}>" for i in range(5))
    assert [t for e in received for t in e.token_ids] == list(range(5))
    assert received[-1].finished


async def test_a_gateway_holds_its_liveness_while_it_runs_and_drops_it_as_it_stops(
    redis_settings: RedisSettings, bus: Bus
) -> None:
    """The liveness (`Keys.gateway_liveness`) holds this process's incarnation, is renewed past its
    TTL, and is gone once the gateway closed; a restart under the same id holds another."""
    key = bus.keys.gateway_liveness("g")
    first = RedisBackend(redis_settings, gateway_id="g", liveness_ttl_s=1.5)
    await first.start()
    try:
        assert await bus.client.get(key) == first.incarnation.encode()
        await asyncio.sleep(3.0)  # twice the TTL: still held, so renewed
        assert await bus.client.get(key) == first.incarnation.encode()
        assert 0 < await bus.client.pttl(key) <= 1500
    finally:
        await first.close()
    assert await bus.client.get(key) is None
    second = RedisBackend(redis_settings, gateway_id="g", liveness_ttl_s=1.5)
    await second.start()
    try:
        assert second.incarnation != first.incarnation
        assert await bus.client.get(key) == second.incarnation.encode()
    finally:
        await second.close()


async def test_one_batch_reaches_each_of_its_requests(backend: RedisBackend, bus: Bus) -> None:
    """A step's outputs for 64 requests are one entry of the gateway's stream; each request gets
    its own row."""
    ids = [f"req-{i}" for i in range(64)]
    streams = [backend.submit(generate_request(rid)) for rid in ids]
    firsts = [asyncio.ensure_future(anext(stream)) for stream in streams]
    await requests_on_bus(bus, 64)
    await publish(bus, backend.gateway_id, *(token_event(rid, 0, last=True) for rid in ids))
    events = await asyncio.wait_for(asyncio.gather(*firsts), 5)
    assert [(e.request_id, e.text, e.finished) for e in events] == [(r, f"<{r}:0>", True) for r in ids]
    assert await bus.client.xlen(bus.keys.outputs(backend.gateway_id)) == 1
    for stream in streams:
        await stream.aclose()


async def test_64_concurrent_requests_each_get_their_own_events_in_order(
    backend: RedisBackend, bus: Bus
) -> None:
    worker = FakeWorker(bus, num_events=20)
    ids = [f"req-{i}" for i in range(64)]
    try:
        results = await asyncio.wait_for(
            asyncio.gather(*(collect(backend.submit(generate_request(rid))) for rid in ids)), 15
        )
    finally:
        await worker.stop()
    for rid, events in zip(ids, results):  # rows that queued up meanwhile come as one event
        assert {e.request_id for e in events} == {rid}
        assert "".join(e.text for e in events) == "".join(f"<{rid}:{i}>" for i in range(20))
        assert [t for e in events for t in e.token_ids] == list(range(20))
        assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]
    assert backend._follows == {}


async def test_a_request_that_fell_behind_takes_its_queued_rows_as_one_event(
    backend: RedisBackend, bus: Bus
) -> None:
    """Rows that came while the request was not reading are one event: one chunk for its client,
    whatever the number of steps it missed (the reader's work no longer grows with its lag)."""
    stream = backend.submit(generate_request("r"))
    first = asyncio.ensure_future(anext(stream))
    await requests_on_bus(bus, 1)
    await publish(bus, backend.gateway_id, token_event("r", 0))
    assert (await asyncio.wait_for(first, 5)).token_ids == [0]
    for i in range(1, 6):
        await publish(bus, backend.gateway_id, token_event("r", i, last=i == 5))
    deadline = time.monotonic() + 5
    while len(backend._follows["r"].rows) < 5 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    caught_up = await anext(stream)
    assert caught_up.token_ids == [1, 2, 3, 4, 5]
    assert caught_up.text == "".join(f"<r:{i}>" for i in range(1, 6))
    assert caught_up.finished and caught_up.finish_reason == "stop" and caught_up.num_output_tokens == 6
    await stream.aclose()
    assert backend._follows == {}


def test_coalesce_keeps_every_token_logprob_and_the_last_rows_end() -> None:
    prompt = [None, TokenLogprob(token_id=3, logprob=-1.0)]
    rows = [
        TokenEvent(
            "r",
            [1],
            "a",
            [TokenLogprob(token_id=1, logprob=-0.1)],
            num_output_tokens=1,
            prompt_logprobs=prompt,
        ),
        TokenEvent(
            "r",
            [2, 3],
            "bc",
            [TokenLogprob(token_id=2, logprob=-0.2), TokenLogprob(token_id=3, logprob=-0.3)],
            num_output_tokens=3,
        ),
        TokenEvent(
            "r",
            [4],
            "d",
            [TokenLogprob(token_id=4, logprob=-0.4)],
            True,
            "stop",
            "END",
            4,
            {"num_verify_steps": 3},
        ),
    ]
    [merged] = coalesce(rows)
    assert (merged.token_ids, merged.text, merged.num_output_tokens) == ([1, 2, 3, 4], "abcd", 4)
    assert [lp.token_id for lp in merged.logprobs] == [1, 2, 3, 4]
    assert merged.prompt_logprobs == prompt
    assert (merged.finished, merged.finish_reason, merged.stop_reason) == (True, "stop", "END")
    assert merged.spec_stats == {"num_verify_steps": 3}
    error = TokenEvent("r", finished=True, error=ErrorInfo(code=500, type="server_error", message="lost"))
    merged_rows = coalesce([*rows[:2], error])
    assert [e.text for e in merged_rows] == ["abc", ""] and merged_rows[1] is error
    assert coalesce(rows[:1]) == rows[:1] and coalesce([]) == []


async def test_a_new_request_hears_its_first_event_while_the_reader_blocks(
    redis_settings: RedisSettings, bus: Bus
) -> None:
    """The reader blocks on the gateway's stream for up to 3 s here; a request that starts
    meanwhile still hears its first event at once (every request's rows come on that stream)."""
    backend = RedisBackend(redis_settings, read_block_ms=3000)
    await backend.start()
    try:
        waiting = asyncio.create_task(collect(backend.submit(generate_request("slow"))))
        await requests_on_bus(bus, 1)
        await asyncio.sleep(0.2)  # the reader is now blocked
        started = time.monotonic()
        fast = backend.submit(generate_request("fast"))
        first = asyncio.ensure_future(anext(fast))
        await requests_on_bus(bus, 2)
        await publish(bus, backend.gateway_id, token_event("fast", 0, last=True))
        event = await asyncio.wait_for(first, 5)
        assert event.text == "<fast:0>"
        assert time.monotonic() - started < 1.0
        await publish(bus, backend.gateway_id, token_event("slow", 0, last=True))
        assert [e.text for e in await asyncio.wait_for(waiting, 5)] == ["<slow:0>"]
    finally:
        await backend.close()


async def test_reader_resumes_after_its_connection_is_killed(backend: RedisBackend, bus: Bus) -> None:
    events = asyncio.create_task(collect(backend.submit(generate_request("r"))))
    await requests_on_bus(bus, 1)
    for i in range(3):
        await publish(bus, backend.gateway_id, token_event("r", i))
    await asyncio.sleep(0.2)
    killed = await bus.client.client_kill_filter(_type="normal", skipme=True)
    assert killed >= 1
    for i in range(3, 6):
        await publish(bus, backend.gateway_id, token_event("r", i, last=i == 5))
    received = await asyncio.wait_for(events, 10)
    # rows that queued up while the request was not reading come as one event
    assert "".join(e.text for e in received) == "".join(f"<r:{i}>" for i in range(6))
    assert [t for e in received for t in e.token_ids] == list(range(6))
    assert received[-1].finished and received[-1].num_output_tokens == 6


async def test_silent_request_times_out_with_504_and_is_cancelled(
    redis_settings: RedisSettings, bus: Bus
) -> None:
    backend = RedisBackend(redis_settings, request_timeout_s=0.3)
    await backend.start()
    try:
        [event] = await asyncio.wait_for(collect(backend.submit(generate_request("quiet"))), 5)
    finally:
        await backend.close()
    assert event.finished and event.error is not None and event.error.code == 504
    submit, cancel = await requests_on_bus(bus, 2)
    assert isinstance(submit, Submit) and isinstance(cancel, Cancel)
    assert cancel.request_id == "quiet" and "timeout" in cancel.reason


async def test_cancel_publishes_on_the_requests_stream(backend: RedisBackend, bus: Bus) -> None:
    await backend.cancel("gone", reason="client disconnected")
    [cancel] = await requests_on_bus(bus, 1)
    assert cancel == Cancel(request_id="gone", reason="client disconnected")


async def test_health_needs_a_live_worker_heartbeat(backend: RedisBackend, bus: Bus) -> None:
    ok, reason = await backend.check_health()
    assert not ok and "no worker has registered" in reason
    await bus.client.sadd(bus.keys.instances, "w1")
    ok, reason = await backend.check_health()
    assert not ok and "expired" in reason
    await bus.client.set(bus.keys.heartbeat("w1"), b"x", ex=10)
    assert await backend.check_health() == (True, "1 live worker(s)")
    await asyncio.sleep(HEALTH_EVERY_S + 0.5)
    assert await backend.health() == (True, "1 live worker(s)")  # the background probe's answer


async def test_a_stopped_background_loop_is_unhealthy(backend: RedisBackend, bus: Bus) -> None:
    """A gateway whose liveness renewal died would have its requests aborted by the scheduler, and
    one whose probe died would answer a stale health: either is unhealthy, naming the loop."""
    await bus.client.sadd(bus.keys.instances, "w1")
    await bus.client.set(bus.keys.heartbeat("w1"), b"x", ex=10)
    backend._health = await backend.check_health()
    assert (await backend.health())[0]
    for task, what in ((backend._health_probe, "health probe"), (backend._liveness, "liveness renewal")):
        assert task is not None
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ok, reason = await backend.health()
        assert not ok and what in reason


async def test_redis_gone_is_unhealthy_and_503(redis_server: Callable[[], Any]) -> None:
    """Health says so within a probe's interval, and a submit is retried (briefly here), then 503."""
    server, settings = redis_server()
    backend = RedisBackend(settings, submit_retry_s=0.5)
    await backend.start()
    server.terminate()
    server.wait(timeout=10)
    try:
        await asyncio.sleep(HEALTH_EVERY_S + 0.5)
        ok, reason = await backend.health()
        assert not ok and "does not answer" in reason
        started = time.monotonic()
        [event] = await collect(backend.submit(generate_request("x")))
        assert 0.3 < time.monotonic() - started < 3
        assert event.error is not None and event.error.code == 503
        assert "cannot reach the request bus" in event.error.message
    finally:
        await backend.close()


async def test_health_answers_at_once_while_redis_hangs(redis_server: Callable[[], Any]) -> None:
    """A stopped (not dead) Redis never answers: /health must not wait for it."""
    server, settings = redis_server()
    backend = RedisBackend(settings)
    await backend.start()
    server.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        for _ in range(int((HEALTH_EVERY_S + HEALTH_PROBE_TIMEOUT_S) / 0.1) + 10):
            ok, reason = await backend.health()
            assert time.monotonic() - started < HEALTH_EVERY_S + HEALTH_PROBE_TIMEOUT_S + 2
            if "does not answer" in reason:
                break
            await asyncio.sleep(0.1)
        assert not ok and "does not answer" in reason
    finally:
        server.send_signal(signal.SIGCONT)
        await backend.close()


# ---- the gateway end to end over Redis -------------------------------------------------------------------


async def test_gateway_streams_over_redis_and_cancels_on_disconnect(
    served: ServedModel, redis_settings: RedisSettings, bus: Bus
) -> None:
    await bus.client.sadd(bus.keys.instances, "w1")
    await bus.client.set(bus.keys.heartbeat("w1"), b"x", ex=30)
    worker = FakeWorker(bus, num_events=4)
    app = create_app(served, RedisBackend(redis_settings), GatewaySettings())
    async with TestClient(TestServer(app)) as client:
        try:
            response = await client.post(
                "/v1/completions", json={"prompt": "x", "stream": True, "max_tokens": 4}
            )
            assert response.status == 200
            chunks = sse_data(await asyncio.wait_for(response.text(), 10))
            request_id = chunks[0]["id"]
            assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "".join(
                f"<{request_id}:{i}>" for i in range(4)
            )
        finally:
            await worker.stop()
        # No worker answers now: the client gives up mid-request, the gateway cancels in the mesh.
        async with aiohttp.ClientSession() as session:
            pending = asyncio.create_task(
                session.post(client.make_url("/v1/completions"), json={"prompt": "y"})
            )
            await requests_on_bus(bus, 2)
            pending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pending
        messages = await requests_on_bus(bus, 3)
        assert isinstance(messages[1], Submit) and isinstance(messages[2], Cancel)
        assert messages[2].request_id == messages[1].request.request_id
