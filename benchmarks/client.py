"""The online benchmark's load generator: an OpenAI-style streaming client and the arrival process.

Requests arrive as a Poisson process at `request_rate` (exponential gaps, seeded), or all at once;
`concurrency` caps how many are in flight (a closed loop when no rate is given). Each request
streams `/v1/completions` with `stream_options.include_usage`, so the last chunk carries the token
counts and the `usage.speculative` extension.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from tqdm import tqdm

from benchmarks.dataset import BenchRequest
from benchmarks.metrics import RequestRecord, SpecCounts
from shared.structured_output import StructuredOutput

Send = Callable[[BenchRequest], Awaitable[RequestRecord]]


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int | None = None
    top_p: float = 1.0
    structured: StructuredOutput | None = None
    """The grammar every output follows (the offline benchmark's `--json-schema`)."""


def arrival_offsets(num_requests: int, request_rate: float | None, seed: int = 0) -> list[float]:
    """Seconds after the start at which each request arrives: a Poisson process of `request_rate`
    requests per second, or every request at 0 when the rate is None or infinite."""
    if request_rate is None or request_rate == float("inf"):
        return [0.0] * num_requests
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(request_rate)
    return offsets


async def drive(
    requests: list[BenchRequest],
    send: Send,
    concurrency: int | None,
    request_rate: float | None,
    seed: int = 0,
    progress: tqdm | None = None,
) -> list[RequestRecord]:
    """Sends every request on its arrival schedule, at most `concurrency` at a time; records come
    back in request order. A request's clock starts when it is sent."""
    offsets = arrival_offsets(len(requests), request_rate, seed)
    limit = asyncio.Semaphore(concurrency or len(requests) or 1)
    started = time.perf_counter()

    async def one(request: BenchRequest, offset: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
        async with limit:
            record = await send(request)
        if progress is not None:
            progress.update(1)
        return record

    return list(await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets))))


class CompletionClient:
    """Streams completions from one OpenAI-compatible server."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        sampling: Sampling,
        model: str | None = None,
        speculative: dict[str, Any] | None = None,
        api_key: str | None = None,
    ):
        self.session = session
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.sampling = sampling
        self.model = model
        self.speculative = speculative
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def body(self, request: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": request.prompt,
            "max_tokens": request.max_tokens,
            "temperature": self.sampling.temperature,
            "ignore_eos": self.sampling.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        optional = {"model": self.model, "seed": self.sampling.seed, "speculative": self.speculative}
        body.update({k: v for k, v in optional.items() if v is not None})
        return body

    async def send(self, request: BenchRequest) -> RequestRecord:
        record = RequestRecord(request.id, request.workload, arrived_at=time.perf_counter())
        try:
            async with self.session.post(self.url, json=self.body(request), headers=self.headers) as response:
                if response.status != 200:
                    record.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                    return record
                await self._read_stream(response, record)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        return record

    async def _read_stream(self, response: aiohttp.ClientResponse, record: RequestRecord) -> None:
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[len(b"data:") :].strip()
            if data == b"[DONE]":
                break
            now = time.perf_counter()
            chunk = json.loads(data)
            if "error" in chunk:
                record.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                return
            if any(choice.get("text") for choice in chunk.get("choices") or []):
                record.token_times.append(now)
            if chunk.get("usage"):
                _take_usage(record, chunk["usage"])
        record.finished_at = time.perf_counter()
        if not record.num_output_tokens:  # no usage chunk: count chunks (a lower bound)
            record.num_output_tokens = len(record.token_times)


def _take_usage(record: RequestRecord, usage: dict[str, Any]) -> None:
    record.num_prompt_tokens = int(usage.get("prompt_tokens") or 0)
    record.num_output_tokens = int(usage.get("completion_tokens") or 0)
    record.spec = SpecCounts.from_stats(usage.get("speculative"))
