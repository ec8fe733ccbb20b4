"""The engine's own thread: it alone touches the engine, stepping whenever there is work.

The worker's asyncio loop talks to it two ways: `call(fn)` runs `fn(engine)` between two steps and
returns its result as an awaitable; every step's outputs (and prefill handoffs) come back through
`on_step`, called on the loop. A step never waits for Redis, and Redis I/O never waits for a step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from services.engine.engine import KVExport, LLMEngine, RequestOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")
IDLE_WAIT_S = 0.05


@dataclass
class StepResult:
    outputs: list[RequestOutput]
    handoffs: list[KVExport]
    step_s: float
    failed: list[tuple[str, str]] = field(default_factory=list)
    """(request id, error) of requests aborted because a step raised."""


@dataclass
class EngineLoad:
    """A snapshot of the engine's load, refreshed after every step (read by the heartbeat)."""

    num_running: int = 0
    num_waiting: int = 0
    queued_tokens: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    num_preemptions: int = 0


class EngineThread:
    def __init__(
        self, engine: LLMEngine, loop: asyncio.AbstractEventLoop, on_step: Callable[[StepResult], None]
    ):
        self.engine = engine
        self.loop = loop
        self.on_step = on_step
        self.commands: queue.Queue[tuple[Callable[[LLMEngine], Any], asyncio.Future[Any]]] = queue.Queue()
        self.load = EngineLoad(
            total_kv_blocks=engine.block_manager.num_blocks,
            free_kv_blocks=engine.block_manager.num_free_blocks,
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs `fn(engine)` in the engine thread between steps; raises what it raises."""
        future: asyncio.Future[T] = self.loop.create_future()
        self.commands.put((fn, future))
        return await future

    @property
    def busy(self) -> bool:
        return bool(self.load.num_running or self.load.num_waiting or not self.commands.empty())

    def _run(self) -> None:
        while not self._stop.is_set():
            self._apply_commands(block=not self.engine.has_unfinished_requests())
            if self.engine.has_unfinished_requests():
                self._step()

    def _apply_commands(self, block: bool) -> None:
        try:
            fn, future = self.commands.get(timeout=IDLE_WAIT_S) if block else self.commands.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                result = fn(self.engine)
                self.loop.call_soon_threadsafe(_resolve, future, result, None)
            except Exception as exc:  # the caller gets the error; the thread goes on
                self.loop.call_soon_threadsafe(_resolve, future, None, exc)
            try:
                fn, future = self.commands.get_nowait()
            except queue.Empty:
                self._snapshot_load()
                return

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            outputs = self.engine.step()
            failed: list[tuple[str, str]] = []
        except Exception as exc:  # a broken step must not take the worker down: fail its requests
            logger.exception("engine step failed; aborting the running requests")
            outputs, failed = [], self._abort_all(f"engine step failed: {exc}")
        handoffs, self.engine.handoffs = self.engine.handoffs, []
        self._snapshot_load()
        result = StepResult(outputs, handoffs, time.perf_counter() - started, failed)
        self.loop.call_soon_threadsafe(self.on_step, result)

    def _abort_all(self, reason: str) -> list[tuple[str, str]]:
        failed = []
        for request_id in list(self.engine.sequences):
            self.engine.abort_request(request_id)
            failed.append((request_id, reason))
        return failed

    def _snapshot_load(self) -> None:
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        self.load = EngineLoad(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            queued_tokens=scheduler.num_waiting_tokens,
            free_kv_blocks=blocks.num_free_blocks,
            total_kv_blocks=blocks.num_blocks,
            num_preemptions=scheduler.num_preemptions,
        )


def _resolve(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
