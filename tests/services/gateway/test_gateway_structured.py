"""Structured output and tools at the gateway, through the official `openai` SDK: the grammar a
request asks for reaches the mesh, bad grammars and tools are 400s, and tool calls come back as
OpenAI shapes them, whole and streamed."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from gateway_fake_backend import MODEL_NAME, ClientFactory, InProcessBackend, reply_script

from services.gateway.prepare import ServedModel
from services.gateway.tool_calls import ToolCallStream, ToolPlan, parse_tool_calls
from shared.structured_output import StructuredOutput

openai = pytest.importorskip("openai")

MESSAGES: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time"}},
]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture
def served(make_checkpoint: Any, request: pytest.FixtureRequest) -> ServedModel:
    """The gateway's model, with the tool-call parser a test names (`indirect`), hermes if none."""
    parser = getattr(request, "param", "hermes")
    return ServedModel.load(make_checkpoint("llama"), name=MODEL_NAME, tool_call_parser=parser)


@pytest.fixture
async def sdk(make_client: ClientFactory) -> AsyncIterator[Any]:
    client = await make_client()
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="none", max_retries=0, timeout=10)
    yield sdk
    await sdk.close()


def answer(backend: InProcessBackend, served: ServedModel, text: str) -> None:
    backend.script = reply_script(served.tokenizer, text)


async def test_response_format_json_schema_reaches_the_mesh(
    sdk: Any, backend: InProcessBackend, served
) -> None:
    answer(backend, served, '{"ok": true}')
    chat = await sdk.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "r", "schema": SCHEMA, "strict": True},
        },
    )
    assert json.loads(chat.choices[0].message.content) == {"ok": True}
    assert backend.submitted[0].params.structured == StructuredOutput.json_schema(SCHEMA, strict=True)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"response_format": {"type": "json_object"}}, StructuredOutput(kind="json_object")),
        ({"response_format": {"type": "text"}}, None),
        ({"guided_json": SCHEMA}, StructuredOutput.json_schema(SCHEMA)),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput.json_schema(SCHEMA)),
        ({"guided_regex": "[a-z]+"}, StructuredOutput(kind="regex", spec="[a-z]+")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutput.choice(["yes", "no"])),
    ],
)
async def test_completions_take_every_form(sdk: Any, backend: InProcessBackend, extra, expected) -> None:
    await sdk.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4, extra_body=extra)
    assert backend.submitted[0].params.structured == expected


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"guided_regex": "[a-z"}, "guided_regex", "invalid regex"),
        ({"guided_json": {"type": "objekt"}}, "guided_json", 'Unsupported type "objekt"'),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "at most one of"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope'",
        ),
        ({"tools": [{"type": "function", "function": {}}]}, "tools.0.function.name", "needs a name"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0", "type"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ],
)
async def test_bad_grammars_and_tools_are_400s(sdk: Any, extra, param: str, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await sdk.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, extra_body=extra)
    error = caught.value.body
    assert error["param"] == param and message in error["message"], error


async def test_auto_without_a_parser_is_a_400(make_client: ClientFactory, served: ServedModel) -> None:
    from dataclasses import replace

    from aiohttp.test_utils import TestClient, TestServer

    from services.gateway.app import GatewaySettings, create_app

    app = create_app(
        replace(served, tool_call_parser=None),
        InProcessBackend(reply_script(served.tokenizer)),
        GatewaySettings(),
    )
    async with TestClient(TestServer(app)) as client:
        response = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS})
        body = await response.json()
    assert response.status == 400 and "--tool-call-parser" in body["error"]["message"]


async def test_named_tool_choice_constrains_and_returns_the_call(sdk: Any, backend, served) -> None:
    answer(backend, served, '{"city": "Paris", "unit": "c"}')
    choice = {"type": "function", "function": {"name": "get_weather"}}
    chat = await sdk.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=choice
    )
    assert backend.submitted[0].params.structured == StructuredOutput.json_schema(WEATHER_PARAMETERS)
    [call] = chat.choices[0].message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "c"}
    assert chat.choices[0].message.content is None and chat.choices[0].finish_reason == "tool_calls"


