"""The bus protocol's version: every message carries this build's, and another build's is refused
with a reason that says what is wrong."""

from __future__ import annotations

import msgpack
import pytest
from pydantic import ValidationError

from shared.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    GenerateRequest,
    OutputBatch,
    ProtocolError,
    Submit,
    TokenEvent,
    decode,
    encode,
)
from shared.sampling_params import SamplingParams
from shared.structured_output import StructuredOutput


def new_submit() -> Submit:
    """A request with the fields version 4 brought: a grammar and the gateway's incarnation."""
    params = SamplingParams(max_tokens=4, structured=StructuredOutput(kind="json_object"))
    request = GenerateRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        params=params,
        gateway_id="g1",
        gateway_incarnation="first",
    )
    return Submit(request=request)


def test_every_message_is_sent_with_this_builds_version() -> None:
    for message in (
        new_submit(),
        Cancel(request_id="r1"),
        OutputBatch.of([TokenEvent(request_id="r1", token_ids=[5])]),
    ):
        assert message.to_wire()["version"] == PROTOCOL_VERSION
        assert decode(encode(message)) == message


def test_a_message_of_another_build_is_refused_naming_both_versions() -> None:
    for version in (PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, None, "4"):
        wire = new_submit().to_wire()
        wire["version"] = version
        with pytest.raises(ProtocolError) as refused:
            decode(msgpack.packb(wire, use_bin_type=True))
        assert f"unsupported protocol version {version!r} (this build speaks {PROTOCOL_VERSION})" in str(
            refused.value
        )
        assert "another specmesh build" in str(refused.value)


def test_a_message_cannot_be_built_with_another_version() -> None:
    with pytest.raises(ValidationError, match="unsupported protocol version 3"):
        Cancel(request_id="r1", version=3)
