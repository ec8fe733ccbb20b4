"""A command's round trip over the worker <-> engine-core channel, on this host.

    python -m benchmarks.core_channel --prompt-tokens 600 --round-trips 3000

The worker end (`AsyncChannel`, on an event loop) sends an `AddRequest` of `--prompt-tokens`
prompt tokens to a child process that waits in `poll()` as an idle engine core does, reads the
frame whole (`BlockingChannel`) and answers with one byte; the median and p90 of the round trip,
the first tenth left out as warm-up. What it shows: the cost of the hop a new request takes from
its worker to its core (`worker.to_core -> core.added`), wake-ups included.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import select
import socket
import statistics
import time

from services.worker.channel import AsyncChannel, BlockingChannel
from services.worker.core_messages import AddRequest
from shared.sampling_params import SamplingParams


def answer_frames(sock: socket.socket) -> None:
    """The child: each frame read whole after a `poll()`, answered with one byte, until a None."""
    channel, poller = BlockingChannel(sock), select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    while True:
        poller.poll(None)
        if channel.recv() is None:
            return
        sock.send(b"k")


async def round_trips(sock: socket.socket, command: AddRequest, count: int) -> list[float]:
    loop = asyncio.get_running_loop()
    channel = AsyncChannel(sock, loop)
    seconds = []
    for _ in range(count):
        started = time.perf_counter()
        await channel.send(command)
        await loop.sock_recv(sock, 1)
        seconds.append(time.perf_counter() - started)
    await channel.send(None)
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.core_channel", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--round-trips", type=int, default=3000)
    args = parser.parse_args(argv)
    if args.prompt_tokens < 1 or args.round_trips < 10:
        parser.error("--prompt-tokens must be at least 1 and --round-trips at least 10")
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        ours.close()
        answer_frames(theirs)
        os._exit(0)
    theirs.close()
    command = AddRequest("r" * 36, 1, list(range(args.prompt_tokens)), SamplingParams(max_tokens=128), [])
    with ours:
        seconds = asyncio.run(round_trips(ours, command, args.round_trips))[args.round_trips // 10 :]
        os.waitpid(pid, 0)
    seconds.sort()
    p50_us, p90_us = statistics.median(seconds) * 1e6, seconds[int(len(seconds) * 0.9)] * 1e6
    print(
        f"AddRequest of {args.prompt_tokens} prompt tokens, worker -> core -> worker: p50 {p50_us:.1f} us, p90 {p90_us:.1f} us"
    )


if __name__ == "__main__":
    main()
