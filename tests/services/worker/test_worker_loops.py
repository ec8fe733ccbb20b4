"""A worker whose loop dies leaves the mesh with an error (exit code 1, its heartbeat gone, so the
scheduler re-dispatches its requests at once and its supervisor starts it again) instead of running on
as a zombie whose heartbeat says it is alive while it reads no dispatch."""

from __future__ import annotations

import asyncio

from services.worker.core_messages import EngineInfo, EngineLoad, StepBatch
from services.worker.metrics import WorkerMetrics
from services.worker.worker import Worker, WorkerOptions
from shared.bus import Bus


class LiveCore:
    """Stands in for a healthy engine core that never steps."""

    info = EngineInfo(max_model_len=512, total_kv_blocks=64, block_size=16)
    load = EngineLoad()
    exit_code = None

    def __init__(self) -> None:
        self.died = asyncio.Event()
        self.batches: asyncio.Queue[StepBatch] = asyncio.Queue()
        self.shut_down = False

    @property
    def alive(self) -> bool:
        return not self.died.is_set()

    async def shutdown(self) -> None:
        self.shut_down = True


async def test_a_dead_receive_loop_makes_the_worker_leave_with_an_error(bus: Bus) -> None:
    core = LiveCore()
    options = WorkerOptions(instance_id="w", role="mixed", model_name="m", ttl_s=5.0)
    worker = Worker(core, bus, options, WorkerMetrics("w", "mixed"))  # type: ignore[arg-type]

    async def receive_dies(stop: asyncio.Event) -> None:
        await asyncio.sleep(0.05)
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

    worker._receive_loop = receive_dies  # type: ignore[method-assign]
    assert await asyncio.wait_for(worker.run(asyncio.Event()), 20) == 1
    assert core.shut_down
    assert await bus.client.exists(bus.keys.heartbeat("w")) == 0
