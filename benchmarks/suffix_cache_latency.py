"""Suffix-cache look-up round trips as deployed: redis-server, the service in its own process, a
worker's uvloop in one thread and its engine thread calling `speculate_batch` in another.

    python -m benchmarks.suffix_cache_latency [--sequences 1000] [--tokens 500]

Not a test (absolute times belong to a quiet machine); prints p50/p99 per batch size and how many
look-ups a 2 ms deadline would have answered.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import uvloop

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from services.suffix_cache.client import RemoteSuffixIndex  # noqa: E402
from shared.bus import Bus, RedisSettings, connect  # noqa: E402
from shared.protocol import SuffixUpdate  # noqa: E402

SERVICE = (
    "import argparse, sys\n"
    "from services.suffix_cache.service import add_suffix_cache_parser\n"
    "parser = argparse.ArgumentParser()\n"
    "add_suffix_cache_parser(parser.add_subparsers())\n"
    "args = parser.parse_args(sys.argv[1:])\n"
    "sys.exit(args.handler(args))\n"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def fill(settings: RedisSettings, args: argparse.Namespace) -> Bus:
    bus = Bus(await connect(settings), settings.keys)
    while not await bus.client.exists(bus.keys.suffix_cache_heartbeat):
        await asyncio.sleep(0.05)
    rng = random.Random(0)
    for i in range(args.sequences):
        tokens = [rng.randrange(args.vocab) for _ in range(args.tokens)]
        await bus.publish(bus.keys.suffix_updates, SuffixUpdate(sequence_id=f"s{i}", token_ids=tokens))
    return bus


def measure(index: RemoteSuffixIndex, queries: list[tuple[list[int], int]], n: int, gap_s: float) -> None:
    for _ in range(n):
        index.speculate_batch(queries)
        time.sleep(gap_s)  # a decode step's worth of other work between look-ups


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--lookups", type=int, default=500)
    parser.add_argument("--batch-sizes", default="1,8,32,128")
    args = parser.parse_args()
    port = free_port()
    server = [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1"]
    redis = subprocess.Popen([*server, "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    time.sleep(0.3)
    service_args = [
        "suffix-cache",
        "--scheduler-port",
        str(port),
        "--metrics-port",
        "0",
        "--log-level",
        "WARNING",
    ]
    service = subprocess.Popen([sys.executable, "-c", SERVICE, *service_args], cwd=REPO_ROOT)
    loop = uvloop.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def on_loop(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    try:
        settings = RedisSettings(port=port)
        bus = on_loop(fill(settings, args))
        generous = RemoteSuffixIndex(loop, bus, "bench-generous", deadline_s=1.0)
        tight = RemoteSuffixIndex(loop, bus, "bench-tight", deadline_s=0.002)
        on_loop(generous.start())
        on_loop(tight.start())
        while (
            on_loop(bus.client.xpending(bus.keys.suffix_updates, "suffix-cache"))["pending"]
            or on_loop(bus.client.xinfo_groups(bus.keys.suffix_updates))[0]["lag"]
        ):
            time.sleep(0.1)
        rng = random.Random(1)
        print(
            f"index: {args.sequences} sequences x {args.tokens} tokens, vocab {args.vocab}; contexts 64 tokens, k 8"
        )
        for size in map(int, args.batch_sizes.split(",")):
            queries = [([rng.randrange(args.vocab) for _ in range(64)], 8) for _ in range(size)]
            measure(generous, queries, 50, 0.002)
            generous._round_trips_s.clear()
            measure(generous, queries, args.lookups, 0.002)
            tight.num_answered = tight.num_late = 0
            measure(tight, queries, args.lookups, 0.002)
            p50, p99 = generous.round_trip_p50_s or 0.0, generous.round_trip_p99_s or 0.0
            print(
                f"{size:4d} queries: round trip p50 {p50 * 1e3:.3f} ms, p99 {p99 * 1e3:.3f} ms; "
                f"a 2 ms deadline answered {tight.num_answered}/{args.lookups}",
                flush=True,
            )
        on_loop(generous.close())
        on_loop(tight.close())
    finally:
        service.terminate()
        service.wait()
        redis.terminate()
        redis.wait()


if __name__ == "__main__":
    main()
