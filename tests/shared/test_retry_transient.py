"""`retry_transient`: transient Redis errors are retried with backoff up to a deadline; anything
else, and a cancellation, goes through at once."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from shared.bus import retry_transient


class Flaky:
    """Fails with `error` the first `failures` calls, then answers "ok"."""

    def __init__(self, failures: int, error: Exception):
        self.failures = failures
        self.error = error
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "ok"


async def test_transient_errors_are_retried_until_the_call_succeeds() -> None:
    op = Flaky(3, RedisConnectionError("refused"))
    assert await retry_transient(op, "test", deadline_s=5.0) == "ok"
    assert op.calls == 4


async def test_past_the_deadline_the_last_error_is_raised() -> None:
    op = Flaky(1000, RedisConnectionError("refused"))
    started = time.monotonic()
    with pytest.raises(RedisConnectionError):
        await retry_transient(op, "test", deadline_s=0.5)
    assert time.monotonic() - started <= 0.6 and op.calls >= 3


async def test_other_errors_are_not_retried() -> None:
    op = Flaky(1, ResponseError("WRONGTYPE"))
    with pytest.raises(ResponseError):
        await retry_transient(op, "test", deadline_s=5.0)
    assert op.calls == 1


async def test_without_a_deadline_it_retries_until_cancelled() -> None:
    op = Flaky(10**9, RedisConnectionError("refused"))
    task = asyncio.create_task(retry_transient(op, "test", deadline_s=None))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert op.calls >= 3
