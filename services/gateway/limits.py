"""What one client may take of the gateway before its request is parsed: body bytes, the time to
send them, and requests in flight per API key.

A body's length is checked before any of it is parsed or tokenized (its Content-Length at once, a
chunked body as it arrives), and it must arrive within `body_timeout_s`: a client that sends slowly
holds one connection, never the event loop or the memory of a whole body. The limits on a request's
fields (prompt tokens, `n`, stop strings, `max_tokens`, `logprobs`) are checked with the fields, in
`openai_api` and `prepare`.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web

from services.gateway.errors import APIError

BODY_BYTES_PER_TOKEN = 16
"""Body bytes allowed per token of context: above what one token costs in JSON (a `\\u4f60` escape
is 6 bytes, a token id up to 7 with its comma, a chat message's framing a few per token)."""
BODY_HEADROOM_BYTES = 2**20
"""Body bytes allowed beyond the prompt: the other fields, many short chat messages."""
DEFAULT_BODY_TIMEOUT_S = 30.0
LINGERING_TIME_S = 2.0
"""After an early answer (413, 408), how long the rest of a body is read and dropped before the
connection closes; closing at once with unread data makes the kernel reset it, and the client
may lose the answer."""
DEFAULT_KEEPALIVE_TIMEOUT_S = 30.0


def default_max_body_bytes(max_model_len: int) -> int:
    """Room for one prompt of the whole context, not for an unbounded one."""
    return BODY_BYTES_PER_TOKEN * max_model_len + BODY_HEADROOM_BYTES


async def read_body(request: web.Request, max_bytes: int, timeout_s: float) -> bytes:
    """The request's body: 413 past `max_bytes` before any of it is parsed, 408 if it has not
    arrived within `timeout_s`; either closes the connection."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise body_too_large(max_bytes, f"Content-Length is {request.content_length}")
    body = bytearray()
    try:
        await asyncio.wait_for(_read_into(request, body, max_bytes), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within the body timeout of {timeout_s:g} s "
            f"({len(body)} bytes came)",
            close_connection=True,
        ) from None
    return bytes(body)


async def _read_into(request: web.Request, body: bytearray, max_bytes: int) -> None:
    async for chunk in request.content.iter_any():
        body += chunk
        if len(body) > max_bytes:
            raise body_too_large(max_bytes, f"more than {max_bytes} bytes came")


def body_too_large(max_bytes: int, seen: str) -> APIError:
    return APIError(
        413,
        f"the request body is larger than this gateway's body limit of {max_bytes} bytes ({seen})",
        close_connection=True,
    )


class KeyConcurrency:
    """Generation requests in flight per API key; past `limit` a request gets 429 (0: no limit).
    Per gateway process: `--workers N` lets a key have N times as many."""

    def __init__(self, limit: int):
        self.limit = limit
        self._in_flight: Counter[str] = Counter()

    @contextmanager
    def hold(self, key: str) -> Iterator[None]:
        if self.limit and self._in_flight[key] >= self.limit:
            raise APIError(
                429,
                f"this API key already has {self._in_flight[key]} requests in flight, "
                f"the limit per key ({self.limit}); retry when one has finished",
            )
        self._in_flight[key] += 1
        try:
            yield
        finally:
            self._in_flight[key] -= 1
            if not self._in_flight[key]:
                del self._in_flight[key]
