"""A running suffix-cache service for its tests (the redis-server, key namespace and bus fixtures are
in tests/conftest.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.suffix_cache.service import SuffixCacheService, SuffixCacheSettings
from shared.bus import Bus, RedisSettings, connect


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
