"""Each hop's host cost per step on the mesh's output path, at N rows a step (CPU).

    python -m benchmarks.output_path --rows 64 256 --gateways 4 --steps 300 --repeats 3

A decode step of N requests (one new token each, as naive's) goes through every process of the
output path; each hop is timed alone, as the CPU its process spends on one step:

- `core`: the engine core's share beyond the engine's own work: the step's `RequestOutput`s made
  rows (`RowBuilder`), the `StepBatch` framed and sent (`BlockingChannel.send`, a socket pair).
- `channel`: the worker reading that frame whole and unpickling it.
- `worker`: the worker's publish (`Worker._publish`: rows grouped by gateway, one `OutputBatch`
  each, the delivered records, the script call against a throwaway redis-server).
- `redis`: the publish script's time inside Redis (its `commandstats`): Redis is one thread, and
  every gateway's read waits behind it.
- `gateway`: one gateway process's CPU for its share of the streams (N / `--gateways`): a step's
  batch decoded, each row handed to its request, each SSE chunk rendered and written to its HTTP
  client (the real app over loopback; the clients are a child process reading raw bytes). Steps
  are paced (`--gateway-interval-ms`), so the CPU is one step's, not a backlog's; the process's
  CPU over as many idle intervals is taken off.
- `gateway-behind`: the same, given `--behind` steps at a time (one XREAD's entries, as a gateway
  that fell that far behind reads them): what a step costs it while it catches up.

What a hop must stay well under is the device's step (a 1B-cost step at batch 256 on an H200 is a
few milliseconds): a hop that takes longer falls behind, however the others do. Medians over
`--repeats`; on a shared machine only the same run's figures compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import statistics
import subprocess
import sys
import time
import types
import uuid
from pathlib import Path
from typing import Any

from services.engine.engine import RequestOutput
from services.gateway.app import GatewaySettings, create_app
from services.gateway.backend import RedisBackend
from services.gateway.prepare import ServedModel
from services.serve import free_port
from services.worker.channel import BlockingChannel
from services.worker.core_messages import EngineLoad, StepBatch
from services.worker.engine_core import RowBuilder
from services.worker.metrics import WorkerMetrics
from services.worker.worker import Running, Worker, WorkerOptions
from shared.bus import Bus, RedisSettings, connect
from shared.protocol import GenerateRequest, Message, OutputBatch, TokenEvent, encode
from shared.reference import default_model
from shared.sampling_params import SamplingParams

HOPS = ("core", "channel", "worker", "redis", "gateway", "gateway-behind")
PROMPT_LEN = 200
TEXT = " tok"
"""Each row's text delta (a token's worth of text)."""


def request_ids(num_rows: int) -> list[str]:
    return [f"cmpl-{uuid.uuid4().hex}-0" for _ in range(num_rows)]


def step_outputs(ids: list[str], step: int) -> list[RequestOutput]:
    """A decode step's outputs as the engine makes them: one new token per request."""
    prompt = list(range(PROMPT_LEN))
    return [
        RequestOutput(
            request_id=request_id,
            prompt_token_ids=prompt,
            num_output_tokens=step + 1,
            text=TEXT * (step + 1),
            new_token_ids=[step],
            new_text=TEXT,
            finished=False,
            all_token_ids=[*prompt, *range(step + 1)],
            metrics={"arrival_time": 0.0, "num_preemptions": 0.0, "ttft_s": 0.05},
        )
        for request_id in ids
    ]


def step_batch(ids: list[str], step: int) -> StepBatch:
    """The worker's view of a step (what the core sent)."""
    rows = RowBuilder()
    for output in step_outputs(ids, step):
        rows.add(output, epoch=1)
    return rows.take([], [0.003], time.time(), EngineLoad(num_running=len(ids)))


# ---- core and channel --------------------------------------------------------------------------------


def time_core_and_channel(num_rows: int, steps: int) -> dict[str, float]:
    """CPU seconds a step: the core's rows + frame + send, and the worker's read + unpickle (both
    ends in this process, one after the other; a step's frame fits the socket's buffer)."""
    ids = request_ids(num_rows)
    outputs = [step_outputs(ids, step) for step in range(steps)]
    core_end, worker_end = (BlockingChannel(s) for s in socket.socketpair())
    rows = RowBuilder()
    core_s = channel_s = 0.0
    for step_out in outputs:
        started = time.process_time()
        for output in step_out:
            rows.add(output, epoch=1)
        core_end.send(rows.take([], [0.003], time.time(), EngineLoad(num_running=num_rows)))
        sent = time.process_time()
        worker_end.recv()
        channel_s += time.process_time() - sent
        core_s += sent - started
    core_end.close()
    worker_end.close()
    return {"core": core_s / steps, "channel": channel_s / steps}


# ---- worker and redis ----------------------------------------------------------------------------------


async def time_worker_and_redis(num_rows: int, num_gateways: int, steps: int, port: int) -> dict[str, float]:
    """CPU seconds a step of the worker's publish, and of the script inside Redis."""
    settings = RedisSettings(port=port, topic=f"bench-{uuid.uuid4().hex[:8]}")
    client = await connect(settings)
    bus = Bus(client, settings.keys)
    no_core = types.SimpleNamespace()  # the publish path never calls the engine core
    worker = Worker(
        no_core, bus, WorkerOptions("bench", "mixed", "bench", 5.0), WorkerMetrics("bench", "mixed")
    )  # type: ignore[arg-type]
    ids = request_ids(num_rows)
    for i, request_id in enumerate(ids):
        request = GenerateRequest(
            request_id=request_id,
            prompt_token_ids=[1],
            params=SamplingParams(max_tokens=steps + 100),
            gateway_id=f"gateway-{i % num_gateways}",
        )
        worker.requests[request_id] = Running(request, epoch=1)
        await client.hset(settings.keys.request_state(request_id), mapping={"epoch": 1})
    batches = [step_batch(ids, step) for step in range(steps + 10)]
    for batch in batches[:10]:  # warm-up: the script loaded, the records made
        await worker._publish(batch)
    await client.config_resetstat()
    started = time.process_time()
    for batch in batches[10:]:
        await worker._publish(batch)
    worker_s = (time.process_time() - started) / steps
    stats: Any = await client.info("commandstats")
    script = stats.get("cmdstat_evalsha") or stats.get("cmdstat_eval") or {}
    await client.flushdb()
    await client.aclose()
    return {"worker": worker_s, "redis": float(script.get("usec_per_call", 0.0)) * 1e-6}


def start_redis() -> tuple[subprocess.Popen[bytes], int]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not on PATH (source scripts/install-redis.sh)")
    port = free_port()
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return server, port
        except OSError:
            time.sleep(0.05)
    server.kill()
    raise SystemExit("redis-server did not start")


# ---- gateway ---------------------------------------------------------------------------------------------


class _NoBus:
    """Takes the gateway's submits (their request ids are what the steps' rows name)."""

    def __init__(self) -> None:
        self.opened: list[str] = []

    async def publish(self, stream: str, message: Message, maxlen: int | None = None) -> str:
        request = getattr(message, "request", None)
        if request is not None:
            self.opened.append(request.request_id)
        return "0-0"


class BenchBackend(RedisBackend):
    """The gateway's real backend, fed batches by the benchmark instead of by an XREAD."""

    def __init__(self) -> None:
        super().__init__(RedisSettings(topic="bench"))
        self.no_bus = _NoBus()

    async def start(self) -> None:
        self._bus = self.no_bus  # type: ignore[assignment]

    async def close(self) -> None:
        pass

    async def health(self) -> tuple[bool, str]:
        return True, "benchmark"


def gateway_batch(ids: list[str], step: int, finished: bool = False) -> bytes:
    """A step's encoded `OutputBatch` for these requests: their output token `step + 1`."""
    events = [
        TokenEvent(
            request_id,
            [100 + step % 50],
            TEXT,
            finished=finished,
            finish_reason="length" if finished else None,
            num_output_tokens=step + 1,
        )
        for request_id in ids
    ]
    return encode(OutputBatch.of(events))


