"""Tool calls on /v1/chat/completions: what `tool_choice` makes of a request, and the calls read
back out of the generated text, whole or as a stream of OpenAI deltas.

- `required`: the output is constrained to a JSON array of calls, `[{"name": ..., "parameters":
  {...}}]`, each call's parameters to its function's schema.
- a named function: the output is constrained to that function's parameters schema; it is the
  call's arguments.
- `auto`: the model writes calls its own way, and the gateway's `--tool-call-parser` finds them:
  `hermes` (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Qwen2.5 / Qwen3 emit) or
  `llama3_json` (the answer is `{"name": ..., "parameters": {...}}`, calls separated by `;`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from services.gateway.errors import APIError
from services.gateway.openai_api import (
    ChatDelta,
    FunctionCall,
    FunctionCallDelta,
    NamedToolChoice,
    ToolCall,
    ToolCallDelta,
)
from shared.structured_output import StructuredOutput, StructuredOutputError

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
LLAMA3_PYTHON_TAG = "<|python_tag|>"
_HERMES_CALL = re.compile(re.escape(HERMES_OPEN) + r"(.*?)" + re.escape(HERMES_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's tools shape its output."""

    mode: Literal["auto", "required", "named"]
    parser: str | None = None
    """`auto`: the parser that finds calls in the text."""
    function_name: str | None = None
    """`named`: the function called."""


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | NamedToolChoice | None,
    parser: str | None,
) -> tuple[ToolPlan | None, StructuredOutput | None]:
    """The request's plan and the grammar it needs (None, None: plain text). 400 for bad tools, a
    choice naming an unknown function, or `auto` without a parser."""
    if tool_choice is not None and tool_choice != "none" and not tools:
        raise APIError.bad_request("tool_choice needs tools", param="tool_choice")
    if not tools:
        return None, None
    functions = _functions(tools)
    choice = tool_choice or "auto"
    if choice == "none":
        return None, None
    if choice == "auto":
        if parser is None:
            raise APIError.bad_request(
                "tool_choice 'auto' needs the gateway started with --tool-call-parser "
                f"({' or '.join(TOOL_CALL_PARSERS)}); or use 'required', a named function or 'none'",
                param="tool_choice",
            )
        return ToolPlan("auto", parser=parser), None
    if choice == "required":
        return ToolPlan("required"), _grammar(_required_schema(functions), "tools")
    assert isinstance(choice, NamedToolChoice)
    name = choice.function.name
    if name not in functions:
        raise APIError.bad_request(
            f"tool_choice names function {name!r}, which is not among the tools ({', '.join(functions)})",
            param="tool_choice",
        )
    return ToolPlan("named", function_name=name), _grammar(functions[name], "tools")


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Function name -> parameters schema, each tool checked."""
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise APIError.bad_request(
                "each tool must be {'type': 'function', 'function': {...}}", param=f"tools.{i}"
            )
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise APIError.bad_request(
                "a function needs a name of 1-64 letters, digits, '_', '.' or '-'",
                param=f"tools.{i}.function.name",
            )
        if name in functions:
            raise APIError.bad_request(f"two tools are named {name!r}", param=f"tools.{i}.function.name")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise APIError.bad_request(
                "a function's parameters must be a JSON Schema object", param=f"tools.{i}.function.parameters"
            )
        functions[name] = parameters
    return functions


def _required_schema(functions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, parameters in functions.items()
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


def _grammar(schema: dict[str, Any], param: str) -> StructuredOutput:
    try:
        structured = StructuredOutput.json_schema(schema)
        structured.check()
    except StructuredOutputError as exc:
        raise APIError.bad_request(f"a tool's parameters schema: {exc}", param=param) from None
    return structured


# ---- reading calls back -------------------------------------------------------------------------------


@dataclass
class ParsedCall:
    name: str
    arguments: str
    """JSON text."""
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def tool_call(self) -> ToolCall:
        return ToolCall(id=self.id, function=FunctionCall(name=self.name, arguments=self.arguments))


def parse_tool_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ParsedCall]]:
    """(the text left as content, or None; the calls) of a whole answer."""
    if plan.mode == "named":
        assert plan.function_name is not None
        return None, [ParsedCall(plan.function_name, text)]
    if plan.mode == "required":
        calls = _calls_from_objects(_json_or_none(text), "parameters")
        return (None, calls) if calls else (text, [])
    if plan.parser == "hermes":
        return _parse_hermes(text)
    return _parse_llama3_json(text)


def _parse_hermes(text: str) -> tuple[str | None, list[ParsedCall]]:
    calls: list[ParsedCall] = []
    content = text
    for match in _HERMES_CALL.finditer(text):
        found = _calls_from_objects([_json_or_none(match.group(1).strip())], "arguments")
        if found:
            calls += found
            content = content.replace(match.group(0), "", 1)
    return (content.strip() or None) if calls else text, calls


def _parse_llama3_json(text: str) -> tuple[str | None, list[ParsedCall]]:
    body = text.strip().removeprefix(LLAMA3_PYTHON_TAG).strip()
    objects: list[Any] = []
    decoder = json.JSONDecoder()
    at = 0
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return text, []
        objects.append(value)
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    calls = _calls_from_objects(objects, "parameters")
    return (None, calls) if calls and len(calls) == len(objects) else (text, [])


def _calls_from_objects(objects: Any, arguments_key: str) -> list[ParsedCall]:
    """Calls from decoded `{"name": ..., arguments_key: {...}}` objects (either key accepted);
    empty unless every object is one."""
    if not isinstance(objects, list):
        return []
    calls = []
    for obj in objects:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return []
        arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
        calls.append(ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


# ---- streaming ----------------------------------------------------------------------------------------


@dataclass
class CallHeader:
    """A call's name is known: its first delta (index, id, type, name) can go out."""

    call: ParsedCall


