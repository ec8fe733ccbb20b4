"""Decode workers sharing the suffix-cache service through `RemoteSuffixIndex`.

Each proposer stands for one decode worker: its engine thread is `asyncio.to_thread`, its loop
the test's loop. The deadline is what a look-up may cost an engine step at most.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from services.engine.spec_decode.suffix import SuffixConfig, SuffixProposer
from services.suffix_cache.client import RemoteSuffixIndex
from services.suffix_cache.service import SuffixCacheService, SuffixCacheSettings
from shared.bus import Bus

Connect = Callable[..., Awaitable[RemoteSuffixIndex]]
GENEROUS_DEADLINE_S = 0.5
"""For tests of what is answered, not how fast: two shared cores can stall a round trip."""


@pytest.fixture
async def remote(bus: Bus) -> AsyncIterator[Connect]:
    """Makes started `RemoteSuffixIndex`es on the test's loop; closes them at the end."""
    made: list[RemoteSuffixIndex] = []

    async def make(instance_id: str, deadline_s: float = GENEROUS_DEADLINE_S) -> RemoteSuffixIndex:
        index = RemoteSuffixIndex(
            asyncio.get_running_loop(), bus, instance_id, deadline_s, heartbeat_poll_s=0.05
        )
        await index.start()
        made.append(index)
        return index

    yield make
    for index in made:
        await index.close()


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


async def test_a_sequence_finished_on_one_worker_is_drafted_on_another(
    service: SuffixCacheService, remote: Connect
) -> None:
    config = SuffixConfig(max_tree_depth=16)
    index_b = await remote("decode-b")
    worker_a = SuffixProposer(config, await remote("decode-a"))
    worker_b = SuffixProposer(config, index_b)
    output = [7, 8, 9, 10, 11, 12]
    worker_a.start_request("first", [100, 101])
    worker_a.add_tokens("first", output)
    worker_a.stop_request("first")  # the output goes to the service, not to worker_a's memory
    await wait_until(lambda: "first" in service.index)

    worker_b.start_request("second", [50, 7, 8, 9])
    drafts = await asyncio.to_thread(worker_b.propose_batch, [("second", [50, 7, 8, 9], 5)])
    assert drafts == [[10, 11, 12]]
    alone = SuffixProposer(SuffixConfig(max_tree_depth=16, max_cached_requests=0))
    alone.start_request("second", [50, 7, 8, 9])
    assert alone.propose_one("second", [50, 7, 8, 9], 5) == []  # so the draft did come from worker_a
    assert index_b.num_answered == 1


