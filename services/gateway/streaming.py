"""Server-sent events as OpenAI streams them: `data: {json}\\n\\n` per chunk, `data: [DONE]\\n\\n` last
(after a complete response only: a failed one ends with its error event)."""

from __future__ import annotations

import uuid

from aiohttp import web
from pydantic import BaseModel
from pydantic_core import to_json

from services.gateway.errors import APIError

DONE = b"data: [DONE]\n\n"


class _HeadersWithFirstChunk(web.StreamResponse):
    """A stream whose status and headers go out with its first chunk, in one write, as aiohttp's own
    `web.Response` sends them: the client wakes once for both, not once for the headers and again
    for the first token."""

    _send_headers_immediately = False


def event_bytes(body: BaseModel, include_usage: bool) -> bytes:
    """One SSE event of `body`."""
    exclude = None if include_usage else {"usage"}
    return b"data: " + body.model_dump_json(exclude=exclude).encode() + b"\n\n"


class DeltaTemplate:
    """The SSE event of a chunk that carries nothing but a text delta, serialized once around a
    placeholder: each delta's event is then the two halves around the text's JSON string, byte
    for byte what serializing a body holding it gives, for a copy instead of a body built and
    serialized per delta."""

    PLACEHOLDER = f"specmesh-delta-{uuid.uuid4().hex}"

    def __init__(self, body: BaseModel, include_usage: bool):
        """`body`: the chunk, its text `PLACEHOLDER` (which must occur in it once)."""
        head, placeholder, tail = event_bytes(body, include_usage).partition(to_json(self.PLACEHOLDER))
        if not placeholder or to_json(self.PLACEHOLDER) in tail:
            raise ValueError("the body must hold the placeholder once")
        self.head, self.tail = head, tail

    def event(self, text: str) -> bytes:
        return self.head + to_json(text) + self.tail


class EventStream:
    """One SSE response; each write holds whole chunks, so a chunk is never split across writes."""

    def __init__(self, include_usage: bool):
        self.include_usage = include_usage
        """OpenAI puts `usage: null` in every chunk only when the client asked for usage."""
        self.response = _HeadersWithFirstChunk(
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # nginx: do not buffer the stream
            }
        )

    async def start(self, request: web.Request) -> None:
        """The status and headers, held until the first `send` (which sends them with no chunks too)."""
        await self.response.prepare(request)

    async def send(self, *bodies: BaseModel) -> None:
        """`bodies` as chunks, in one write."""
        await self.response.write(b"".join(event_bytes(body, self.include_usage) for body in bodies))

    async def send_bytes(self, event: bytes) -> None:
        """A chunk already serialized (`event_bytes`, or a `DeltaTemplate`'s)."""
        await self.response.write(event)

    async def fail(self, error: APIError) -> None:
        """A failure after the 200 went out: an error event (the OpenAI SDK raises on it), and the
        end of the stream without `[DONE]`, so even a client that skips error events cannot take
        the text for whole."""
        await self.response.write(b"data: " + error.body().model_dump_json().encode() + b"\n\n")
        await self.response.write_eof()

    async def done(self) -> None:
        await self.response.write(DONE)
        await self.response.write_eof()