async def time_gateway(
    num_streams: int, steps: int, interval_s: float, model: Path, behind: int = 1
) -> float:
    """CPU seconds a step of one gateway process serving `num_streams` SSE streams, given its
    steps `behind` at a time (one XREAD's entries, for a gateway that fell that far behind)."""
    backend = BenchBackend()
    app = create_app(ServedModel.load(model), backend, GatewaySettings())
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    clients = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "benchmarks.output_path",
        "--clients-of",
        str(port),
        str(num_streams),
        str(steps + 20),
    )
    try:
        while len(backend._follows) < num_streams:  # every request submitted and followed
            await asyncio.sleep(0.01)
        ids = list(backend._follows)
        payloads = [gateway_batch(ids, step) for step in range(steps + 10)]
        for step, payload in enumerate(payloads[:10]):  # the 200s, the first chunks
            await backend._dispatch(f"{step}-0", payload)
            await asyncio.sleep(interval_s)
        num_reads = -(-steps // behind)
        started = time.process_time()
        for _ in range(num_reads):  # the same pacing without batches: the process's idle cost
            await asyncio.sleep(interval_s)
        idle_s = time.process_time() - started
        started = time.process_time()
        for read in range(num_reads):
            for step in range(10 + read * behind, min(10 + (read + 1) * behind, len(payloads))):
                await backend._dispatch(f"{step}-0", payloads[step])
            await asyncio.sleep(interval_s)
        gateway_s = (time.process_time() - started - idle_s) / steps
        await backend._dispatch(f"{steps + 10}-0", gateway_batch(ids, steps + 10, finished=True))
        await asyncio.wait_for(clients.wait(), 60)
    finally:
        if clients.returncode is None:
            clients.kill()
            await clients.wait()
        await runner.cleanup()
    return gateway_s


async def run_clients(port: int, num_streams: int, max_tokens: int) -> None:
    """Opens `num_streams` streams and reads each to its end, as raw bytes (no parsing: the
    clients' CPU stays off the gateway's core as far as it can)."""
    body = json.dumps(
        {
            "prompt": "def add(a, b):",
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()

    async def stream() -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head + body)
        received = 0
        while chunk := await reader.read(1 << 16):
            received += len(chunk)
        writer.close()
        return received

    await asyncio.gather(*(stream() for _ in range(num_streams)))


# ---- the table -----------------------------------------------------------------------------------------


def measure(args: argparse.Namespace, num_rows: int, redis_port: int) -> dict[str, float]:
    """Seconds a step of each hop in `args.hops` (core and channel, worker and redis: together)."""
    seconds: dict[str, float] = {}
    if {"core", "channel"} & set(args.hops):
        seconds.update(time_core_and_channel(num_rows, args.steps))
    if {"worker", "redis"} & set(args.hops):
        seconds.update(asyncio.run(time_worker_and_redis(num_rows, args.gateways, args.steps, redis_port)))
    import uvloop

    streams = max(1, num_rows // args.gateways)
    interval_s = args.gateway_interval_ms / 1000
    for hop, behind in (("gateway", 1), ("gateway-behind", args.behind)):
        if hop in args.hops:
            gateway = time_gateway(streams, args.gateway_steps, interval_s, args.model, behind)
            seconds[hop] = uvloop.run(gateway)
    return seconds


def run(args: argparse.Namespace) -> dict[int, dict[str, list[float]]]:
    server, port = start_redis()
    results: dict[int, dict[str, list[float]]] = {n: {hop: [] for hop in args.hops} for n in args.rows}
    try:
        for repeat in range(args.repeats):
            for num_rows in args.rows:
                for hop, seconds in measure(args, num_rows, port).items():
                    results[num_rows][hop].append(seconds * 1e3)
                print(f"repeat {repeat + 1}, {num_rows} rows: done", file=sys.stderr, flush=True)
    finally:
        server.terminate()
        server.wait(timeout=10)
    return results


def table(results: dict[int, dict[str, list[float]]], num_gateways: int) -> str:
    names = list(next(iter(results.values())))
    lines = [
        "| rows a step | " + " | ".join(f"{hop} ms" for hop in names) + " |",
        "|---:|" + "---:|" * len(names),
    ]
    for num_rows, hops in results.items():
        cells = [f"{statistics.median(hops[hop]):.3f}" for hop in names]
        lines.append(f"| {num_rows} | {' | '.join(cells)} |")
    lines.append(
        f"\n(medians of {len(next(iter(results.values()))[names[0]])} repeats; gateway: one of "
        f"{num_gateways} processes, its rows / {num_gateways} streams)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.output_path",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256], help="requests a step")
    parser.add_argument("--gateways", type=int, default=4, help="gateway processes the rows spread over")
    parser.add_argument("--steps", type=int, default=300, help="steps a measurement (core, worker)")
    parser.add_argument("--gateway-steps", type=int, default=150, help="steps a gateway measurement")
    parser.add_argument(
        "--gateway-interval-ms", type=float, default=20.0, help="between a gateway's steps (longer than one)"
    )
    parser.add_argument("--behind", type=int, default=8, help="gateway-behind: steps a gateway takes at once")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hops", nargs="+", choices=HOPS, default=list(HOPS), help="time only these")
    parser.add_argument(
        "--model", type=Path, default=None, help="tokenizer and config (default: the reference)"
    )
    parser.add_argument("--out", type=Path, help="also write the per-repeat figures here (JSON)")
    parser.add_argument("--clients-of", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.clients_of:
        port, num_streams, max_tokens = args.clients_of
        asyncio.run(run_clients(port, num_streams, max_tokens))
        return
    args.model = args.model or Path(default_model())
    results = run(args)
    print(table(results, args.gateways))
    if args.out:
        settings = {
            key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()
        }
        args.out.write_text(json.dumps({"args": settings, "ms": results}, indent=1))


if __name__ == "__main__":
    main()
