"""The suffix-cache service against a real Redis: updates feed the index, look-ups read it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgpack

from services.runtime import bound_port, start_status_server
from services.suffix_cache.service import SuffixCacheService, SuffixCacheSettings
from shared.bus import Bus
from shared.protocol import PAYLOAD_FIELD, SuffixLookup, SuffixQuery, SuffixReply, SuffixUpdate

REPO_ROOT = Path(__file__).resolve().parents[3]


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


async def ask(
    bus: Bus,
    queries: list[tuple[list[int], int]],
    lookup_id: int = 1,
    sent_at: float | None = None,
    timeout_s: float = 1.0,
) -> SuffixReply | None:
    """Publishes one look-up as worker "w" and waits (at most `timeout_s`) for its reply."""
    lookup = SuffixLookup(
        lookup_id=lookup_id,
        instance_id="w",
        queries=[
            SuffixQuery(request_id=f"r{i}", context=c, max_spec_tokens=k) for i, (c, k) in enumerate(queries)
        ],
        sent_at=time.time() if sent_at is None else sent_at,
    )
    await bus.publish(bus.keys.suffix_lookups, lookup)
    stream, last_id = bus.keys.suffix_replies("w"), "0-0"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        deliveries, last_id = await bus.read_stream(stream, last_id, block_ms=100)
        for delivery in deliveries:
            if isinstance(delivery.message, SuffixReply) and delivery.message.lookup_id == lookup_id:
                return delivery.message
    return None


def sample(service: SuffixCacheService, name: str) -> float | None:
    return service.metrics.registry.get_sample_value(f"specmesh_suffix_cache_{name}")


async def update(bus: Bus, sequence_id: str, token_ids: list[int]) -> None:
    await bus.publish(bus.keys.suffix_updates, SuffixUpdate(sequence_id=sequence_id, token_ids=token_ids))


async def test_lookups_are_answered_from_the_sequences_updates_added(
    bus: Bus, service: SuffixCacheService
) -> None:
    await update(bus, "a", [1, 2, 3, 4, 5, 6])
    await update(bus, "b", [9, 9, 2, 3, 7])
    await wait_until(lambda: len(service.index) == 2)
    reply = await ask(bus, [([0, 1, 2, 3], 3), ([4, 5], 1), ([8, 8], 4), ([2, 3], 4)])
    assert reply is not None and reply.service_s > 0
    drafts = [(d.token_ids, d.score) for d in reply.drafts]
    assert drafts[0] == ([4, 5, 6], 3.0)
    assert drafts[1] == ([6], 1.0)
    assert drafts[2] == ([], 0.0)
    # (2 3) goes on with 4 or 7, half each (ties: the smaller id); a 2-token match drafts 2 tokens
    assert drafts[3] == ([4, 5], 1.0)


async def test_updates_are_idempotent(bus: Bus, service: SuffixCacheService) -> None:
    await update(bus, "a", [1, 2, 3, 4])
    await update(bus, "a", [1, 2, 8, 9])  # a redelivery or a resumed request: replaces the first
    await wait_until(lambda: sample(service, "updates_total") == 2)
    assert len(service.index) == 1
    assert service.index.speculate([1, 2], 2).token_ids == [8, 9]
    assert await bus.client.xinfo_groups(bus.keys.suffix_updates) == []  # read by every replica, no group


async def test_stale_lookups_are_dropped(bus: Bus, service: SuffixCacheService) -> None:
    await update(bus, "a", [1, 2, 3])
    await wait_until(lambda: len(service.index) == 1)
    assert await ask(bus, [([1, 2], 1)], lookup_id=7, sent_at=time.time() - 5.0, timeout_s=0.3) is None
    assert sample(service, "stale_lookups_total") == 1
    reply = await ask(bus, [([1, 2], 1)], lookup_id=8)
    assert reply is not None and reply.drafts[0].token_ids == [3]


async def test_malformed_messages_are_dead_lettered_and_the_service_keeps_serving(
    bus: Bus, service: SuffixCacheService
) -> None:
    lookups, updates = bus.keys.suffix_lookups, bus.keys.suffix_updates
    await bus.client.xadd(lookups, {PAYLOAD_FIELD: b"\xc1 not msgpack"})
    await bus.client.xadd(lookups, {b"other": b"field"})
    await bus.client.xadd(lookups, {PAYLOAD_FIELD: msgpack.packb({"version": 99, "kind": "suffix_lookup"})})
    await bus.client.xadd(lookups, {PAYLOAD_FIELD: msgpack.packb({"version": 1, "kind": "suffix_lookup"})})
    await bus.publish(lookups, SuffixUpdate(sequence_id="x", token_ids=[1]))  # valid, wrong stream
    await bus.client.xadd(updates, {PAYLOAD_FIELD: b"garbage"})
    await bus.publish(updates, SuffixLookup(lookup_id=1, instance_id="w", queries=[]))
    await update(bus, "a", [5, 6, 7])
    await wait_until(lambda: len(service.index) == 1)
    reply = await ask(bus, [([5, 6], 1)], lookup_id=3)
    assert reply is not None and reply.drafts[0].token_ids == [7]
    letters: Any = await bus.client.xrange(bus.keys.dead_letters)
    reasons = [(fields[b"stream"].decode(), fields[b"reason"].decode()) for _, fields in letters]
    assert len([r for s, r in reasons if s == lookups]) == 5
    assert len([r for s, r in reasons if s == updates]) == 2
    assert any("not msgpack" in r for _, r in reasons) and any("version 99" in r for _, r in reasons)
    assert any("expected a SuffixLookup, got 'suffix_update'" in r for _, r in reasons)


async def test_a_restarted_service_reindexes_the_newest_updates(
    bus: Bus, runner: Any, service_settings: SuffixCacheSettings
) -> None:
    first = await runner.start(service_settings)
    for i in range(5):
        await update(bus, f"r{i}", [i, 100 + i, 200 + i])
    await wait_until(lambda: len(first.index) == 5)
    await runner.stop(first)
    assert not await bus.client.exists(bus.keys.suffix_cache_heartbeat)
    assert await bus.client.xinfo_consumers(bus.keys.suffix_lookups, "suffix-cache") == []
    small = SuffixCacheSettings(
        redis=service_settings.redis, max_tree_depth=16, max_cached_requests=3, block_ms=50
    )
    second = await runner.start(small)
    await wait_until(lambda: len(second.index) == 3)
    assert [f"r{i}" in second.index for i in range(5)] == [False, False, True, True, True]
    reply = await ask(bus, [([3, 103], 2), ([0, 100], 2)])
    assert reply is not None and [d.token_ids for d in reply.drafts] == [[203], []]


async def test_health_and_metrics(bus: Bus, service: SuffixCacheService) -> None:
    await update(bus, "a", [1, 2, 3, 1, 2])
    await wait_until(lambda: len(service.index) == 1)
    assert await ask(bus, [([1, 2], 2), ([3], 1)]) is not None
    status = await start_status_server("127.0.0.1", 0, service.metrics.registry, service.health)
    base = f"http://127.0.0.1:{bound_port(status)}"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/health") as response:
                assert response.status == 200
                assert (await response.json())["status"] == "ok"
            async with http.get(f"{base}/metrics") as response:
                text = await response.text()
    finally:
        await status.cleanup()
    series = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    prefix = "specmesh_suffix_cache"
    assert float(series[f"{prefix}_lookups_total"]) == 1
    assert float(series[f"{prefix}_queries_total"]) == 2
    assert float(series[f"{prefix}_updates_total"]) == 1
    assert float(series[f"{prefix}_sequences"]) == 1
    assert float(series[f"{prefix}_tokens"]) == 5
    assert float(series[f"{prefix}_nodes"]) == service.index.tree.num_nodes > 0
    assert float(series[f"{prefix}_lookup_service_seconds_count"]) == 1


async def test_sigterm_drains_and_exits_cleanly(bus: Bus, redis_settings: Any) -> None:
    """The real command line: it serves, and SIGTERM ends it with status 0 and no heartbeat left."""
    code = (
        "import argparse, sys\n"
        "from services.suffix_cache.service import add_suffix_cache_parser\n"
        "parser = argparse.ArgumentParser()\n"
        "add_suffix_cache_parser(parser.add_subparsers())\n"
        "args = parser.parse_args(sys.argv[1:])\n"
        "sys.exit(args.handler(args))\n"
    )
    argv = ["suffix-cache", "--scheduler-port", str(redis_settings.port), "--scheduler-topic"]
    argv += [redis_settings.topic, "--metrics-port", "0", "--log-level", "WARNING", "--max-tree-depth", "8"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen([sys.executable, "-c", code, *argv], cwd=REPO_ROOT, env=env)
    try:
        deadline = time.monotonic() + 15
        while not await bus.client.exists(bus.keys.suffix_cache_heartbeat):
            assert process.poll() is None, "the service exited early"
            assert time.monotonic() < deadline, "the service never sent a heartbeat"
            await asyncio.sleep(0.05)
        await update(bus, "a", [1, 2, 3])
        # updates and look-ups are separate streams, read by separate tasks: a look-up may be
        # answered before an update sent ahead of it is indexed, so ask until it is
        drafts: list[list[int]] = []
        for lookup_id in range(1, 51):
            reply = await ask(bus, [([1, 2], 1)], lookup_id=lookup_id, timeout_s=5.0)
            assert reply is not None, "the service did not answer"
            drafts.append(reply.drafts[0].token_ids)
            if drafts[-1]:
                break
            await asyncio.sleep(0.1)
        assert drafts[-1] == [3], drafts
        process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(process.wait, 10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert not await bus.client.exists(bus.keys.suffix_cache_heartbeat)