async def test_a_stalled_service_costs_a_step_at_most_the_deadline(bus: Bus, remote: Connect) -> None:
    """The heartbeat says up but nothing answers: each look-up gives up at its deadline, and the
    proposer drafts from the request's own tree."""
    await bus.client.set(bus.keys.suffix_cache_heartbeat, "stalled", ex=30)
    deadline_s, slack_s = 0.005, 0.010
    index = await remote("decode-a", deadline_s=deadline_s)
    proposer = SuffixProposer(SuffixConfig(), index)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    proposer.start_request("r", prompt)

    def timed_steps() -> list[tuple[float, list[list[int]]]]:
        steps = []
        for _ in range(20):
            started = time.perf_counter()
            drafts = proposer.propose_batch([("r", prompt, 4)])
            steps.append((time.perf_counter() - started, drafts))
        return steps

    steps = await asyncio.to_thread(timed_steps)
    assert all(drafts == [[4, 5, 1]] for _, drafts in steps)  # from the per-request tree
    elapsed = sorted(s for s, _ in steps)
    assert elapsed[0] >= deadline_s * 0.9  # it did wait for the service
    assert elapsed[len(elapsed) // 2] < deadline_s + slack_s
    assert elapsed[-1] < deadline_s + 5 * slack_s  # a loaded shared machine may deschedule one
    assert (index.num_late, index.num_answered, index.num_skipped) == (20, 0, 0)


async def test_an_absent_service_is_not_asked(bus: Bus, remote: Connect) -> None:
    index = await remote("decode-a")
    assert not index.service_up
    started = time.perf_counter()
    assert await asyncio.to_thread(index.speculate_batch, [([1, 2], 3), ([3], 1)]) == [None, None]
    assert time.perf_counter() - started < GENEROUS_DEADLINE_S / 2
    assert index.num_skipped == 1
    assert not await bus.client.exists(bus.keys.suffix_lookups)  # nothing was sent


async def test_the_client_follows_the_service_going_up_and_down(
    runner: Any, service_settings: SuffixCacheSettings, remote: Connect
) -> None:
    index = await remote("decode-a")
    assert not index.service_up
    service = await runner.start(service_settings)
    await wait_until(lambda: index.service_up)
    await runner.stop(service)
    await wait_until(lambda: not index.service_up)


async def test_late_replies_are_discarded(service: SuffixCacheService, remote: Connect) -> None:
    index = await remote("decode-a", deadline_s=1e-6)
    assert await asyncio.to_thread(index.speculate_batch, [([1], 1)]) == [None]
    assert index.num_late == 1
    await wait_until(lambda: index.num_late_replies == 1)  # the answer came, to nobody
    assert not index._pending


async def test_lookup_round_trip_latency(
    service: SuffixCacheService, remote: Connect, capsys: pytest.CaptureFixture[str]
) -> None:
    """200 batched look-ups of 32 queries: round trip from the engine thread and back."""
    rng = random.Random(0)
    for i in range(200):
        service.index.add_sequence(f"s{i}", [rng.randrange(64) for _ in range(200)])
    contexts = [[rng.randrange(64) for _ in range(16)] for _ in range(32)]
    queries = [(context, 8) for context in contexts]
    generous = await remote("decode-a")
    tight = await remote("decode-b", deadline_s=0.002)

    def look_up(index: RemoteSuffixIndex, n: int) -> None:
        for _ in range(n):
            index.speculate_batch(queries)

    await asyncio.to_thread(look_up, generous, 20)  # warm up: connections, caches
    generous._round_trips_s.clear()
    generous.num_answered = 0
    await asyncio.to_thread(look_up, generous, 200)
    await asyncio.to_thread(look_up, tight, 200)
    histogram = "specmesh_suffix_cache_lookup_service_seconds"
    service_s_sum = service.metrics.registry.get_sample_value(f"{histogram}_sum") or 0.0
    service_s_count = service.metrics.registry.get_sample_value(f"{histogram}_count") or 1.0
    p50_s, p99_s = generous.round_trip_p50_s or 0.0, generous.round_trip_p99_s or 0.0
    with capsys.disabled():
        print(
            f"\nsuffix-cache look-up of 32 queries, 200 times: round trip p50 {p50_s * 1e3:.2f} ms, "
            f"p99 {p99_s * 1e3:.2f} ms (service time mean {service_s_sum / service_s_count * 1e3:.3f} ms); "
            f"answered within a 2 ms deadline: {tight.num_answered}/200"
        )
    assert generous.num_answered == 200 and generous.num_late == 0
    assert tight.num_answered + tight.num_late == 200


async def test_closing_stops_the_reply_reader_even_if_redis_turns_the_cancel_into_an_error() -> None:
    """A cancel that reaches redis-py as its socket timeout fires comes out as a Redis TimeoutError;
    the reader must still stop (it retried such errors forever, and `close()` hung)."""
    from redis.exceptions import TimeoutError as RedisTimeoutError

    from shared.keys import Keys

    class CancelAsTimeout:
        async def xread(self, *args: Any, **kwargs: Any) -> Any:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                raise RedisTimeoutError("Timeout reading from socket") from None

    bus = Bus(CancelAsTimeout(), Keys("test"))  # type: ignore[arg-type]
    index = RemoteSuffixIndex(asyncio.get_running_loop(), bus, "a")
    reader = asyncio.create_task(index._follow_replies())
    await asyncio.sleep(0.05)
    reader.cancel()
    done, _ = await asyncio.wait({reader}, timeout=2)
    assert reader in done and reader.cancelled()
