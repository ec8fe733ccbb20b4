"""The SSE writer: whole chunks per write, the status and headers in the first one; a text delta's
event from its choice's template is the one serializing its body gives."""

from __future__ import annotations

import asyncio
from unittest import mock

import pytest
from aiohttp.http_writer import StreamWriter
from aiohttp.test_utils import make_mocked_request

from services.gateway.openai_api import Completion, CompletionChoice
from services.gateway.prepare import Job, ServedModel
from services.gateway.render import ChoiceState, Renderer, TokenText
from services.gateway.streaming import DeltaTemplate, EventStream, event_bytes
from shared.protocol import GenerateRequest, TokenEvent, TokenLogprob
from shared.sampling_params import SamplingParams


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


TEXTS = [
    "x",
    " wörld ✓ 你好 😀",
    'a"b\\c\n\t\x00\x1f\x7f',
    "\u2028\u2029</script>",
    DeltaTemplate.PLACEHOLDER,
]


def job(kind: str, include_usage: bool, logprobs: int | None = None) -> Job:
    request = GenerateRequest(request_id="cmpl-1-0", prompt_token_ids=[1], params=SamplingParams())
    return Job(kind, "cmpl-1", 1700000000, [request], 1, True, include_usage, logprobs)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_delta_from_the_template_is_the_serialized_chunk(
    served: ServedModel, kind: str, include_usage: bool
) -> None:
    renderer = Renderer(job(kind, include_usage), 'model "x"', TokenText(served.tokenizer))
    choice = ChoiceState(0)
    for text in TEXTS:
        event = TokenEvent("cmpl-1-0", [5], text, num_output_tokens=1)
        chunk = renderer.chunk(choice, event)
        assert chunk is not None
        assert renderer.delta_event(choice, event) == event_bytes(chunk, include_usage)


def test_events_beyond_a_text_delta_get_no_template(served: ServedModel) -> None:
    renderer = Renderer(job("completion", False), "m", TokenText(served.tokenizer))
    choice = ChoiceState(0)
    assert renderer.delta_event(choice, TokenEvent("r", [5], "", num_output_tokens=1)) is None
    ended = TokenEvent("r", [5], "x", finished=True, finish_reason="stop", num_output_tokens=1)
    assert renderer.delta_event(choice, ended) is None
    with_logprobs = Renderer(job("completion", False, logprobs=1), "m", TokenText(served.tokenizer))
    event = TokenEvent("r", [5], "x", [TokenLogprob(token_id=5, logprob=-0.5)], num_output_tokens=1)
    assert with_logprobs.delta_event(choice, event) is None