async def test_required_tool_choice_constrains_to_an_array_of_calls(sdk: Any, backend, served) -> None:
    answer(
        backend,
        served,
        '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]',
    )
    chat = await sdk.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required"
    )
    structured = backend.submitted[0].params.structured
    assert structured is not None and json.loads(structured.spec)["minItems"] == 1
    calls = chat.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_time", {}),
        ("get_weather", {"city": "Oslo"}),
    ]


HERMES_ANSWER = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


async def test_auto_parses_hermes_calls(sdk: Any, backend, served) -> None:
    answer(backend, served, HERMES_ANSWER)
    chat = await sdk.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS)
    assert backend.submitted[0].params.structured is None
    message = chat.choices[0].message
    assert message.content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert chat.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("served", ["llama3_json", "hermes"], indirect=True)
async def test_required_and_llama3_json_calls_stream_through_the_sdk(
    sdk: Any, backend: InProcessBackend, served: ServedModel
) -> None:
    """Through a live gateway and the openai SDK's stream: each call's id and name arrive in a chunk
    of their own before its arguments, which come in several chunks as the tokens do (`required`
    with either parser; llama3_json's own calls under `auto`)."""
    parser = served.tool_call_parser
    cases: list[tuple[Any, str]] = [("required", REQUIRED_ANSWER)]
    if parser == "llama3_json":
        cases.append(("auto", '<|python_tag|>{"name": "get_time", "parameters": {}}; ' + WEATHER_CALL))
    for tool_choice, text in cases:
        answer(backend, served, text)
        stream = await sdk.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, stream=True
        )
        chunks = [chunk async for chunk in stream]
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        _, whole = parse_tool_calls(ToolPlan(tool_choice, parser=parser), text)
        calls = streamed_calls(deltas)
        assert [(n, json.loads(a)) for n, a in calls] == [(c.name, json.loads(c.arguments)) for c in whole]
        pieces = [(i, p) for i, d in enumerate(deltas) for p in d.tool_calls or []]
        weather = next(p.index for _, p in pieces if p.function.name == "get_weather")
        chunk_indices = [i for i, p in pieces if p.index == weather]
        assert len(set(chunk_indices)) >= 3  # the header, then arguments over several chunks
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert not streamed_content(deltas)


@pytest.mark.parametrize("tool_choice", ["auto", "named"])
async def test_tool_calls_stream_as_openai_streams_them(sdk: Any, backend, served, tool_choice: str) -> None:
    if tool_choice == "auto":
        answer(backend, served, HERMES_ANSWER)
        choice: Any = "auto"
    else:
        answer(backend, served, '{"city": "Paris"}')
        choice = {"type": "function", "function": {"name": "get_weather"}}
    stream = await sdk.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=choice, stream=True
    )
    chunks = [chunk async for chunk in stream]
    deltas = [c.choices[0].delta for c in chunks]
    pieces = [call for d in deltas for call in d.tool_calls or []]
    first = pieces[0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather"
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in pieces[1:])
    arguments = "".join(p.function.arguments or "" for p in pieces)
    assert json.loads(arguments) == {"city": "Paris"}
    content = "".join(d.content or "" for d in deltas)
    assert content == ("Let me look.\n" if tool_choice == "auto" else "")
    assert "<tool_call>" not in content
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


CUT_CALL = '{"name": "f", "parameters": {"a": 1'


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ('{"name": "f", "parameters": {"a": 1}}', None, [("f", {"a": 1})]),
        (
            '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": "x"}}',
            None,
            [("f", {}), ("g", {"b": "x"})],
        ),
        ("Plain answer {not a call}", "Plain answer {not a call}", []),
        (CUT_CALL, CUT_CALL, []),
    ],
)
def test_llama3_json_parser_whole_and_streamed(text: str, content: str | None, calls: list) -> None:
    plan = ToolPlan("auto", parser="llama3_json")
    found_content, found = parse_tool_calls(plan, text)
    assert found_content == content
    assert [(c.name, json.loads(c.arguments)) for c in found] == calls
    deltas = stream_in_pieces(ToolCallStream(plan), text, 5)
    if text == CUT_CALL:  # streamed as it came: the call and the arguments it got
        assert streamed_calls(deltas) == [("f", '{"a": 1')] and not streamed_content(deltas)
        return
    assert streamed_content(deltas) == (content or "")
    assert [(name, json.loads(arguments)) for name, arguments in streamed_calls(deltas)] == calls


