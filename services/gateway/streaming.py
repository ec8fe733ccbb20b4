"""Server-sent events as OpenAI streams them: `data: {json}\\n\\n` per chunk, `data: [DONE]\\n\\n` last
(after a complete response only: a failed one ends with its error event)."""

from __future__ import annotations

from aiohttp import web
from pydantic import BaseModel

from services.gateway.errors import APIError

DONE = b"data: [DONE]\n\n"


class _HeadersWithFirstChunk(web.StreamResponse):
    """A stream whose status and headers go out with its first chunk, in one write, as aiohttp's own
    `web.Response` sends them: the client wakes once for both, not once for the headers and again
    for the first token."""

    _send_headers_immediately = False


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
        exclude = None if self.include_usage else {"usage"}
        await self.response.write(
            b"".join(b"data: " + body.model_dump_json(exclude=exclude).encode() + b"\n\n" for body in bodies)
        )

    async def fail(self, error: APIError) -> None:
        """A failure after the 200 went out: an error event (the OpenAI SDK raises on it), and the
        end of the stream without `[DONE]`, so even a client that skips error events cannot take
        the text for whole."""
        await self.response.write(b"data: " + error.body().model_dump_json().encode() + b"\n\n")
        await self.response.write_eof()

    async def done(self) -> None:
        await self.response.write(DONE)
        await self.response.write_eof()
