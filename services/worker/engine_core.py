"""The engine-core process: a worker's engine, stepping in a process of its own.

    apply commands  (non-blocking while there is work; blocking while idle)
    step            (schedule, launch; send the last step's outputs as one StepBatch of arrays
                     while the device runs; read back)

Nothing here touches Redis (except the shared suffix cache's client, on a thread of its own): the
worker process owns the bus, so publishing never holds this interpreter's lock while a step runs
and a step never waits for a publish. Started by `EngineCoreClient` as
`python -m services.worker.engine_core --fd N --parent-pid P`; it dies with its worker (a parent
death signal, and end of file on the channel), and ignores SIGINT / SIGTERM, which its worker
handles by draining and then sending `Shutdown`.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import ctypes
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np
import torch

from services.engine.engine import CapacityError, KVExport, LLMEngine, RequestError, RequestOutput
from services.kv_transport.ipc_buffer import SharedBuffers, open_shared
from services.runtime import freeze_start_up, setup_logging
from services.worker.channel import BlockingChannel, ChannelClosed
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
    Logprobs,
    Profile,
    PromptLogprobs,
    ReleaseKV,
    Reply,
    Reserve,
    RowEnd,
    Shutdown,
    StepBatch,
    SuffixCacheOptions,
)
from services.worker.cpus import CpuClaim, claim_core_cpus, pin_process
from shared import trace
from shared.config import EngineConfig
from shared.protocol import TOKEN_DTYPE, ErrorInfo

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PROCESS_NAME = b"engine-core"
"""What `ps` and /proc/<pid>/comm show (the benchmark's cores table names the process by it)."""
SUFFIX_STATS_INTERVAL_S = 1.0
"""How often a step batch carries the suffix-cache client's counters (a snapshot sorts its window
of round trips: too much work for every step)."""


class RowBuilder:
    """Collects one step's outputs (and failures) as rows, then hands them over as arrays."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.request_ids: list[str] = []
        self.num_new_tokens: list[int] = []
        self.token_ids: list[int] = []
        self.texts: list[str] = []
        self.num_output_tokens: list[int] = []
        self.epochs: list[int] = []
        self.ends: list[RowEnd] = []
        self.logprobs: list[tuple[int, Logprobs]] = []
        self.prompt_logprobs: list[tuple[int, PromptLogprobs]] = []

    def __len__(self) -> int:
        return len(self.request_ids)

    def add(self, output: RequestOutput, epoch: int) -> None:
        row = len(self.request_ids)
        new = output.new_token_ids
        self.request_ids.append(output.request_id)
        self.num_new_tokens.append(len(new))
        self.token_ids += new
        self.texts.append(output.new_text)
        self.num_output_tokens.append(output.num_output_tokens)
        self.epochs.append(epoch)
        new_logprobs = output.new_logprobs
        if new_logprobs is not None and new:  # new tokens were sampled here: none is None
            sampled = [lp for lp in new_logprobs if lp is not None]
            entries = [(lp.token_id, lp.logprob, list(lp.top.items())) for lp in sampled]
            self.logprobs.append((row, entries))
        if output.prompt_logprobs is not None and new and output.num_output_tokens == len(new):  # first row
            prompt = [
                None if lp is None else (lp.token_id, lp.logprob, lp.rank, list(lp.top.items()))
                for lp in output.prompt_logprobs
            ]
            self.prompt_logprobs.append((row, prompt))
        if output.finished:
            self.ends.append(
                RowEnd(
                    row=row,
                    finish_reason=None if output.finish_reason == "handoff" else output.finish_reason,
                    stop_reason=output.stop_reason,
                    spec_stats=output.spec_stats,
                    ttft_s=output.metrics.get("ttft_s"),
                    e2e_s=output.metrics.get("e2e_s"),
                    handoff=output.finish_reason == "handoff",
                )
            )

    def fail(self, request_id: str, epoch: int, code: int, message: str) -> None:
        """A request that ends in an error (refused, or lost to a failed step)."""
        kind = "invalid_request_error" if code == 400 else "server_error"
        self.ends.append(
            RowEnd(
                row=len(self.request_ids),
                finish_reason="error",
                error=ErrorInfo(code=code, type=kind, message=message),
            )
        )
        self.request_ids.append(request_id)
        self.num_new_tokens.append(0)
        self.texts.append("")
        self.num_output_tokens.append(0)
        self.epochs.append(epoch)

    def take(
        self, handoffs: list[KVExport], step_s: list[float], started_at: float, load: EngineLoad
    ) -> StepBatch:
        batch = StepBatch(
            request_ids=self.request_ids,
            cu_num_tokens=np.cumsum([0, *self.num_new_tokens], dtype=TOKEN_DTYPE),
            token_ids=np.asarray(self.token_ids, dtype=TOKEN_DTYPE),
            texts=self.texts,
            num_output_tokens=np.asarray(self.num_output_tokens, dtype=TOKEN_DTYPE),
            epochs=self.epochs,
            ends=self.ends,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            handoffs=handoffs,
            step_s=step_s,
            load=load,
            started_at=started_at,
            sent_at=time.time(),
        )
        self.clear()
        return batch


class EngineCore:
    def __init__(
        self,
        engine: LLMEngine,
        channel: BlockingChannel,
        suffix_index: Any = None,
        shared: SharedBuffers | None = None,
        stream_kv: bool = False,
    ):
        self.engine = engine
        self.channel = channel
        self.suffix_index = suffix_index
        self.shared = shared
        """Prefill role with the ipc transport: exports gathered on the device, held until released."""
        if shared is not None:
            engine.allocate_export = shared.allocate
        elif stream_kv and not engine.stream_kv(channel.send):
            logger.warning("KV goes whole after each prefill: layers do not stream under tensor parallelism")
        engine.on_outputs = self._send_outputs
        self.rows = RowBuilder()
        self.poller = select.poll()
        self.poller.register(channel.fileno(), select.POLLIN)
        self.running = True
        self.dirty = False
        """Commands changed the engine since the last batch (its load, or rows to send)."""
        self.epochs: dict[str, int] = {}
        """Each request's placement epoch, which its rows carry, until its last row."""
        self.profile: tuple[cProfile.Profile, str] | None = None
        """The profiler a `Profile` command started, and where its stats go."""
        self.suffix_stats_due = 0.0
        """When (`time.monotonic()`) the next batch carries the suffix-cache client's counters."""
        self.started_at = 0.0
        """Wall clock as the step under way (or the last) began."""
        self.step_s: list[float] = []
        """The time of each step that ended since the last batch (`StepBatch.step_s`)."""
        self.sent_in_step = False
        """A batch went out during the step under way."""

    def run(self) -> None:
        while self.running:
            self._apply_commands(wait=not self.engine.has_unfinished_requests())
            if self.engine.has_unfinished_requests():
                self._step()
            elif self.dirty:
                self._send([], started_at=0.0)
            self._expire_shared()

    def _apply_commands(self, wait: bool) -> None:
        timeout_ms = self._idle_wait_ms() if wait else 0
        while self.running and self.poller.poll(timeout_ms):
            self._apply(self.channel.recv())
            timeout_ms = 0

    def _idle_wait_ms(self) -> int | None:
        """How long an idle core waits for a command: for ever, or until a shared export expires."""
        seconds = self.shared.seconds_to_deadline() if self.shared is not None else None
        return None if seconds is None else int(seconds * 1000) + 1

    def _expire_shared(self) -> None:
        if self.shared is not None and (expired := self.shared.expire()):
            logger.warning("shared KV of %s never released: freed at its deadline", ", ".join(expired))

    def _step(self) -> None:
        """One engine step. The last step's outputs go out from inside it, while the device runs it
        (`_send_outputs`); after it, a batch goes only with what the step made after its device
        work (hand-offs, failures), where none went during it (the step's time, the load), or where
        it was the last of a run (its time goes out before the core waits idle)."""
        self.started_at, started = time.time(), time.perf_counter()
        self.sent_in_step = False
        try:
            for output in self.engine.step():
                self._add_row(output)
        except ConnectionError:
            raise  # the channel, from `_send_outputs`: the worker is gone
        except Exception as exc:  # a broken step must not take the worker down: fail its requests
            if self.engine.config.tensor_parallel_size > 1:
                raise  # the other ranks may be inside the step's collectives: the group cannot go on
            logger.exception("engine step failed; aborting the running requests")
            self._abort_all(f"engine step failed: {exc}")
        self.step_s.append(time.perf_counter() - started)
        exports, self.engine.handoffs = self.engine.handoffs, []
        if exports or len(self.rows) or not self.sent_in_step or not self.engine.has_unfinished_requests():
            self._send(exports, self.started_at)

    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        """`LLMEngine.on_outputs`: the last step's outputs, sent at once, while the device runs the
        step in flight (its rows reach the bus a step sooner, and their packing and sending overlap
        the device instead of delaying the next launch)."""
        for output in outputs:
            self._add_row(output)
        self._send([], self.started_at)

    def _send(self, handoffs: list[KVExport], started_at: float) -> None:
        """The rows so far, with the time of the steps no batch carried yet."""
        handoffs = [self._share(export) for export in handoffs]
        self.channel.send(self.rows.take(handoffs, self.step_s, started_at, self._load()))
        self.step_s = []
        self.sent_in_step = True
        self.dirty = False

    def _share(self, export: KVExport) -> KVExport:
        """An export gathered on the device, as its handle alone (the buffer stays here, held)."""
        if self.shared is None or export.buffer is None:
            return export
        shared = self.shared.share(export.request_id, export.buffer, export.caches, export.tensors)
        return KVExport(export.request_id, export.num_tokens, export.first_token_id, [], {}, shared=shared)

    # ---- commands ----------------------------------------------------------------------------------

    def _apply(self, command: Command) -> None:
        self.dirty = True
        if isinstance(command, AddRequest):
            self._add(command)
        elif isinstance(command, Abort):
            output = self.engine.abort_request(command.request_id)
            if output is not None and command.emit:
                self._add_row(output)
            elif output is not None:
                self.epochs.pop(command.request_id, None)
        elif isinstance(command, Reserve):
            self.channel.send(Reply(command.call_id, self._reserve(command)))
        elif isinstance(command, ImportKV | Activate):
            self._receive_kv(command)
        elif isinstance(command, ImportShared):
            self.channel.send(self._import_shared(command))
        elif isinstance(command, FetchKV):
            self.channel.send(self._fetch_shared(command))
        elif isinstance(command, ReleaseKV):
            if self.shared is not None:
                self.shared.release(command.request_id)
        elif isinstance(command, Shutdown):
            self.running = False
        elif isinstance(command, Profile):
            self.stop_profile()
            self.profile = cProfile.Profile(), command.path
            self.profile[0].enable()
        else:
            logger.error("unknown command %r", type(command).__name__)

    def stop_profile(self) -> None:
        """Writes the stats of a profile under way, if any."""
        if self.profile is not None:
            profiler, path = self.profile
            profiler.disable()
            profiler.dump_stats(path)
            self.profile = None

    def _add_row(self, output: RequestOutput) -> None:
        if output.finished:
            epoch = self.epochs.pop(output.request_id, 0)
        else:
            epoch = self.epochs.get(output.request_id, 0)
        self.rows.add(output, epoch)

    def _fail_row(self, request_id: str, code: int, message: str) -> None:
        self.rows.fail(request_id, self.epochs.pop(request_id, 0), code, message)

    def _add(self, command: AddRequest) -> None:
        # placed here again: its earlier placement, which its worker already dropped, ended in the
        # last step and its last row is still due; that row must not go out under the new epoch
        trace.hop("core.added", command.request_id)
        self.engine.discard_request(command.request_id)
        self.epochs[command.request_id] = command.epoch
        try:
            self.engine.add_request(
                command.request_id,
                prompt_token_ids=command.prompt_token_ids,
                params=command.params,
                resumed_token_ids=command.resumed_token_ids,
                handoff=command.handoff,
                arrival_time=command.arrival_time,
            )
        except RequestError as exc:
            self._fail_row(command.request_id, 400, str(exc))
        except Exception as exc:
            logger.exception("adding %s failed", command.request_id)
            self._fail_row(command.request_id, 500, f"could not add the request: {exc}")

    def _reserve(self, command: Reserve) -> ErrorInfo | None:
        try:
            self.engine.reserve(
                command.request_id, command.prompt_token_ids, command.params, command.resumed_token_ids
            )
        except RequestError as exc:
            code = 503 if isinstance(exc, CapacityError) else 400
            return ErrorInfo(code=code, type="server_error", message=str(exc))
        self.epochs[command.request_id] = command.epoch
        return None

    def _receive_kv(self, command: ImportKV | Activate) -> None:
        """A request's KV, or its first token after it; a request cancelled meanwhile is gone."""
        try:
            if isinstance(command, ImportKV):
                self.engine.import_layers(command.request_id, command.layers)
            else:
                self.engine.activate(command.request_id, command.first_token_id)
        except KeyError:
            logger.info("KV for %s, which is no longer reserved here: dropped", command.request_id)
        except Exception as exc:
            logger.exception("taking the KV of %s failed", command.request_id)
            self.engine.abort_request(command.request_id)
            self._fail_row(command.request_id, 500, f"taking the prefilled KV failed: {exc}")

    def _import_shared(self, command: ImportShared) -> Reply:
        """Copies a request's KV from another process's buffer into its reserved blocks. The answer,
        either way, comes once this process no longer reads the buffer: it lets the producer free
        it. An error answer means the sender should send the bytes instead."""
        try:
            tensors = self._copy_shared(command)
            return Reply(command.call_id, tensors=tensors)
        except KeyError:
            message = f"{command.request_id} is no longer reserved here"
        except Exception as exc:
            logger.warning("opening the shared KV of %s failed: %s", command.request_id, exc)
            message = f"cannot take the shared KV: {exc}"
        return Reply(command.call_id, ErrorInfo(code=502, type="server_error", message=message))

    def _copy_shared(self, command: ImportShared) -> dict[str, torch.Tensor]:
        """The copy of `_import_shared`; returns or raises only after every read of the buffer ended."""
        caches, tensors = open_shared(command.shared)
        try:
            self.engine.import_stacked(command.request_id, caches)
            return {name: t.cpu() for name, t in tensors.items()}
        finally:
            devices = {t.device for t in (*caches.values(), *tensors.values())} | {self.engine.runner.device}
            for device in devices:
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()

    def _fetch_shared(self, command: FetchKV) -> Reply:
        """A host copy of a held export (the decode side could not open it)."""
        copy = self.shared.host_copy(command.request_id) if self.shared is not None else None
        if copy is None:
            message = f"no shared KV of {command.request_id} is held here (released, or expired)"
            return Reply(command.call_id, ErrorInfo(code=500, type="server_error", message=message))
        caches, tensors = copy
        layers = [
            (cache, i, kv[0], kv[1]) for cache, stacked in caches.items() for i, kv in enumerate(stacked)
        ]
        return Reply(command.call_id, export=KVExport(command.request_id, 0, 0, layers, tensors))

    def _abort_all(self, reason: str) -> None:
        for request_id in list(self.engine.sequences):
            self.engine.abort_request(request_id)
            self._fail_row(request_id, 500, reason)

    def _load(self) -> EngineLoad:
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        return EngineLoad(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            queued_tokens=scheduler.num_waiting_tokens,
            free_kv_blocks=blocks.num_free_blocks,
            total_kv_blocks=blocks.num_blocks,
            num_preemptions=scheduler.num_preemptions,
            suffix_cache=self._suffix_stats(),
        )

    def _suffix_stats(self) -> dict[str, Any]:
        """The suffix-cache client's counters, at most every `SUFFIX_STATS_INTERVAL_S` (else none)."""
        stats = getattr(self.suffix_index, "stats", None)
        if stats is None or time.monotonic() < self.suffix_stats_due:
            return {}
        self.suffix_stats_due = time.monotonic() + SUFFIX_STATS_INTERVAL_S
        return dict(stats())


# ---- the shared suffix cache, from a thread of the core ------------------------------------------------


class SuffixCacheThread:
    """The suffix-cache client needs an event loop and a Redis connection: both live on a thread of
    the core (the step only waits on it, bounded by the client's deadline, for drafts it asked for)."""

    def __init__(self, options: SuffixCacheOptions):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="suffix-cache", daemon=True)
        self.thread.start()
        self.index, self.client = asyncio.run_coroutine_threadsafe(self._start(options), self.loop).result()

    async def _start(self, options: SuffixCacheOptions) -> tuple[Any, Any]:
        from services.suffix_cache.client import RemoteSuffixIndex
        from shared.bus import Bus, connect

        client = await connect(options.redis)
        index = RemoteSuffixIndex(
            self.loop, Bus(client, options.redis.keys), options.instance_id, deadline_s=options.deadline_s
        )
        await index.start()
        return index, client

    def close(self) -> None:
        async def close() -> None:
            await self.index.close()
            await self.client.aclose()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


# ---- process entry -------------------------------------------------------------------------------------


def die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this process when its parent dies (a killed worker leaves no engine behind)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        libc.prctl(PR_SET_NAME, PROCESS_NAME)
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)


def available_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def core_cpu_threads(config: EngineConfig, num_cores: int) -> int:
    """The core's torch CPU threads: `config.cpu_threads`, else one with a GPU (torch's CPU work
    there is copies, and idle intra-op threads spinning after each would take the cores of the
    mesh's other processes), else half the cores: the bus side, the gateway and Redis need the
    rest, and an op whose threads wait for a core they lost stalls the whole step."""
    if config.cpu_threads is not None:
        return config.cpu_threads
    if config.torch_device.type == "cuda":
        return 1
    return max(1, num_cores // 2)


def serve(channel: BlockingChannel) -> int:
    options: CoreOptions = channel.recv()
    suffix = None
    cpus = CpuClaim()
    try:
        if options.suffix_cache is not None:
            suffix = SuffixCacheThread(options.suffix_cache)
        num_threads = core_cpu_threads(options.config, available_cores())
        torch.set_num_threads(num_threads)
        engine = LLMEngine(options.config, suffix.index if suffix else None)
        # after the build: tensor-parallel ranks it started keep every CPU
        cpus = claim_core_cpus(options.config.core_cpus, num_threads)
        pin_process(cpus.cpus)
        freeze_start_up()
    except Exception as exc:
        logger.exception("the engine could not be built")
        channel.send(EngineInfo(error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"))
        return 1
    channel.send(
        EngineInfo(
            max_model_len=engine.max_model_len,
            total_kv_blocks=engine.block_manager.num_blocks,
            block_size=engine.config.block_size,
            speculative_method=engine.config.speculative_config.method,
            cpus=cpus.cpus,
        )
    )
    shared = SharedBuffers(engine.runner.device, options.share_timeout_s) if options.share_kv else None
    core = EngineCore(engine, channel, suffix.index if suffix else None, shared, options.stream_kv)
    try:
        core.run()
    except ChannelClosed:
        logger.warning("the worker closed the channel; the engine core stops")
    finally:
        core.stop_profile()
        if shared is not None:
            shared.close()
        engine.close()
        if suffix is not None:
            suffix.close()
        cpus.release()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.worker.engine_core")
    parser.add_argument("--fd", type=int, required=True, help="this end of the worker's socket pair")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    die_with_parent(args.parent_pid)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    setup_logging(args.log_level, "engine-core")
    channel = BlockingChannel(socket.socket(fileno=args.fd))
    try:
        return serve(channel)
    finally:
        channel.close()


if __name__ == "__main__":
    sys.exit(main())
