"""The SSE writer: whole chunks per write, the status and headers in the first one."""

from __future__ import annotations

import asyncio
from unittest import mock

from aiohttp.http_writer import StreamWriter
from aiohttp.test_utils import make_mocked_request

from services.gateway.openai_api import Completion, CompletionChoice
from services.gateway.streaming import EventStream


def _chunk(text: str) -> Completion:
    return Completion(
        id="cmpl-1", created=0, model="m", choices=[CompletionChoice(index=0, text=text, logprobs=None)]
    )


def _recording_request() -> tuple[mock.Mock, object]:
    """A request whose connection records what is written to it, write by write."""
    transport = mock.Mock(spec=["write", "writelines", "is_closing", "get_extra_info"])
    transport.is_closing.return_value = False
    protocol = mock.Mock(transport=transport)
    writer = StreamWriter(protocol, asyncio.get_running_loop())
    return transport, make_mocked_request(
        "POST", "/v1/completions", writer=writer, protocol=protocol, transport=transport
    )


def _writes(transport: mock.Mock) -> list[bytes]:
    written = []
    for call in transport.method_calls:
        if call[0] == "write":
            written.append(bytes(call.args[0]))
        elif call[0] == "writelines":
            written.append(b"".join(bytes(part) for part in call.args[0]))
    return written


async def test_headers_and_first_chunks_go_out_in_one_write() -> None:
    transport, request = _recording_request()
    sse = EventStream(include_usage=False)
    await sse.start(request)  # type: ignore[arg-type]
    assert _writes(transport) == []
    await sse.send(_chunk("Hello"), _chunk(", world"))
    [first] = _writes(transport)
    assert first.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b'data: {"id":"cmpl-1"' in first and first.count(b"data: ") == 2
    await sse.send(_chunk("!"))
    assert len(_writes(transport)) == 2


async def test_a_first_send_without_chunks_still_sends_the_headers() -> None:
    transport, request = _recording_request()
    sse = EventStream(include_usage=False)
    await sse.start(request)  # type: ignore[arg-type]
    await sse.send()
    [first] = _writes(transport)
    assert first.startswith(b"HTTP/1.1 200 OK\r\n") and b"data: " not in first
