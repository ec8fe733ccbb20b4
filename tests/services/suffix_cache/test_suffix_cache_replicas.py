"""Suffix-cache replicas: every replica indexes every update, any one answers a look-up, and the
deployment keeps answering when a replica stops or dies."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from services.engine.spec_decode.suffix_tree import GlobalSuffixIndex
from services.serve import free_port
from services.suffix_cache.service import SuffixCacheSettings
from shared.bus import Bus, RedisSettings
from tests.mesh.harness import metric_value
from tests.services.suffix_cache.test_suffix_cache_service import (
    REPO_ROOT,
    ask,
    sample,
    update,
    wait_until,
)

SEQUENCES = {f"s{i}": [i % 7, 50 + i, 100 + i % 5, 150 + i, i % 3] for i in range(24)}
QUERIES = [([i % 7, 50 + i], 3) for i in range(24)] + [([100 + i % 5], 2) for i in range(5)]


def replica(settings: SuffixCacheSettings, name: str, **changes: Any) -> SuffixCacheSettings:
    return dataclasses.replace(settings, consumer=name, **changes)


def one_index(settings: SuffixCacheSettings) -> GlobalSuffixIndex:
    """What a single replica holds after every sequence: the reference for drafts and acceptance."""
    index = GlobalSuffixIndex(
        settings.max_tree_depth,
        settings.max_cached_requests,
        settings.max_spec_factor,
        settings.min_token_prob,
    )
    for sequence_id, token_ids in SEQUENCES.items():
        index.add_sequence(sequence_id, token_ids)
    return index


async def test_every_replica_indexes_each_update_published_once_and_drafts_as_one_would(
    bus: Bus, runner: Any, service_settings: SuffixCacheSettings
) -> None:
    replicas = [await runner.start(replica(service_settings, name)) for name in ("r1", "r2")]
    for sequence_id, token_ids in SEQUENCES.items():
        await update(bus, sequence_id, token_ids)
    await wait_until(lambda: all(len(r.index) == len(SEQUENCES) for r in replicas))
    assert await bus.client.xinfo_groups(bus.keys.suffix_updates) == []  # nothing left behind in Redis
    expected = one_index(service_settings).speculate_batch(QUERIES)
    for lookup_id in range(1, 9):
        reply = await ask(bus, QUERIES, lookup_id=lookup_id)
        assert reply is not None, "no replica answered"
        assert [(d.token_ids, d.score) for d in reply.drafts] == [
            (e.token_ids, e.score) if e else ([], 0.0) for e in expected
        ]
    assert sum(sample(r, "lookups_total") or 0 for r in replicas) == 8  # each answered once


async def test_a_replica_stopping_leaves_the_heartbeat_another_renewed(
    bus: Bus, runner: Any, service_settings: SuffixCacheSettings
) -> None:
    slow = {"heartbeat_ttl_s": 60.0}  # no renewal during the test but the one made here
    first, second = [await runner.start(replica(service_settings, n, **slow)) for n in ("r1", "r2")]
    await first._beat()  # r1 wrote the heartbeat last
    await runner.stop(second)
    assert await bus.client.exists(bus.keys.suffix_cache_heartbeat), "r2 removed r1's heartbeat"
    await update(bus, "a", [1, 2, 3])
    await wait_until(lambda: len(first.index) == 1)
    reply = await ask(bus, [([1, 2], 1)])
    assert reply is not None and reply.drafts[0].token_ids == [3]
    await runner.stop(first)
    assert not await bus.client.exists(bus.keys.suffix_cache_heartbeat), "the last replica left it"


@pytest.fixture
def replica_processes(redis_settings: RedisSettings) -> Iterator[list[tuple[subprocess.Popen[bytes], int]]]:
    """Two `specmesh suffix-cache` processes on the test's topic, with their metrics ports."""
    started = []
    for _ in range(2):
        port = free_port()
        argv = [sys.executable, "-m", "services.cli", "suffix-cache", "--scheduler-port"]
        argv += [str(redis_settings.port), "--scheduler-topic", redis_settings.topic]
        argv += ["--metrics-port", str(port), "--log-level", "WARNING", "--max-tree-depth", "16"]
        started.append((subprocess.Popen(argv, cwd=REPO_ROOT, env=dict(os.environ)), port))
    yield started
    for process, _ in started:
        if process.poll() is None:
            process.kill()
        process.wait()


def status_page(port: int, path: str) -> str | None:
    """A replica's /health or /metrics page; None while it does not answer 200."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
            return str(response.read().decode())
    except OSError:
        return None


def indexed(port: int) -> float:
    """The replica's `sequences` gauge (0 until it answers)."""
    page = status_page(port, "/metrics")
    return 0.0 if page is None else metric_value(page, "specmesh_suffix_cache_sequences", default=0.0)


async def test_lookups_are_answered_after_a_replica_is_sigkilled(
    bus: Bus, replica_processes: list[tuple[subprocess.Popen[bytes], int]]
) -> None:
    deadline = time.monotonic() + 30
    while not all(status_page(port, "/health") is not None for _, port in replica_processes):
        assert all(p.poll() is None for p, _ in replica_processes), "a replica exited"
        assert time.monotonic() < deadline, "the replicas did not start"
        await asyncio.sleep(0.1)
    for sequence_id, token_ids in SEQUENCES.items():
        await update(bus, sequence_id, token_ids)
    while not all(indexed(port) == len(SEQUENCES) for _, port in replica_processes):
        assert time.monotonic() < deadline, [indexed(port) for _, port in replica_processes]
        await asyncio.sleep(0.1)
    killed = replica_processes[0][0]
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    await asyncio.sleep(0.5)  # Redis has seen its connections close
    expected = one_index(SuffixCacheSettings(max_tree_depth=16)).speculate_batch(QUERIES)
    for lookup_id in range(1, 21):
        reply = await ask(bus, QUERIES, lookup_id=lookup_id, timeout_s=5.0)
        assert reply is not None, f"look-up {lookup_id} was not answered after the kill"
        assert [d.token_ids for d in reply.drafts] == [e.token_ids if e else [] for e in expected]