@dataclass
class ArgumentsFragment:
    """More of the arguments' JSON text of the call opened last, as the model wrote it."""

    text: str


class CallScanner:
    """Reads `{"name": ..., "parameters" | "arguments": ...}` objects out of JSON text as it arrives:
    each call's header once its name is read, then its arguments' text as it comes (arguments
    written before the name go out once the name is read). Call objects sit `call_depth`
    brackets deep: 2 in `required`'s array, 1 for llama3_json's calls separated by `;`. One pass over
    each character, whatever the number of feeds."""

    def __init__(self, call_depth: int):
        self.call_depth = call_depth
        self.text = ""
        self.failed = False
        """Text that is not a call where one should be (not JSON, an object without a name)."""
        self.num_calls = 0
        self.last_call_end = 0
        """Where the last whole call object ended in `text`."""
        self._pos = 0
        self._depth = 0
        self._in_string = self._escape = False
        self._start_object()

    def _start_object(self) -> None:
        self._token_start = -1  # the object-level string or scalar being read
        self._key: str | None = None
        self._after_colon = False
        self._args_start = self._args_end = -1
        self._sent = 0  # argument characters out so far
        self._header: ParsedCall | None = None

    @property
    def in_call(self) -> bool:
        """Whether the scanner is inside a call whose header went out."""
        return self._header is not None

    def feed(self, text: str) -> list[CallHeader | ArgumentsFragment]:
        self.text += text
        events: list[CallHeader | ArgumentsFragment] = []
        while self._pos < len(self.text) and not self.failed:
            self._step(self.text[self._pos], self._pos, events)
            self._pos += 1
        if self._header is not None and self._args_start >= 0:
            events += self._arguments(len(self.text))
        return events

    def _step(self, c: str, i: int, events: list[CallHeader | ArgumentsFragment]) -> None:
        level = self.call_depth  # the depth of a call object's keys and values
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if self._depth == level:
                    self._object_string(self.text[self._token_start : i + 1], events)
            return
        if c == '"':
            self._in_string = True
            if self._depth == level:
                self._token_start = i
                self._value_starts(i)
        elif c in "{[":
            self._depth += 1
            if self._depth == level and c == "{":
                self._start_object()
            elif self._depth == level and c == "[" or self._depth < level and c == "{":
                self.failed = True
            elif self._depth == level + 1:
                self._value_starts(i)
        elif c in "}]":
            if self._depth == level + 1 and self._key_is_arguments() and self._args_end < 0:
                self._args_end = i + 1
            if self._depth == level:
                self._value_ends(i)
                if c == "}":
                    self._close_object(i, events)
            self._depth -= 1
            self.failed |= self._depth < 0
        elif self._depth == level:
            self._object_punctuation(c, i)
        elif self._depth < level and not c.isspace() and c not in ",;":
            self.failed = True

    def _object_punctuation(self, c: str, i: int) -> None:
        if c == ":":
            self._after_colon = True
        elif c == ",":
            self._value_ends(i)
            self._key, self._after_colon = None, False
        elif not c.isspace():
            self._value_starts(i)

    def _value_starts(self, i: int) -> None:
        if self._after_colon and self._key_is_arguments() and self._args_start < 0:
            self._args_start = i

    def _value_ends(self, i: int) -> None:
        if self._key_is_arguments() and self._args_start >= 0 and self._args_end < 0:
            self._args_end = i

    def _key_is_arguments(self) -> bool:
        return self._key in ("parameters", "arguments") and self._after_colon

    def _object_string(self, literal: str, events: list[CallHeader | ArgumentsFragment]) -> None:
        value = _json_or_none(literal)
        if not self._after_colon:
            self._key = value if isinstance(value, str) else None
        elif self._key == "name" and isinstance(value, str) and self._header is None:
            self._header = ParsedCall(value, "")
            events.append(CallHeader(self._header))

    def _close_object(self, i: int, events: list[CallHeader | ArgumentsFragment]) -> None:
        if self._header is None:
            self.failed = True
            return
        events += self._arguments(i) if self._args_start >= 0 else [ArgumentsFragment("{}")]
        self.num_calls += 1
        self.last_call_end = i + 1
        self._start_object()

    def _arguments(self, end: int) -> list[ArgumentsFragment]:
        if self._args_end >= 0:
            fragment = self.text[self._args_start + self._sent : self._args_end]
        else:  # whitespace at the end may be the value's last: it goes out with what follows it
            fragment = self.text[self._args_start + self._sent : end].rstrip()
        self._sent += len(fragment)
        return [ArgumentsFragment(fragment)] if fragment else []


