"""An in-process mesh for the gateway's HTTP tests: scripted token events, no Redis."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp.test_utils import TestClient

from shared.protocol import ErrorInfo, GenerateRequest, TokenEvent, TokenLogprob
from shared.tokenizer import Tokenizer

MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 512
"""The test checkpoint's max_position_embeddings."""
ClientFactory = Callable[..., Awaitable[TestClient[Any, Any]]]

REPLY = "Hello, wörld ✓ 你好! def add(a, b):\n    return a + b\n"
"""What the default script answers: multi-byte characters, some split over two tokens."""
TOKENS_PER_EVENT = (1, 3, 2)
"""Tokens per event cycle through these (speculative steps emit several at once)."""
SPEC_STATS = {"method": "ngram", "num_draft_tokens": 12, "num_accepted_tokens": 7, "num_verify_steps": 5}

Script = Callable[[GenerateRequest], AsyncIterator[TokenEvent]]


def reply_script(tokenizer: Tokenizer, reply: str = REPLY, delay_s: float = 0.0) -> Script:
    """Answers every request with (the first max_tokens tokens of) `reply`, decoded incrementally
    as a worker does: a token holding half a character gives no text until the other half comes."""
    reply_ids = tokenizer.encode(reply, add_special_tokens=False)

    async def script(request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        params = request.params
        token_ids = reply_ids[: params.max_tokens]
        decoder = tokenizer.decode_stream(request.prompt_token_ids)
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            prompt_ids = request.prompt_token_ids
            prompt_logprobs = [
                None,
                *(_logprob(t, params.prompt_logprobs, rank=1 + t % 3) for t in prompt_ids[1:]),
            ]
        start, step = 0, 0
        while start < len(token_ids):
            new_ids = token_ids[start : start + TOKENS_PER_EVENT[step % len(TOKENS_PER_EVENT)]]
            start += len(new_ids)
            step += 1
            finished = start == len(token_ids)
            yield TokenEvent(
                request_id=request.request_id,
                token_ids=new_ids,
                text=decoder.step(new_ids),
                logprobs=[_logprob(t, params.logprobs) for t in new_ids]
                if params.logprobs is not None
                else [],
                finished=finished,
                finish_reason=("length" if len(token_ids) < len(reply_ids) else "stop") if finished else None,
                num_output_tokens=start,
                spec_stats=SPEC_STATS if finished else {},
                prompt_logprobs=prompt_logprobs if step == 1 else None,
            )
            if delay_s:
                await asyncio.sleep(delay_s)

    return script


def events_script(texts: list[str]) -> Script:
    """One event per text delta, token id 5 + i each; the last one finishes."""

    async def script(request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        for i, text in enumerate(texts):
            last = i == len(texts) - 1
            yield TokenEvent(
                request_id=request.request_id,
                token_ids=[5 + i],
                text=text,
                finished=last,
                finish_reason="stop" if last else None,
                num_output_tokens=i + 1,
            )

    return script


def error_script(
    code: int, message: str = "the mesh is busy", after: int = 0, tokenizer: Tokenizer | None = None
) -> Script:
    """Answers with an error event, optionally after `after` token events."""

    async def script(request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        for i in range(after):
            yield TokenEvent(
                request_id=request.request_id, token_ids=[65 + i], text="A", num_output_tokens=i + 1
            )
        yield TokenEvent(
            request_id=request.request_id,
            finished=True,
            error=ErrorInfo(code=code, type="busy" if code == 429 else "error", message=message),
        )

    return script


def hanging_script(num_events: int = 1) -> Script:
    """A few events, then nothing (until the request is cancelled)."""

    async def script(request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        for i in range(num_events):
            yield TokenEvent(
                request_id=request.request_id, token_ids=[65 + i], text="A", num_output_tokens=i + 1
            )
        await asyncio.Event().wait()

    return script


class InProcessBackend:
    """`MeshBackend` whose requests are answered by a script; records what the gateway asked."""

    def __init__(self, script: Script, healthy: tuple[bool, str] = (True, "1 live worker(s)")):
        self.script = script
        self.healthy = healthy
        self.submitted: list[GenerateRequest] = []
        self.cancelled: list[tuple[str, str]] = []
        self.started = False
        self.closed = False
        self._cancel_seen: asyncio.Event | None = None

    async def start(self) -> None:
        self.started = True
        self._cancel_seen = asyncio.Event()

    async def close(self) -> None:
        self.closed = True

    async def submit(self, request: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        self.submitted.append(request)
        async for event in self.script(request):
            yield event

    async def cancel(self, request_id: str, reason: str = "client disconnected") -> None:
        self.cancelled.append((request_id, reason))
        if self._cancel_seen is not None:
            self._cancel_seen.set()

    async def health(self) -> tuple[bool, str]:
        return self.healthy

    async def wait_cancelled(self, timeout_s: float = 5.0) -> None:
        assert self._cancel_seen is not None
        await asyncio.wait_for(self._cancel_seen.wait(), timeout_s)


def _logprob(token_id: int, top_n: int | None, rank: int | None = None) -> TokenLogprob:
    logprob = -0.1 - (token_id % 7) / 10
    top = [(token_id, logprob), *((t, logprob - 1.0 - i) for i, t in enumerate((10, 11, 12, 13)))]
    return TokenLogprob(token_id=token_id, logprob=logprob, top=top[: top_n or 0], rank=rank)


def sse_data(body: str) -> list[Any]:
    """The `data:` payloads of an SSE body: parsed JSON, and the final '[DONE]' as a string."""
    assert body.endswith("\n\n"), body[-50:]
    payloads: list[Any] = []
    for event in body.split("\n\n")[:-1]:
        assert event.startswith("data: "), event
        data = event.removeprefix("data: ")
        payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads
