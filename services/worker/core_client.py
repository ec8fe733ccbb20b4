"""A worker's handle on its engine-core process: start it, send it commands, take its step batches.

The core's messages are read by one task on the worker's loop; step batches queue in order for the
worker's emitter, replies resolve the calls that wait for them. If the core dies (crash, kill,
out of memory), `died` is set with its exit code and every pending call fails: the worker then
leaves the mesh, and the scheduler re-dispatches its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import services
from services.engine.kv_export import KVLayers, KVStreamMessage, KVStreamStart
from services.kv_transport.ipc_buffer import SharedKV
from services.worker.channel import AsyncChannel, ChannelClosed
from services.worker.core_messages import (
    Abort,
    Activate,
    AddRequest,
    Command,
    CoreOptions,
    EngineInfo,
    EngineLoad,
    FetchKV,
    ImportKV,
    ImportShared,
    Profile,
    ReleaseKV,
    Reply,
    Reserve,
    Shutdown,
    StepBatch,
)
from shared import trace
from shared.protocol import GenerateRequest

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 30.0


class EngineCoreDied(RuntimeError):
    """The engine-core process exited while the worker still needed it."""


class EngineCoreClient:
    def __init__(self, channel: AsyncChannel, process: subprocess.Popen[bytes], info: EngineInfo):
        self.channel = channel
        self.process = process
        self.info = info
        self.load = EngineLoad(total_kv_blocks=info.total_kv_blocks, free_kv_blocks=info.total_kv_blocks)
        self.batches: asyncio.Queue[StepBatch] = asyncio.Queue()
        self.died = asyncio.Event()
        self.exit_code: int | None = None
        self._calls: dict[int, asyncio.Future[Reply]] = {}
        self._call_ids = itertools.count()
        self.on_kv_stream: Callable[[KVStreamMessage], None] = _unexpected_stream
        """Prefill role: where the KV the core streams goes (called on the reader's task, in the
        channel's order: before the step batch that hands its request off)."""
        self._reader = asyncio.create_task(self._read(), name="engine-core-reader")
        self._stopping = False

    @classmethod
    async def start(cls, options: CoreOptions, log_level: str = "INFO") -> EngineCoreClient:
        """Starts the core and waits until its engine is built (model loading can take minutes)."""
        ours, theirs = socket.socketpair()
        repo = str(Path(services.__file__).resolve().parents[1])  # the core runs this same code
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
        }
        argv = [sys.executable, "-m", "services.worker.engine_core", "--fd", str(theirs.fileno())]
        # started from this (the main) thread: the core's parent-death signal follows this thread
        process = subprocess.Popen(
            [*argv, "--parent-pid", str(os.getpid()), "--log-level", log_level],
            pass_fds=(theirs.fileno(),),
            env=env,
        )
        theirs.close()
        channel = AsyncChannel(ours, asyncio.get_running_loop())
        try:
            await channel.send(options)
            info = await channel.recv()
        except (ChannelClosed, OSError):
            info = EngineInfo(error=f"the engine core exited with code {process.wait()} while starting")
        if not isinstance(info, EngineInfo) or info.error is not None:
            channel.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=SHUTDOWN_TIMEOUT_S)
            raise EngineCoreDied(getattr(info, "error", None) or f"unexpected first message {info!r}")
        logger.info("engine core ready", extra={"pid": process.pid, "max_model_len": info.max_model_len})
        return cls(channel, process, info)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return not self.died.is_set()

    # ---- commands ------------------------------------------------------------------------------------

    async def add_request(self, request: GenerateRequest, epoch: int, handoff: bool = False) -> None:
        """Queues the placement of `epoch` of the request; a refusal comes back as a failed row of
        a step batch."""
        await self._send(
            AddRequest(
                request.request_id,
                epoch,
                request.prompt_token_ids,
                request.params,
                request.resumed_token_ids,
                handoff,
                request.arrival_time,
            )
        )

    async def abort(self, request_id: str, emit: bool = True) -> None:
        """Its final row (finish reason `abort`) follows its earlier ones, unless not `emit`;
        unknown ids are ignored."""
        await self._send(Abort(request_id, emit))

    async def reserve(self, request: GenerateRequest, epoch: int) -> asyncio.Future[Reply]:
        """Sends a reservation of KV blocks for `request` (in order with the other commands) and
        returns its answer to await: a `Reply` whose error is None, 400 (invalid) or 503 (no room)."""
        return await self._call(
            lambda call_id: Reserve(
                call_id,
                request.request_id,
                epoch,
                request.prompt_token_ids,
                request.params,
                request.resumed_token_ids,
            )
        )

    async def import_shared(self, request_id: str, shared: SharedKV) -> asyncio.Future[Reply]:
        """Decode role: sends the handle of a request's shared KV; the `Reply` to await comes once the
        core copied it into the request's blocks (error: it could not)."""
        return await self._call(lambda call_id: ImportShared(call_id, request_id, shared))

    async def fetch_kv(self, request_id: str) -> asyncio.Future[Reply]:
        """Prefill role: a `Reply` to await whose `export` is the shared export's host copy."""
        return await self._call(lambda call_id: FetchKV(call_id, request_id))

    async def release_kv(self, request_id: str) -> None:
        """Prefill role: the transfer of a shared export ended: its buffer may go."""
        await self._send(ReleaseKV(request_id))

    async def _call(self, make: Callable[[int], Command]) -> asyncio.Future[Reply]:
        """Sends the command `make(call_id)` and returns the future of its `Reply`."""
        call_id = next(self._call_ids)
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        future.add_done_callback(lambda _: self._calls.pop(call_id, None))
        try:
            await self._send(make(call_id))
        except BaseException:
            future.cancel()
            raise
        return future

    async def import_kv(
        self, request_id: str, layers: list[tuple[str, int, torch.Tensor, torch.Tensor]]
    ) -> None:
        """Sends every layer of a request's KV, (cache, index, key, value), in one command."""
        await self._send(ImportKV(request_id, layers))

    async def profile(self, path: str) -> None:
        """The core's loop runs under cProfile from now on; its stats go to `path` as it stops."""
        await self._send(Profile(path))

    async def activate(self, request_id: str, first_token_id: int) -> None:
        await self._send(Activate(request_id, first_token_id))

    async def next_batches(self) -> list[StepBatch]:
        """Every batch queued so far, oldest first (waits for one)."""
        return [await self.batches.get(), *self.queued_batches()]

    def queued_batches(self) -> list[StepBatch]:
        """Every batch queued so far, oldest first (none: an empty list)."""
        batches = []
        while not self.batches.empty():
            batches.append(self.batches.get_nowait())
        return batches

    async def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Asks the core to stop, waits for it, kills it if it does not."""
        self._stopping = True
        if self.alive:
            with contextlib.suppress(ChannelClosed, OSError, EngineCoreDied):
                await self._send(Shutdown())
        try:
            await asyncio.wait_for(asyncio.to_thread(self.process.wait), timeout_s)
        except asyncio.TimeoutError:
            logger.error("the engine core did not stop within %.0f s; killing it", timeout_s)
            self.process.kill()
            await asyncio.to_thread(self.process.wait)
        await self.died.wait()
        self.channel.close()

    # ---- the channel ---------------------------------------------------------------------------------

    async def _send(self, command: Command) -> None:
        if not self.alive:
            raise EngineCoreDied(f"the engine core exited with code {self.exit_code}")
        try:
            await self.channel.send(command)
        except (ChannelClosed, OSError) as exc:
            raise EngineCoreDied(f"the engine core is gone: {exc}") from exc

    async def _read(self) -> None:
        try:
            while True:
                message = await self.channel.recv()
                if isinstance(message, StepBatch):
                    if trace.ENABLED:
                        trace_step(message, self.pid)
                    self.load = message.load
                    self.batches.put_nowait(message)
                elif isinstance(message, KVStreamStart | KVLayers):
                    self.on_kv_stream(message)
                elif isinstance(message, Reply):
                    future = self._calls.get(message.call_id)
                    if future is not None and not future.done():
                        future.set_result(message)
                else:
                    logger.error("unexpected message from the engine core: %r", type(message).__name__)
        except (ChannelClosed, OSError) as exc:
            self.exit_code = await asyncio.to_thread(self.process.wait)
            if not self._stopping:
                logger.error(
                    "the engine core died",
                    extra={"exit_code": self.exit_code, "pid": self.pid, "error": str(exc)},
                )
        except Exception:  # an unreadable frame: the channel is out of step, the core unusable
            logger.exception("reading the engine core's channel failed; killing it")
            self.process.kill()
            self.exit_code = await asyncio.to_thread(self.process.wait)
        finally:
            for future in self._calls.values():
                if not future.done():
                    future.set_exception(EngineCoreDied(f"the engine core exited with code {self.exit_code}"))
            self.died.set()


def _unexpected_stream(message: KVStreamMessage) -> None:
    logger.error("streamed KV of %s, which nobody takes here: dropped", type(message).__name__)


def trace_step(batch: StepBatch, core_pid: int) -> None:
    """Each row's hops through the core (stamped there, logged here: off the step's loop) and its
    arrival here."""
    for request_id, pos in zip(batch.request_ids, batch.num_output_tokens.tolist()):
        if batch.started_at:
            trace.hop("core.step_start", request_id, pos, at=batch.started_at, pid=core_pid)
        trace.hop("core.sent", request_id, pos, at=batch.sent_at, pid=core_pid)
        trace.hop("worker.from_core", request_id, pos)