class ToolCallStream:
    """Turns one choice's text deltas into OpenAI deltas: content as it comes, and each call as a
    delta with its index, id, type and name as soon as its name is generated, then its arguments
    as they are (`required`, named functions, llama3_json; a hermes call goes out once its closing
    tag is read). Text that may open a call is held back until it is known not to. A call cut off
    by max_tokens has sent the arguments it got."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.num_calls = 0
        self._held = ""
        self._scanner: CallScanner | None = CallScanner(call_depth=2) if plan.mode == "required" else None
        self._passthrough = False
        """llama3_json: the answer did not open with a call, so it is all content."""

    def feed(self, text: str) -> list[ChatDelta]:
        if self.plan.mode == "named":
            return self._named(text)
        self._held += text
        if self._scanner is not None:
            return self._scan(text)
        if self._passthrough:
            return self._content_so_far()
        if self.plan.parser == "llama3_json":
            return self._llama3_json()
        return self._hermes()

    def finish(self) -> list[ChatDelta]:
        """What is left once the answer ended: held text as content (or as calls, where the whole
        answer parses as calls although the scan found none)."""
        held, self._held = self._held, ""
        if self.plan.mode == "named":
            return []
        scanner = self._scanner
        if scanner is not None and scanner.num_calls + scanner.in_call > 0:
            # after calls: text that is no call is content; a call cut short, or the start of one, is not
            rest = scanner.text[scanner.last_call_end :].strip(" \t\r\n;,]")
            return [ChatDelta(content=rest)] if rest and scanner.failed and not scanner.in_call else []
        if not held:
            return []
        content, calls = parse_tool_calls(self.plan, held)
        deltas = [ChatDelta(content=content)] if content else []
        return deltas + [d for call in calls for d in self._call_deltas(call)]

    def _scan(self, text: str) -> list[ChatDelta]:
        assert self._scanner is not None
        deltas = []
        for event in self._scanner.feed(text):
            if isinstance(event, CallHeader):
                deltas.append(self._header(event.call, self.num_calls))
                self.num_calls += 1
            else:
                deltas.append(self._arguments(self.num_calls - 1, event.text))
        return deltas

    def _named(self, text: str) -> list[ChatDelta]:
        deltas = []
        if self.num_calls == 0:
            assert self.plan.function_name is not None
            deltas.append(self._header(ParsedCall(self.plan.function_name, "")))
            self.num_calls = 1
        if text:
            deltas.append(self._arguments(0, text))
        return deltas

    def _llama3_json(self) -> list[ChatDelta]:
        stripped = self._held.lstrip()
        if not stripped:
            return []
        if stripped.startswith(LLAMA3_PYTHON_TAG):
            body = stripped[len(LLAMA3_PYTHON_TAG) :]
        elif stripped.startswith("{"):
            body = stripped
        elif LLAMA3_PYTHON_TAG.startswith(stripped):
            return []  # the tag, or the start of it
        else:
            self._passthrough = True
            return self._content_so_far()
        self._scanner = CallScanner(call_depth=1)
        return self._scan(body)

    def _hermes(self) -> list[ChatDelta]:
        deltas: list[ChatDelta] = []
        while True:
            start = self._held.find(HERMES_OPEN)
            if start < 0:
                keep = _partial_suffix(self._held, HERMES_OPEN)
                if len(self._held) > keep:
                    deltas.append(ChatDelta(content=self._held[: len(self._held) - keep]))
                    self._held = self._held[len(self._held) - keep :]
                return deltas
            if start > 0:
                deltas.append(ChatDelta(content=self._held[:start]))
                self._held = self._held[start:]
            end = self._held.find(HERMES_CLOSE)
            if end < 0:
                return deltas
            block, self._held = self._held[: end + len(HERMES_CLOSE)], self._held[end + len(HERMES_CLOSE) :]
            content, calls = _parse_hermes(block)
            deltas += [ChatDelta(content=content)] if content else []
            deltas += [d for call in calls for d in self._call_deltas(call)]

    def _content_so_far(self) -> list[ChatDelta]:
        held, self._held = self._held, ""
        return [ChatDelta(content=held)] if held else []

    def _call_deltas(self, call: ParsedCall) -> list[ChatDelta]:
        index = self.num_calls
        self.num_calls += 1
        return [self._header(call, index), self._arguments(index, call.arguments)]

    @staticmethod
    def _header(call: ParsedCall, index: int = 0) -> ChatDelta:
        function = FunctionCallDelta(name=call.name, arguments="")
        return ChatDelta(
            tool_calls=[ToolCallDelta(index=index, id=call.id, type="function", function=function)]
        )

    @staticmethod
    def _arguments(index: int, fragment: str) -> ChatDelta:
        return ChatDelta(
            tool_calls=[ToolCallDelta(index=index, function=FunctionCallDelta(arguments=fragment))]
        )


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a start of `marker` (it may open one)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
