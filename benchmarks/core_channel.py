"""A command's round trip over the worker <-> engine-core channel, on this host.

    python -m benchmarks.core_channel --prompt-tokens 600 --round-trips 3000 [--rows 64]

Down: the worker end (`AsyncChannel`, on an event loop) sends an `AddRequest` of `--prompt-tokens`
prompt tokens to a child process that waits in `poll()` as an idle engine core does, reads the
frame whole (`BlockingChannel`) and answers with one byte; the median and p90 of the round trip,
the first tenth left out as warm-up. What it shows: the cost of the hop a new request takes from
its worker to its core (`worker.to_core -> core.added`), wake-ups included.

Up (`--rows N`): the worker end, on uvloop as a worker's bus side runs, sends one byte; the child
answers with a `StepBatch` of N rows (three new tokens each, a text, a load), sent as the core
sends one; timed until the worker end has read it whole: the hop of a step's rows from the core to
its worker (`core.sent -> worker.from_core`), the reader's wake-up and its reads included.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import select
import socket
import statistics
import time
from collections.abc import Callable

import numpy as np

from services.worker.channel import AsyncChannel, BlockingChannel
from services.worker.core_messages import AddRequest, EngineLoad, StepBatch
from shared.protocol import TOKEN_DTYPE
from shared.sampling_params import SamplingParams


def step_batch(num_rows: int) -> StepBatch:
    """A step's batch of `num_rows` rows of three new tokens each, as a decode step sends one."""
    return StepBatch(
        request_ids=[f"{i:036d}" for i in range(num_rows)],
        cu_num_tokens=np.arange(0, 3 * num_rows + 1, 3, dtype=TOKEN_DTYPE),
        token_ids=np.arange(3 * num_rows, dtype=TOKEN_DTYPE),
        texts=["abc"] * num_rows,
        num_output_tokens=np.full(num_rows, 30, dtype=TOKEN_DTYPE),
        epochs=[1] * num_rows,
        ends=[],
        logprobs=[],
        handoffs=[],
        step_s=[0.001],
        load=EngineLoad(num_running=num_rows),
    )


def send_batches(sock: socket.socket, batch: StepBatch) -> None:
    """The child, up: each byte read is answered with `batch`, until end of file."""
    channel = BlockingChannel(sock)
    while sock.recv(1):
        channel.send(batch)


async def batch_trips(sock: socket.socket, count: int) -> list[float]:
    loop = asyncio.get_running_loop()
    channel = AsyncChannel(sock, loop)
    seconds = []
    for _ in range(count):
        started = time.perf_counter()
        await loop.sock_sendall(sock, b"g")
        await channel.recv()
        seconds.append(time.perf_counter() - started)
    return seconds


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
    parser.add_argument("--rows", type=int, help="time a step batch of this many rows, core -> worker")
    args = parser.parse_args(argv)
    if args.prompt_tokens < 1 or args.round_trips < 10 or (args.rows is not None and args.rows < 1):
        parser.error("--prompt-tokens and --rows must be at least 1 and --round-trips at least 10")
    if args.rows is None:
        command = AddRequest("r" * 36, 1, list(range(args.prompt_tokens)), SamplingParams(max_tokens=128), [])
        seconds = in_child(
            answer_frames,
            lambda sock: asyncio.run(round_trips(sock, command, args.round_trips)),
        )
        what = f"AddRequest of {args.prompt_tokens} prompt tokens, worker -> core -> worker"
    else:
        import uvloop

        batch = step_batch(args.rows)
        seconds = in_child(
            functools.partial(send_batches, batch=batch),
            lambda sock: uvloop.run(batch_trips(sock, args.round_trips)),
        )
        what = f"StepBatch of {args.rows} rows, worker -> core -> worker (uvloop)"
    seconds = sorted(seconds[args.round_trips // 10 :])
    p50_us, p90_us = statistics.median(seconds) * 1e6, seconds[int(len(seconds) * 0.9)] * 1e6
    print(f"{what}: p50 {p50_us:.1f} us, p90 {p90_us:.1f} us")


def in_child(
    child: Callable[[socket.socket], None], parent: Callable[[socket.socket], list[float]]
) -> list[float]:
    """Runs `child` on one end of a socket pair in a forked process and `parent` on the other here."""
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        ours.close()
        child(theirs)
        os._exit(0)
    theirs.close()
    with ours:
        seconds = parent(ours)
        ours.shutdown(socket.SHUT_WR)  # the child, up, reads end of file and exits
        os.waitpid(pid, 0)
    return seconds


if __name__ == "__main__":
    main()
