"""A scheduler whose loop dies stops with an error (its supervisor starts it again) instead of
running on as a zombie: alive, its lease renewed, while no request is read any more."""

from __future__ import annotations

import asyncio

import pytest

from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.scheduler import SchedulerOptions, SplitwiseScheduler
from shared.bus import Bus, LoopDied


async def test_a_dead_request_loop_stops_the_scheduler_with_an_error(bus: Bus) -> None:
    scheduler = SplitwiseScheduler(bus, SchedulerOptions(consumer="s1"), SchedulerMetrics())
    consume = scheduler._consume

    async def requests_loop_dies(stream: str, stop: asyncio.Event) -> None:
        if stream == bus.keys.requests:
            await asyncio.sleep(0.05)
            raise RuntimeError(
                "unable to perform operation on <TCPTransport closed=True>; the handler is closed"
            )
        await consume(stream, stop)

    scheduler._consume = requests_loop_dies  # type: ignore[method-assign]
    with pytest.raises(LoopDied, match="requests loop died"):
        await asyncio.wait_for(scheduler.run(asyncio.Event()), 20)
    assert await bus.client.exists(bus.keys.scheduler_lease("s1")) == 0  # its pending work goes to others
