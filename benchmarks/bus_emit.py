"""What one step's outputs cost on the bus, per request and per gateway, side by side in one run.

    python -m benchmarks.bus_emit --batch 64 --steps 300

Publishing (a worker): `per-gateway` is what a worker does now, one `OutputBatch` for the step's
requests (token ids as int32 bytes) plus each request's delivered record
(`StepBatch.delivered_records`, no TTL renewed, as in most steps), in one script call
(`Bus.publish_step`); `per-request` is what it did before, one msgpack `TokenEvent` XADDed to each
request's own stream, also in one script call. Both include building and encoding the messages
from a step's arrays. Reading (a gateway): one XREAD of its stream plus decoding the batch into
per-request events, against a multiplexed XREAD over every request's stream decoding each event.
Needs redis-server on PATH (a throwaway one is started on a free port).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import time
from typing import Any

import msgpack
import numpy as np
import redis.utils
from pydantic import BaseModel, Field

from services.serve import free_port
from services.worker.core_messages import EngineLoad, StepBatch
from shared.bus import Bus, RedisSettings, connect
from shared.protocol import PAYLOAD_FIELD, TOKEN_DTYPE, ErrorInfo, OutputBatch, TokenLogprob, decode, encode

GATEWAY = "bench-gateway"
PER_REQUEST_LUA = """
for i, stream in ipairs(KEYS) do
    redis.call('XADD', stream, '*', ARGV[1], ARGV[i + 1])
end
return #KEYS
"""


class PerRequestEvent(BaseModel):
    """The per-request message a worker published before (`TokenEvent` as it was on the bus)."""

    version: int = 1
    kind: str = "tokens"
    request_id: str
    token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = Field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    spec_stats: dict[str, Any] = Field(default_factory=dict)
    error: ErrorInfo | None = None


def step_batch(batch: int, step: int) -> StepBatch:
    """One decode step as the engine core hands it over: one new token per request."""
    return StepBatch(
        request_ids=[f"r{i}" for i in range(batch)],
        cu_num_tokens=np.arange(batch + 1, dtype=TOKEN_DTYPE),
        token_ids=np.full(batch, step, dtype=TOKEN_DTYPE),
        texts=[" x"] * batch,
        num_output_tokens=np.full(batch, step + 1, dtype=TOKEN_DTYPE),
        epochs=[1] * batch,
        ends=[],
        logprobs=[],
        handoffs=[],
        step_s=[],
        load=EngineLoad(),
    )


def per_request_stream(bus: Bus, request_id: str) -> str:
    return f"{bus.keys.pattern[:-1]}out-request:{request_id}"


async def publish_per_gateway(bus: Bus, step: StepBatch) -> None:
    records = step.delivered_records(None, np.zeros(step.num_rows, bool))  # as a worker's usual step
    await bus.publish_step([(GATEWAY, encode(step.output_batch()))], records)


async def publish_per_request(bus: Bus, script: Any, step: StepBatch) -> None:
    streams, payloads = [], []
    for row, request_id in enumerate(step.request_ids):
        event = PerRequestEvent(
            request_id=request_id,
            token_ids=step.row_tokens(row).tolist(),
            text=step.texts[row],
            num_prompt_tokens=100,
            num_output_tokens=int(step.num_output_tokens[row]),
        )
        streams.append(per_request_stream(bus, request_id))
        payloads.append(msgpack.packb(event.model_dump(mode="json"), use_bin_type=True))
    await script(keys=streams, args=[PAYLOAD_FIELD, *payloads])


async def time_publishing(bus: Bus, batch: int, steps: int, per_request: bool) -> tuple[float, float]:
    """Seconds per step: wall clock (Redis included), and this process's CPU (a worker's cost)."""
    script = bus.client.register_script(PER_REQUEST_LUA)
    started, cpu_started = time.perf_counter(), time.process_time()
    for step in range(steps):
        if per_request:
            await publish_per_request(bus, script, step_batch(batch, step))
        else:
            await publish_per_gateway(bus, step_batch(batch, step))
    return (time.perf_counter() - started) / steps, (time.process_time() - cpu_started) / steps


async def time_reading_per_gateway(bus: Bus) -> tuple[float, int]:
    """Seconds per request event of XREAD on the gateway's stream plus decoding, and the events."""
    stream, last_id, read = bus.keys.outputs(GATEWAY), "0-0", 0
    started = time.perf_counter()
    while response := await bus.client.xread({stream: last_id}, count=64):
        for raw_id, fields in response[0][1]:
            message = decode(fields[PAYLOAD_FIELD])
            assert isinstance(message, OutputBatch)
            read += len(message.events())
            last_id = raw_id.decode()
    return (time.perf_counter() - started) / max(read, 1), read


async def time_reading_per_request(bus: Bus, batch: int) -> tuple[float, int]:
    """Seconds per event of a multiplexed XREAD over every request's stream plus decoding."""
    last_ids = {per_request_stream(bus, f"r{i}"): "0-0" for i in range(batch)}
    read = 0
    started = time.perf_counter()
    while response := await bus.client.xread(last_ids, count=64):  # type: ignore[arg-type]
        for raw_stream, entries in response:
            for raw_id, fields in entries:
                PerRequestEvent.model_validate(msgpack.unpackb(fields[PAYLOAD_FIELD], raw=False))
                last_ids[raw_stream.decode()] = raw_id.decode()
                read += 1
    return (time.perf_counter() - started) / max(read, 1), read


async def run(batch: int, steps: int) -> None:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not on PATH")
    port = free_port()
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        settings = RedisSettings(port=port, topic="bench")
        client = await connect(settings)
        bus = Bus(client, settings.keys)
        for per_request in (False, True):  # warm up: connection, script load
            await time_publishing(bus, batch, 10, per_request)
        await client.flushdb()
        gateway_s, gateway_cpu_s = await time_publishing(bus, batch, steps, per_request=False)
        request_s, request_cpu_s = await time_publishing(bus, batch, steps, per_request=True)
        gateway_read_s, gateway_read = await time_reading_per_gateway(bus)
        request_read_s, request_read = await time_reading_per_request(bus, batch)
        await client.aclose()
    finally:
        server.terminate()
        server.wait(timeout=10)
    print(f"hiredis parser: {redis.utils.HIREDIS_AVAILABLE}; {batch} requests a step, {steps} steps")
    for name, wall_s, cpu_s in (
        ("per gateway (now):   ", gateway_s, gateway_cpu_s),
        ("per request (before):", request_s, request_cpu_s),
    ):
        print(
            f"publish, {name} {wall_s * 1e3:.3f} ms a step ({wall_s / batch * 1e6:.2f} us a request), "
            f"publisher CPU {cpu_s * 1e3:.3f} ms a step"
        )
    print(
        f"read + decode, per gateway:    {gateway_read_s * 1e6:.2f} us a request event ({gateway_read} events)"
    )
    print(
        f"read + decode, per request:    {request_read_s * 1e6:.2f} us a request event ({request_read} events)"
    )
    print(
        f"ratios (before / now): publish {request_s / gateway_s:.2f}x (publisher CPU "
        f"{request_cpu_s / gateway_cpu_s:.2f}x), read {request_read_s / gateway_read_s:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=64, help="requests a step")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    if args.batch < 1 or args.steps < 1:
        parser.error("--batch and --steps must be at least 1")
    asyncio.run(run(args.batch, args.steps))


if __name__ == "__main__":
    main()
