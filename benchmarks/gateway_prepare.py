"""The gateway's time from a request body to its encoded `Submit`, piece by piece, in-process.

    python -m benchmarks.gateway_prepare --workload code_editing --num-requests 400

Each workload prompt becomes one streamed /v1/completions body and one /v1/chat/completions body
(a system and a user message) as `benchmarks.client` sends them. Timed on this process's event
loop, each piece alone: the JSON parse, the pydantic validation, a no-op hand-off to the prepare
pool, the chat template's rendering, the tokenizer's encode, the whole prepare (`completion_job` /
`chat_job`), and stamping and msgpack-encoding the `Submit`. Then the whole path, from raw bytes to
the encoded `Submit`, both ways the gateway can take it: `inline` (on the event loop, as a small
body without a grammar is) and `pooled` (parsed and prepared on the prepare pool, as before). The two
alternate request by request, so that the machine's load weighs on both alike. Medians and p90s in
microseconds. Last, through HTTP: from the client's send to the encoded `Submit`, on two gateway
apps in this process (one that prepares inline where it may, one with every body on the pool), each
answering with one token from a backend that only encodes the `Submit`; requests alternate between
the two.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from pydantic import BaseModel

from benchmarks.workloads import WORKLOADS, load_workload
from services.gateway.app import GatewaySettings, _parse, _parse_and_prepare, create_app
from services.gateway.openai_api import ChatCompletionRequest, CompletionRequest
from services.gateway.prepare import Job, ServedModel, chat_job, completion_job, render_chat
from shared.protocol import GenerateRequest, Submit, TokenEvent, encode
from shared.reference import default_model

SYSTEM_PROMPT = "You are a careful programmer."
STAMP = {"gateway_id": "gw-bench", "gateway_incarnation": "1"}
"""What `RedisBackend.submit` stamps on every request."""

Prepare = Callable[[Any, ServedModel], Job]
Case = tuple[str, type[BaseModel], Prepare, list[bytes]]
"""(name, request model, prepare function, raw bodies)."""


def completion_body(served: ServedModel, prompt: str, max_tokens: int) -> bytes:
    return json.dumps(
        {
            "model": served.name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()


def chat_body(served: ServedModel, prompt: str, max_tokens: int) -> bytes:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]
    return json.dumps(
        {
            "model": served.name,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
        }
    ).encode()


def encoded_submits(job: Job) -> list[bytes]:
    """The bus payloads of a job's requests, stamped as the gateway's backend stamps them."""
    return [encode(Submit(request=request.model_copy(update=STAMP))) for request in job.requests]


def timed_us(work: Callable[..., object], *args: Any) -> float:
    started = time.perf_counter()
    work(*args)
    return (time.perf_counter() - started) * 1e6


async def timed_async_us(work: Callable[..., Awaitable[object]], *args: Any) -> float:
    started = time.perf_counter()
    await work(*args)
    return (time.perf_counter() - started) * 1e6


def summary(samples: list[float]) -> str:
    ordered = sorted(samples)
    return f"{statistics.median(ordered):8.1f} {ordered[int(0.9 * (len(ordered) - 1))]:8.1f}"


async def time_pieces(case: Case, served: ServedModel, pool: ThreadPoolExecutor) -> dict[str, list[float]]:
    name, model, prepare, bodies = case
    loop = asyncio.get_running_loop()
    pieces: dict[str, list[float]] = {}

    def add(piece: str, us: float) -> None:
        pieces.setdefault(piece, []).append(us)

    for raw in bodies:
        add("json parse", timed_us(json.loads, raw))
        add("pydantic validation", timed_us(model.model_validate_json, raw))
        add("pool hand-off (no-op)", await timed_async_us(loop.run_in_executor, pool, int))
        body = model.model_validate_json(raw)
        if isinstance(body, ChatCompletionRequest):
            add("chat template", timed_us(render_chat, body.messages, body, served))
            text = render_chat(body.messages, body, served)
            add("tokenizer encode", timed_us(served.tokenizer.encode, text, False))
        else:
            assert isinstance(body, CompletionRequest) and isinstance(body.prompt, str)
            add("tokenizer encode", timed_us(served.tokenizer.encode, body.prompt))
        add(f"{prepare.__name__} (whole)", timed_us(prepare, body, served))
        job = prepare(body, served)
        add("stamp + msgpack Submit", timed_us(encoded_submits, job))
    return pieces


async def time_paths(case: Case, served: ServedModel, pool: ThreadPoolExecutor) -> dict[str, list[float]]:
    """Raw bytes to encoded Submits, inline and pooled, alternating (which goes first alternates too)."""
    _, model, prepare, bodies = case
    loop = asyncio.get_running_loop()

    async def inline(raw: bytes) -> list[bytes]:
        return encoded_submits(prepare(_parse(raw, model), served))

    async def pooled(raw: bytes) -> list[bytes]:
        job = await loop.run_in_executor(pool, _parse_and_prepare, raw, model, prepare, served)
        return encoded_submits(job)

    paths = {"inline": inline, "pooled": pooled}
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for i, raw in enumerate(bodies):
        order = list(paths) if i % 2 == 0 else list(reversed(paths))
        for name in order:
            samples[name].append(await timed_async_us(paths[name], raw))
    return samples


class EncodingBackend:
    """A mesh that encodes each `Submit` as `RedisBackend` does, notes when, and answers one token."""

    def __init__(self, token_id: int):
        self.token_id = token_id
        self.encoded_at: list[float] = []

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def submit(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        encode(Submit(request=request.model_copy(update=STAMP)))
        self.encoded_at.append(time.perf_counter())
        yield TokenEvent(request.request_id, [self.token_id], finished=True, finish_reason="length")

    async def cancel(self, request_id: str, reason: str = "client disconnected") -> None:
        pass

    async def health(self) -> tuple[bool, str]:
        return True, "no mesh: the benchmark answers"


async def time_http(case: Case, served: ServedModel) -> dict[str, list[float]]:
    """Client send to encoded Submit, through an inline-preparing gateway and an all-pooled one."""
    name, _, _, bodies = case
    path = "/v1/completions" if name == "completion" else "/v1/chat/completions"
    settings = {"inline": GatewaySettings(), "pooled": GatewaySettings(inline_prepare_bytes=0)}
    samples: dict[str, list[float]] = {way: [] for way in settings}
    backends = {way: EncodingBackend(served.tokenizer.encode("x")[-1]) for way in settings}
    clients = {
        way: TestClient(TestServer(create_app(served, backends[way], settings[way]))) for way in settings
    }
    for client in clients.values():
        await client.start_server()
    try:
        for i, raw in enumerate(bodies):
            for way in list(settings) if i % 2 == 0 else reversed(list(settings)):
                sent_at = time.perf_counter()
                response = await clients[way].post(
                    path, data=raw, headers={"Content-Type": "application/json"}
                )
                await response.read()
                assert response.status == 200, await response.text()
                samples[way].append((backends[way].encoded_at[-1] - sent_at) * 1e6)
    finally:
        for client in clients.values():
            await client.close()
    return samples


async def run(args: argparse.Namespace) -> None:
    served = ServedModel.load(args.model, max_model_len=args.max_model_len)
    prompts = [record.prompt for record in load_workload(args.workload)]
    prompts = [prompts[i % len(prompts)] for i in range(args.num_requests)]
    cases: list[Case] = [
        (
            "completion",
            CompletionRequest,
            completion_job,
            [completion_body(served, p, args.max_tokens) for p in prompts],
        ),
        ("chat", ChatCompletionRequest, chat_job, [chat_body(served, p, args.max_tokens) for p in prompts]),
    ]
    sizes = sorted(len(raw) for raw in cases[0][3])
    print(
        f"model {args.model}, workload {args.workload}, {args.num_requests} requests, completion bodies "
        f"{sizes[0]}-{sizes[-1]} bytes (median {sizes[len(sizes) // 2]}), "
        f"inline up to {GatewaySettings().inline_prepare_bytes} bytes, load average {os.getloadavg()[0]:.2f}"
    )
    with ThreadPoolExecutor(GatewaySettings().prepare_threads, thread_name_prefix="prepare") as pool:
        for case in cases:
            await time_pieces(case, served, pool)  # warm-up: template compiled, caches filled
            print(f"\n{case[0]}: piece, median us, p90 us")
            for piece, samples in (await time_pieces(case, served, pool)).items():
                print(f"  {piece:28s} {summary(samples)}")
            samples = await time_paths(case, served, pool)
            print(f"{case[0]}: body to encoded Submit, median us, p90 us")
            for name, path_samples in samples.items():
                print(f"  {name:28s} {summary(path_samples)}")
            ratio = statistics.median(samples["inline"]) / statistics.median(samples["pooled"])
            print(f"  inline / pooled median      {ratio:8.2f}x")
        for case in cases:
            samples = await time_http(case, served)
            print(f"\n{case[0]}: through HTTP, client send to encoded Submit, median us, p90 us")
            for name, path_samples in samples.items():
                print(f"  {name:28s} {summary(path_samples)}")
            ratio = statistics.median(samples["inline"]) / statistics.median(samples["pooled"])
            print(f"  inline / pooled median      {ratio:8.2f}x")
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=default_model())
    parser.add_argument("--workload", default="code_editing", choices=WORKLOADS)
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's config.json")
    args = parser.parse_args(argv)
    if args.num_requests < 1:
        parser.error("--num-requests must be at least 1")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