def stream_in_pieces(stream: ToolCallStream, text: str, size: int) -> list[Any]:
    return [d for i in range(0, len(text), size) for d in stream.feed(text[i : i + size])] + stream.finish()


def streamed_content(deltas: list[Any]) -> str:
    return "".join(d.content or "" for d in deltas)


def streamed_calls(deltas: list[Any]) -> list[tuple[str, str]]:
    """(name, arguments text) per call index, from OpenAI tool-call deltas: the first piece of a
    call carries its id, type and name, the rest only argument fragments."""
    calls: dict[int, list[str]] = {}
    for piece in [p for d in deltas for p in d.tool_calls or []]:
        if piece.index not in calls:
            assert piece.id.startswith("call_") and piece.type == "function" and piece.function.name
            calls[piece.index] = [piece.function.name, ""]
        else:
            assert piece.id is None and piece.function.name is None
        calls[piece.index][1] += piece.function.arguments or ""
    assert list(calls) == list(range(len(calls)))
    return [(name, arguments) for name, arguments in calls.values()]


WEATHER_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
REQUIRED_ANSWER = "[" + WEATHER_CALL + ', {"name": "get_time", "parameters": {}}]'


@pytest.mark.parametrize(
    ("plan", "text"),
    [
        (ToolPlan("required"), REQUIRED_ANSWER),
        (ToolPlan("auto", parser="llama3_json"), WEATHER_CALL),
        (ToolPlan("auto", parser="llama3_json"), ' {"parameters": {"city": "Paris"}, "name": "get_weather"}'),
    ],
)
def test_calls_stream_their_name_first_then_their_arguments_as_they_come(plan: ToolPlan, text: str) -> None:
    """Character by character: a call's header goes out as soon as its name is read, before the
    rest of its arguments exist; the fragments join to the arguments of the whole answer (arguments
    written before the name go out with it)."""
    stream = ToolCallStream(plan)
    steps = [stream.feed(c) for c in text] + [stream.finish()]
    _, whole = parse_tool_calls(plan, text)
    calls = streamed_calls([d for deltas in steps for d in deltas])
    assert [(name, json.loads(arguments)) for name, arguments in calls] == [
        (c.name, json.loads(c.arguments)) for c in whole
    ]
    header_at = next(
        i for i, deltas in enumerate(steps) for d in deltas if d.tool_calls and d.tool_calls[0].id
    )
    assert header_at == text.index('"get_weather"') + len('"get_weather"') - 1
    fragments = [d for deltas in steps for d in deltas if d.tool_calls and not d.tool_calls[0].id]
    if text.index('"name"') < text.index('"parameters"'):
        assert len(fragments) > 10  # arguments arrive as they are generated, not whole at the end
    assert not streamed_content([d for deltas in steps for d in deltas])


@pytest.mark.parametrize(
    ("plan", "text", "content", "calls"),
    [
        (ToolPlan("required"), '[{"name": "f", "parameters": {"a": 1}}, {"na', "", [("f", '{"a": 1}')]),
        (
            ToolPlan("auto", parser="llama3_json"),
            '{"name": "f", "parameters": {}} and then text',
            "and then text",
            [("f", "{}")],
        ),
        (ToolPlan("auto", parser="llama3_json"), '{"name": "f"}', "", [("f", "{}")]),
    ],
)
def test_what_follows_the_streamed_calls(plan: ToolPlan, text: str, content: str, calls: list) -> None:
    """After whole calls, a call cut off before its name sends nothing, text that is no call is
    content, and a call without arguments has arguments `{}`."""
    deltas = stream_in_pieces(ToolCallStream(plan), text, 3)
    assert streamed_calls(deltas) == calls
    assert streamed_content(deltas) == content


def test_hermes_stream_holds_back_a_marker_split_over_deltas() -> None:
    stream = ToolCallStream(ToolPlan("auto", parser="hermes"))
    text = "a <tool_c"
    assert [d.content for d in stream.feed(text)] == ["a "]
    rest = 'all>{"name": "f", "arguments": {}}</tool_call> b'
    deltas = stream.feed(rest) + stream.finish()
    assert [c.function.name for d in deltas for c in d.tool_calls or [] if c.function.name] == ["f"]
    assert "".join(d.content or "" for d in deltas) == " b"
