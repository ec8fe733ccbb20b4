"""The gateway's own share of a first token: from a client's request to its first text chunk,
through a gateway process whose mesh answers at once.

    python -m benchmarks.gateway_first_chunk [--trees DIR ...] [--kind completion|chat]

Each tree (default: this one) serves its gateway app (`create_app`, the model's tokenizer, the
usual middlewares and SSE) in a process of its own; its backend encodes each `Submit` as
`RedisBackend` does, then yields the first token at once and the last 2 ms later. A client in this
process sends the code_editing prompts as streamed requests, one at a time, alternating between
the trees' gateways (so that the machine's load weighs on all alike), and times each from its
send to the first chunk that carries text. Medians and p90s in microseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from benchmarks.workloads import load_workload

LAST_TOKEN_AFTER_S = 0.002
PAUSE_S = 0.02
"""Between requests: the client's and gateway's leftovers (the last chunk, logging) are done."""


def serve(port: int) -> None:
    """A gateway on `port` whose mesh answers every request with two tokens (this tree's code)."""
    import uvloop
    from aiohttp import web

    from services.gateway.app import create_app
    from services.gateway.prepare import ServedModel
    from shared.protocol import GenerateRequest, Submit, TokenEvent, encode
    from shared.reference import default_model

    served = ServedModel.load(default_model())
    token_id = served.tokenizer.encode("x", add_special_tokens=False)[-1]

    class AnsweringBackend:
        async def start(self) -> None:
            pass

        async def close(self) -> None:
            pass

        async def submit(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
            encode(Submit(request=request.model_copy(update={"gateway_id": "g", "gateway_incarnation": "i"})))
            yield TokenEvent(request.request_id, [token_id], "x", num_output_tokens=1)
            await asyncio.sleep(LAST_TOKEN_AFTER_S)
            yield TokenEvent(
                request.request_id,
                [token_id],
                "x",
                finished=True,
                finish_reason="length",
                num_output_tokens=2,
            )

        async def cancel(self, request_id: str, reason: str = "") -> None:
            pass

        async def health(self) -> tuple[bool, str]:
            return True, "no mesh: the benchmark answers"

    app = create_app(served, AnsweringBackend())
    web.run_app(app, host="127.0.0.1", port=port, print=None, loop=uvloop.new_event_loop())


def body(kind: str, prompt: str) -> dict[str, object]:
    fields: dict[str, object] = {"max_tokens": 2, "stream": True, "temperature": 0.0}
    if kind == "completion":
        return {**fields, "prompt": prompt}
    return {**fields, "messages": [{"role": "user", "content": prompt}]}


def has_text(line: bytes) -> bool:
    if not line.startswith(b"data:") or line == b"data: [DONE]":
        return False
    choices = json.loads(line[len(b"data:") :]).get("choices") or []
    return any(c.get("text") or (c.get("delta") or {}).get("content") for c in choices)


async def first_chunk_us(session: aiohttp.ClientSession, url: str, payload: dict[str, object]) -> float:
    started, first = time.perf_counter(), None
    async with session.post(url, json=payload) as response:
        async for raw in response.content:
            if first is None and has_text(raw.strip()):
                first = time.perf_counter()
    assert first is not None, f"no text chunk from {url}"
    return (first - started) * 1e6


async def client(ports: list[int], kind: str, num_requests: int, warmup: int) -> list[list[float]]:
    prompts = [record.prompt for record in load_workload("code_editing")]
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    samples: list[list[float]] = [[] for _ in ports]
    async with aiohttp.ClientSession() as session:
        for i in range(warmup + num_requests):
            order = range(len(ports)) if i % 2 == 0 else reversed(range(len(ports)))
            for which in order:
                us = await first_chunk_us(
                    session, f"http://127.0.0.1:{ports[which]}{path}", body(kind, prompts[i % len(prompts)])
                )
                if i >= warmup:
                    samples[which].append(us)
                await asyncio.sleep(PAUSE_S)
    return samples


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trees", nargs="+", default=[str(Path(__file__).resolve().parents[1])])
    parser.add_argument("--kind", default="completion", choices=["completion", "chat"])
    parser.add_argument("--num-requests", type=int, default=200, help="per tree")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve(args.serve)
        return
    ports = [free_port() for _ in args.trees]
    servers = [  # this file run as a script: each tree's own packages come first on its path
        subprocess.Popen(
            [sys.executable, __file__, "--serve", str(port)], cwd=tree, env={**os.environ, "PYTHONPATH": tree}
        )
        for tree, port in zip(args.trees, ports)
    ]
    try:
        for port in ports:
            wait_for_port(port)
        load_before = os.getloadavg()[0]
        samples = asyncio.run(client(ports, args.kind, args.num_requests, args.warmup))
        print(
            f"{args.kind}: client send to first text chunk, load average {load_before:.2f}-{os.getloadavg()[0]:.2f}"
        )
        for tree, tree_samples in zip(args.trees, samples):
            ordered = sorted(tree_samples)
            p90 = ordered[int(0.9 * (len(ordered) - 1))]
            print(
                f"  {tree}: median {statistics.median(ordered):8.0f} us, p90 {p90:8.0f} us ({len(ordered)})"
            )
    finally:
        for server in servers:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
