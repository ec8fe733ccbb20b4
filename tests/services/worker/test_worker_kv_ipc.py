"""A prefill worker's side of the ipc KV hand-off, over real transports and a real Redis: whatever
becomes of the transfer, the engine core's shared buffer is released and its /dev/shm file is gone;
at once where the decode side answered the handle (taken, refused) or never got it (another host),
at its deadline where it did not answer (cancelled by the decode side, timed out, its decode process
killed), since the decode side may still be reading it. The fallback to bytes is logged once per
decode instance."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from services.engine.kv_export import KVExport
from services.kv_transport import KVTransferError
from services.kv_transport.ipc import IpcKVTransport, KVSharedUnusable
from services.kv_transport.ipc_buffer import SHM_DIR, SharedBuffers, SharedKV, open_shared
from services.worker.core_messages import EngineInfo, EngineLoad, Reply, RowEnd
from services.worker.metrics import WorkerMetrics
from services.worker.worker import Worker, WorkerOptions
from shared.bus import Bus
from shared.protocol import PAYLOAD_FIELD, decode
from tests.services.worker.test_worker_emit import one_token_step

REPO = Path(__file__).resolve().parents[3]
NUM_LAYERS = 2
LAYER = (2, 4, 2, 8)  # [num_blocks, block_size, num_kv_heads, head_dim]


class SharingCore:
    """Stands in for a prefill engine core with the ipc transport: real shared buffers, held until
    the worker releases them."""

    info = EngineInfo(max_model_len=512, total_kv_blocks=64, block_size=4)
    load = EngineLoad()

    def __init__(self) -> None:
        self.buffers = SharedBuffers(torch.device("cpu"))
        self.released: list[str] = []
        self.fetched: list[str] = []

    def export(self, request_id: str) -> KVExport:
        shape = (NUM_LAYERS, 2, *LAYER)
        buffer = self.buffers.allocate(torch.Size(shape).numel() * 4)
        target = buffer.view(torch.float32).view(shape).copy_(torch.randn(shape))
        shared = self.buffers.share(request_id, buffer, {"target": target}, {})
        return KVExport(request_id, 8, 5, [], {}, shared=shared)

    async def fetch_kv(self, request_id: str) -> asyncio.Future[Reply]:
        self.fetched.append(request_id)
        copy = self.buffers.host_copy(request_id)
        assert copy is not None
        layers = [
            (name, i, kv[0], kv[1]) for name, stacked in copy[0].items() for i, kv in enumerate(stacked)
        ]
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        future.set_result(Reply(0, export=KVExport(request_id, 0, 0, layers, copy[1])))
        return future

    async def release_kv(self, request_id: str) -> None:
        self.buffers.release(request_id)
        self.released.append(request_id)


def shm_file(shared: SharedKV) -> str:
    return os.path.join(SHM_DIR, shared.caches[0].region.name)  # type: ignore[union-attr]


@pytest.fixture
async def prefill(bus: Bus) -> Any:
    options = WorkerOptions(instance_id="p", role="prefill", model_name="m", ttl_s=5.0, kv_transport="ipc")
    core = SharingCore()
    worker = Worker(core, bus, options, WorkerMetrics("p", "prefill"))  # type: ignore[arg-type]
    worker.transport = IpcKVTransport(ack_timeout_s=1.0)
    yield worker, core
    await worker.transport.close()
    core.buffers.close()


def assert_held_until_its_deadline(core: SharingCore, path: str) -> None:
    """The handle went unanswered: the buffer outlives the transfer, and goes at its deadline."""
    assert core.released == [] and os.path.exists(path) and core.buffers.num_held == 1
    assert core.buffers.expire() == []
    assert core.buffers.expire(time.monotonic() + core.buffers.timeout_s) == ["r"]
    assert not os.path.exists(path) and core.buffers.num_held == 0


async def outcomes(bus: Bus) -> list[str]:
    return [decode(f[PAYLOAD_FIELD]).outcome for _, f in await bus.client.xrange(bus.keys.scheduler_replies)]


class Receiver:
    """A decode side whose import of shared KV runs until told, or for ever."""

    def __init__(self, refusal: str | None = None) -> None:
        self.refusal = refusal
        """Refuse the handle after opening it, saying this (None: take it)."""
        self.importing = asyncio.Event()
        self.finish = asyncio.Event()
        self.errors: list[KVTransferError] = []
        self.transport = IpcKVTransport(import_shared=self.import_shared)

    async def import_shared(self, request_id: str, shared: SharedKV) -> dict[str, torch.Tensor]:
        self.importing.set()
        await self.finish.wait()
        open_shared(shared)
        if self.refusal is not None:
            raise KVSharedUnusable(self.refusal)
        return {}

    async def start(self, request_id: str) -> str:
        address = await self.transport.start("127.0.0.1", 0, advertise_host="127.0.0.1")
        self.transport.expect(request_id, lambda _: None, lambda _: None, self.errors.append, timeout_s=30)
        return address


async def hand_off(
    worker: Worker, core: SharingCore, address: str, request_id: str = "r"
) -> tuple[str, asyncio.Task[None]]:
    export = core.export(request_id)
    worker.handoff_targets[request_id] = address
    return shm_file(export.shared), asyncio.create_task(worker._hand_off(export, 1))  # type: ignore[arg-type]


async def test_a_taken_transfer_frees_the_buffer(prefill, bus: Bus) -> None:
    worker, core = prefill
    receiver = Receiver()
    receiver.finish.set()
    path, task = await hand_off(worker, core, await receiver.start("r"))
    await asyncio.wait_for(task, 10)
    assert await outcomes(bus) == ["handed_off"]
    assert core.released == ["r"] and not os.path.exists(path) and core.buffers.num_held == 0
    await receiver.transport.close()


async def test_a_refused_transfer_sends_bytes_and_frees_the_buffer(prefill, bus: Bus) -> None:
    worker, core = prefill
    receiver = Receiver(refusal="copying failed")
    receiver.finish.set()
    path, task = await hand_off(worker, core, await receiver.start("r"))
    await asyncio.wait_for(task, 10)
    assert await outcomes(bus) == ["handed_off"]
    assert core.fetched == core.released == ["r"] and not os.path.exists(path) and core.buffers.num_held == 0
    await receiver.transport.close()


async def test_a_transfer_the_decode_side_cancels_frees_the_buffer_at_its_deadline(prefill, bus: Bus) -> None:
    worker, core = prefill
    receiver = Receiver()
    path, task = await hand_off(worker, core, await receiver.start("r"))
    await asyncio.wait_for(receiver.importing.wait(), 10)
    assert os.path.exists(path)
    assert receiver.transport.cancel("r")
    await asyncio.wait_for(task, 10)
    assert await outcomes(bus) == ["failed"]
    assert_held_until_its_deadline(core, path)
    await receiver.transport.close()


async def test_a_transfer_that_times_out_frees_the_buffer_at_its_deadline(prefill, bus: Bus) -> None:
    worker, core = prefill  # the sender waits 1 s for the shared KV to be taken
    receiver = Receiver()  # and this one never finishes taking it
    path, task = await hand_off(worker, core, await receiver.start("r"))
    await asyncio.wait_for(task, 10)
    assert await outcomes(bus) == ["failed"]
    assert_held_until_its_deadline(core, path)
    await receiver.transport.close()


DECODE_PROCESS = textwrap.dedent(
    """
    import asyncio, sys
    from services.kv_transport.ipc import IpcKVTransport, KVSharedUnusable

    async def import_shared(request_id, shared):
        print("importing", flush=True)
        await asyncio.Event().wait()

    async def main():
        transport = IpcKVTransport(import_shared=import_shared)
        print(await transport.start("127.0.0.1", 0, advertise_host="127.0.0.1"), flush=True)
        transport.expect("r", lambda _: None, lambda _: None, lambda _: None, timeout_s=60)
        await asyncio.Event().wait()

    asyncio.run(main())
    """
)


@pytest.mark.timeout(60)
async def test_a_transfer_whose_decode_process_dies_frees_the_buffer_at_its_deadline(
    prefill, bus: Bus
) -> None:
    worker, core = prefill
    worker.transport.ack_timeout_s = 30.0  # the death, not a timeout, must end it
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", DECODE_PROCESS, cwd=REPO, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        address = (await asyncio.wait_for(process.stdout.readline(), 30)).decode().strip()
        path, task = await hand_off(worker, core, address)
        assert await asyncio.wait_for(process.stdout.readline(), 10) == b"importing\n"
        assert os.path.exists(path)
        process.send_signal(signal.SIGKILL)
        await asyncio.wait_for(task, 10)
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
    assert await outcomes(bus) == ["failed"]
    assert_held_until_its_deadline(core, path)


async def test_a_decode_worker_on_another_host_gets_bytes_and_it_is_said_once(
    prefill, bus: Bus, caplog
) -> None:
    worker, core = prefill
    layers: list[tuple[str, int]] = []
    receiver = IpcKVTransport(import_shared=None, host="elsewhere/0000")
    receiver.import_shared = lambda *_: asyncio.sleep(0, {})  # takes shared KV, but lives elsewhere
    address = await receiver.start("127.0.0.1", 0, advertise_host="127.0.0.1")
    caplog.set_level(logging.WARNING, logger="services.worker.worker")
    for request_id in ("r1", "r2"):
        receiver.expect(
            request_id, lambda layer: layers.append((layer.cache, layer.index)), lambda _: None, print
        )
        path, task = await hand_off(worker, core, address, request_id)
        await asyncio.wait_for(task, 10)
        assert not os.path.exists(path)
    assert await outcomes(bus) == ["handed_off", "handed_off"]
    assert core.fetched == core.released == ["r1", "r2"]
    assert layers == [("target", i) for i in range(NUM_LAYERS)] * 2
    said = [r.getMessage() for r in caplog.records if "goes over TCP" in r.getMessage()]
    assert len(said) == 1 and "another host" in said[0]
    await receiver.close()


async def test_a_shared_export_of_a_request_dropped_meanwhile_is_released_at_once(prefill) -> None:
    worker, core = prefill  # the request left this worker (fenced, or given back) before its KV came up
    export = core.export("gone")
    batch = one_token_step(["gone"], 0, [RowEnd(row=0, handoff=True)])
    batch.handoffs = [export]
    worker._retire(batch)
    await asyncio.wait_for(asyncio.gather(*worker.pending), 10)
    assert core.released == ["gone"] and not os.path.exists(shm_file(export.shared))  # type: ignore[arg-type]
