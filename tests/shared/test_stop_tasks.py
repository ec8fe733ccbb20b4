"""`stop_tasks`: a shutdown ends its background tasks even when a cancel is lost, and never hangs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest

from shared.bus import stop_tasks, until_stopped_or_dead


async def test_a_task_that_swallowed_its_cancel_is_cancelled_again() -> None:
    """What redis-py's retry does to a cancel that came out as a TimeoutError: the command is
    retried, the task goes back to waiting on its queue as if it had never been cancelled."""
    queue: asyncio.Queue[int] = asyncio.Queue()

    async def command_then_queue() -> None:
        with contextlib.suppress(asyncio.CancelledError):  # retried: the cancel is lost
            await asyncio.sleep(10)  # the Redis command the cancel lands in
        await queue.get()

    task = asyncio.create_task(command_then_queue())
    await asyncio.sleep(0.01)
    task.cancel()  # what the old shutdown did: one cancel, then wait for ever
    done, _ = await asyncio.wait({task}, timeout=0.3)
    assert not done  # the lost cancel: one cancel does not end it

    started = time.monotonic()
    await stop_tasks([task], timeout_s=5)
    assert task.cancelled()
    assert time.monotonic() - started < 2


async def test_a_task_that_never_ends_is_given_up_on_and_named(caplog: pytest.LogCaptureFixture) -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                continue

    task = asyncio.create_task(stubborn(), name="stubborn-loop")
    await asyncio.sleep(0.01)
    started = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="shared.bus"):
        await stop_tasks([task], timeout_s=0.3)
    assert 0.25 < time.monotonic() - started < 2
    assert "stubborn-loop" in caplog.text
    assert not task.done()
    release.set()
    await task


async def test_failures_of_stopped_tasks_are_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    async def broken() -> None:
        raise RuntimeError("the loop died earlier")

    async def idle() -> None:
        await asyncio.sleep(10)

    tasks = [asyncio.create_task(broken(), name="broken"), asyncio.create_task(idle(), name="idle")]
    await asyncio.sleep(0.01)
    with caplog.at_level(logging.ERROR, logger="shared.bus"):
        await stop_tasks(tasks)
    assert tasks[1].cancelled()
    assert "broken" in caplog.text and "the loop died earlier" in caplog.text


async def test_until_stopped_or_dead_names_the_loop_that_died_and_nothing_once_stopped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A process's loop that ends while the process is not stopping is returned (and logged with
    what it died of), so that the process exits for its supervisor instead of running on without
    it; once `stop` is set, nothing is."""

    async def dies() -> None:
        await asyncio.sleep(0.01)
        raise RuntimeError("the handler is closed")

    stop = asyncio.Event()
    forever = asyncio.create_task(asyncio.sleep(60), name="forever")
    dying = asyncio.create_task(dies(), name="requests")
    with caplog.at_level(logging.ERROR, logger="shared.bus"):
        assert await asyncio.wait_for(until_stopped_or_dead(stop, [forever, dying]), 5) is dying
    assert "requests ended (RuntimeError('the handler is closed'))" in caplog.text
    stop.set()
    assert await asyncio.wait_for(until_stopped_or_dead(stop, [forever]), 5) is None
    await stop_tasks([forever])
