"""schemathesis checks of the gateway's own, loaded by `test_gateway_fuzz` (SCHEMATHESIS_HOOKS)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema_rs
import schemathesis

SSE_MEDIA_TYPE = "text/event-stream"


@schemathesis.check
def sse_data_conformance(ctx: Any, response: Any, case: Any) -> bool | None:
    """A streamed answer ends within the request timeout, with `[DONE]` or with an error event, and
    its every `data:` payload is valid against the `contentSchema` the document gives it
    (schemathesis checks each event's shape, not the JSON inside)."""
    if not _content_type(response).startswith(SSE_MEDIA_TYPE):
        return None
    if response.stream_cut_short:  # the run allows more events than any stream sends: it timed out
        raise AssertionError("the event stream did not end within the request timeout")
    document = case.operation.schema.raw_schema
    operation = document["paths"][case.path][case.method.lower()]
    event_schema = operation["responses"][str(response.status_code)]["content"][SSE_MEDIA_TYPE]["schema"]
    (json_data,) = (s for s in event_schema["properties"]["data"]["anyOf"] if "contentSchema" in s)
    validator = jsonschema_rs.Draft202012Validator(
        {**json_data["contentSchema"], "components": document["components"]}
    )
    payloads = sse_payloads(response.content.decode())
    for payload in payloads[:-1]:
        validator.validate(json.loads(payload))
    if payloads[-1] != "[DONE]":
        error = json.loads(payloads[-1])
        validator.validate(error)
        if "error" not in error:
            raise AssertionError(f"the stream ends with neither [DONE] nor an error event: {payloads[-1]!r}")
    return True


def sse_payloads(body: str) -> list[str]:
    """The `data:` payloads of an event stream whose every event is one `data:` line."""
    if not body.endswith("\n\n"):
        raise AssertionError(f"the event stream does not end with a blank line: {body[-200:]!r}")
    events = body.split("\n\n")[:-1]
    if not events:
        raise AssertionError("an empty event stream")
    for event in events:
        if not event.startswith("data: ") or "\n" in event:
            raise AssertionError(f"an event other than one `data: ` line: {event[:200]!r}")
    return [event.removeprefix("data: ") for event in events]


def _content_type(response: Any) -> str:
    value = response.headers.get("content-type", [""])
    return value[0] if isinstance(value, list) else str(value)
