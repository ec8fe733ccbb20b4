"""What one step's token events cost on the bus: a worker publishing one event to each of `--batch`
output streams, and a gateway reading them back with one multiplexed XREAD and decoding them.

    python -m benchmarks.bus_emit --batch 64 --steps 300

Publishing is timed two ways in the same run, the worker's `Bus.publish_many` (one Lua script call
doing every XADD) and a pipeline of one XADD per stream (what it did before); both include building
and encoding the events. Needs redis-server on PATH (a throwaway one is started on a free port).
Whether redis-py parses replies with hiredis is printed: it changes the reading figure ~3x.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import time

import redis.utils

from services.serve import free_port
from shared.bus import Bus, RedisSettings, connect
from shared.protocol import PAYLOAD_FIELD, TokenEvent, decode, encode


def step_events(bus: Bus, batch: int, step: int) -> list[tuple[str, TokenEvent]]:
    """One step's events as a worker sends them mid-stream: one new token each, no stats."""
    return [
        (
            bus.keys.output(f"r{i}"),
            TokenEvent(
                request_id=f"r{i}", token_ids=[step], text=" x", num_prompt_tokens=100, num_output_tokens=step
            ),
        )
        for i in range(batch)
    ]


async def publish_pipelined(bus: Bus, items: list[tuple[str, TokenEvent]]) -> None:
    async with bus.client.pipeline(transaction=False) as pipe:
        for stream, message in items:
            pipe.xadd(stream, {PAYLOAD_FIELD: encode(message)})
        await pipe.execute()


async def time_publishing(bus: Bus, batch: int, steps: int, pipelined: bool) -> float:
    """Seconds per step."""
    started = time.perf_counter()
    for step in range(steps):
        items = step_events(bus, batch, step)
        if pipelined:
            await publish_pipelined(bus, items)
        else:
            await bus.publish_many(items)
    return (time.perf_counter() - started) / steps


async def time_reading(bus: Bus, batch: int) -> tuple[float, int]:
    """Seconds per event of XREAD over every stream plus decoding, and the events read."""
    last_ids: dict[str, str] = {bus.keys.output(f"r{i}"): "0-0" for i in range(batch)}
    read = 0
    started = time.perf_counter()
    while True:
        response = await bus.client.xread(last_ids, count=64)  # type: ignore[arg-type]
        if not response:
            break
        for raw_stream, entries in response:
            stream = raw_stream.decode()
            for raw_id, fields in entries:
                decode(fields[PAYLOAD_FIELD])
                last_ids[stream] = raw_id.decode()
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
        await time_publishing(bus, batch, 10, pipelined=False)  # warm up: connection, script load
        await client.flushdb()
        script_s = await time_publishing(bus, batch, steps, pipelined=False)
        per_event_s, num_read = await time_reading(bus, batch)
        await client.flushdb()
        pipeline_s = await time_publishing(bus, batch, steps, pipelined=True)
        await client.aclose()
    finally:
        server.terminate()
        server.wait(timeout=10)
    print(f"hiredis parser: {redis.utils.HIREDIS_AVAILABLE}; {batch} events a step, {steps} steps")
    print(
        f"publish_many (one script call): {script_s * 1e3:.2f} ms a step, {script_s / batch * 1e6:.1f} us an event"
    )
    print(
        f"pipeline of XADDs:              {pipeline_s * 1e3:.2f} ms a step, {pipeline_s / batch * 1e6:.1f} us an event"
    )
    print(f"XREAD + decode:                 {per_event_s * 1e6:.1f} us an event ({num_read} events)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=64, help="requests (output streams) a step")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    if args.batch < 1 or args.steps < 1:
        parser.error("--batch and --steps must be at least 1")
    asyncio.run(run(args.batch, args.steps))


if __name__ == "__main__":
    main()
