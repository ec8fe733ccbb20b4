"""`Bus.publish_many`: one message to each of several streams in one command, none lost or mixed up."""

from __future__ import annotations

from shared.bus import Bus
from shared.protocol import PAYLOAD_FIELD, TokenEvent, decode


async def test_each_stream_gets_its_message_in_order(bus: Bus) -> None:
    streams = [bus.keys.output(f"r{i}") for i in range(5)]
    for step in range(3):
        await bus.publish_many(
            [(stream, TokenEvent(request_id=f"r{i}", token_ids=[step])) for i, stream in enumerate(streams)]
        )
    for i, stream in enumerate(streams):
        entries = await bus.client.xrange(stream)
        events = [decode(fields[PAYLOAD_FIELD]) for _, fields in entries]
        assert [(e.request_id, e.token_ids) for e in events] == [(f"r{i}", [s]) for s in range(3)]


async def test_nothing_to_publish_sends_nothing(bus: Bus) -> None:
    await bus.publish_many([])
    assert await bus.client.keys(f"*{bus.keys.topic}*") == []


async def test_after_a_script_flush_the_script_is_loaded_again(bus: Bus) -> None:
    """A restarted Redis has lost its script cache: EVALSHA fails, the script is sent again."""
    stream = bus.keys.output("r")
    await bus.publish_many([(stream, TokenEvent(request_id="r"))])
    await bus.client.script_flush()
    await bus.publish_many([(stream, TokenEvent(request_id="r"))])
    assert await bus.client.xlen(stream) == 2
