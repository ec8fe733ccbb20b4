"""A real redis-server for the suffix-cache tests, a fresh key namespace per test, a running service."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis

from services.suffix_cache.service import SuffixCacheService, SuffixCacheSettings
from shared.bus import Bus, RedisSettings, connect


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def redis_port() -> Iterator[int]:
    """A throwaway redis-server on a free loopback port, without persistence."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    port = _free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    probe = redis.Redis(port=port)
    try:
        for _ in range(100):
            try:
                probe.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        else:
            pytest.fail(f"redis-server did not start on port {port}")
        yield port
    finally:
        probe.close()
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture
def redis_settings(redis_port: int) -> RedisSettings:
    """Each test its own topic: no keys shared between tests."""
    return RedisSettings(port=redis_port, topic=f"t{uuid.uuid4().hex[:12]}")


@pytest.fixture
async def bus(redis_settings: RedisSettings) -> AsyncIterator[Bus]:
    client = await connect(redis_settings)
    yield Bus(client, redis_settings.keys)
    await client.aclose()


@pytest.fixture
def service_settings(redis_settings: RedisSettings) -> SuffixCacheSettings:
    return SuffixCacheSettings(redis=redis_settings, max_tree_depth=16, max_cached_requests=100, block_ms=50)


class ServiceRunner:
    """Runs services as tasks of the test's loop, each on its own connection; stops them all at the end."""

    def __init__(self) -> None:
        self.tasks: dict[SuffixCacheService, asyncio.Task[None]] = {}

    async def start(self, settings: SuffixCacheSettings) -> SuffixCacheService:
        service = SuffixCacheService(Bus(await connect(settings.redis), settings.redis.keys), settings)
        self.tasks[service] = asyncio.create_task(service.run())
        while not service.serving:
            await asyncio.sleep(0.005)
        return service

    async def stop(self, service: SuffixCacheService) -> None:
        service.stop.set()
        await asyncio.wait_for(self.tasks.pop(service), timeout=5)
        await service.bus.client.aclose()


@pytest.fixture
async def runner() -> AsyncIterator[ServiceRunner]:
    services = ServiceRunner()
    yield services
    for service in list(services.tasks):
        await services.stop(service)


@pytest.fixture
async def service(runner: ServiceRunner, service_settings: SuffixCacheSettings) -> SuffixCacheService:
    return await runner.start(service_settings)
