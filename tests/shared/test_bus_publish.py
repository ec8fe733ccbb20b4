"""The bus's multi-key commands: a step's outputs, delivered records and reports in one script call;
admission and release of a request in one round trip each."""

from __future__ import annotations

import numpy as np

from shared.bus import APPEND_AT_END, OUTPUT_END, OUTPUT_TTL_S, Bus
from shared.protocol import (
    PAYLOAD_FIELD,
    TOKEN_DTYPE,
    Finished,
    GenerateRequest,
    OutputBatch,
    Submit,
    TokenEvent,
    decode,
    encode,
)
from shared.sampling_params import SamplingParams


def batch(*events: TokenEvent) -> bytes:
    return encode(OutputBatch.of(list(events)))


def tokens(*ids: int) -> bytes:
    return np.asarray(ids, TOKEN_DTYPE).tobytes()


async def test_a_step_reaches_each_gateway_once_and_every_record(bus: Bus) -> None:
    for step in range(3):
        await bus.publish_step(
            outputs=[
                ("g1", batch(TokenEvent(request_id="a", token_ids=[step]), TokenEvent(request_id="b"))),
                ("g2", batch(TokenEvent(request_id="c", token_ids=[10 + step, 20 + step]))),
            ],
            delivered=[("a", step, tokens(step)), ("c", 2 * step, tokens(10 + step, 20 + step))],
            messages=[
                (bus.keys.scheduler_replies, Finished(request_id="b", instance_id="w", outcome="done"))
            ],
        )
    g1 = [decode(f[PAYLOAD_FIELD]) for _, f in await bus.client.xrange(bus.keys.outputs("g1"))]
    assert [[(e.request_id, e.token_ids) for e in b.events()] for b in g1] == [  # type: ignore[union-attr]
        [("a", [s]), ("b", [])] for s in range(3)
    ]
    assert await bus.client.xlen(bus.keys.outputs("g2")) == 3
    assert await bus.delivered_tokens("a") == ([0, 1, 2], False)
    assert await bus.delivered_tokens("c") == ([10, 20, 11, 21, 12, 22], False)
    assert await bus.delivered_tokens("b") == ([], False)
    assert await bus.client.xlen(bus.keys.scheduler_replies) == 3
    assert 0 < await bus.client.ttl(bus.keys.outputs("g1")) <= OUTPUT_TTL_S
    assert 0 < await bus.client.ttl(bus.keys.delivered("a")) <= OUTPUT_TTL_S


async def test_a_record_ending_in_the_end_marker_is_finished(bus: Bus) -> None:
    await bus.publish_step([], [("r", 0, tokens(7, 8))])
    await bus.publish_step([], [("r", 2, tokens(9, OUTPUT_END))])
    assert await bus.delivered_tokens("r") == ([7, 8, 9], True)


async def test_a_repeated_publish_appends_its_tokens_once(bus: Bus) -> None:
    """A publish retried after its answer was lost (Redis had applied it) leaves the record as it was."""
    for _ in range(2):
        await bus.publish_step([], [("r", 0, tokens(7, 8))])
    await bus.publish_step([], [("r", 2, tokens(9))])
    await bus.publish_step([], [("r", 1, tokens(8, 9))])
    assert await bus.delivered_tokens("r") == ([7, 8, 9], False)


async def test_a_record_that_lost_its_tail_stays_a_prefix(bus: Bus) -> None:
    """Tokens that start past the record's end (a restarted Redis lost the ones between) are not
    appended: a re-dispatch resumes from the prefix, and the gateway drops what it already had."""
    await bus.publish_step([], [("r", 0, tokens(7))])
    await bus.publish_step([], [("r", 3, tokens(10, OUTPUT_END))])
    assert await bus.delivered_tokens("r") == ([7], False)


async def test_an_end_marker_appended_at_the_end_needs_no_position(bus: Bus) -> None:
    await bus.publish_step([], [("r", 0, tokens(7))])
    await bus.publish_step([], [("r", APPEND_AT_END, tokens(OUTPUT_END))])
    assert await bus.delivered_tokens("r") == ([7], True)


async def test_nothing_to_publish_sends_nothing(bus: Bus) -> None:
    await bus.publish_step([])
    assert await bus.client.keys(f"*{bus.keys.topic}*") == []


async def test_after_a_script_flush_the_script_is_loaded_again(bus: Bus) -> None:
    """A restarted Redis has lost its script cache: EVALSHA fails, the script is sent again."""
    await bus.publish_step([("g", batch(TokenEvent(request_id="r")))])
    await bus.client.script_flush()
    await bus.publish_step([("g", batch(TokenEvent(request_id="r")))])
    assert await bus.client.xlen(bus.keys.outputs("g")) == 2


def submit(request_id: str) -> Submit:
    params = SamplingParams(max_tokens=4)
    return Submit(request=GenerateRequest(request_id=request_id, prompt_token_ids=[1], params=params))


async def test_admission_takes_one_slot_once_and_refuses_past_the_limit(bus: Bus) -> None:
    assert await bus.admit("a", submit("a"), max_queue_len=2) == "admitted"
    assert await bus.admit("a", submit("a"), max_queue_len=2) == "duplicate"
    assert await bus.admit("b", submit("b"), max_queue_len=2) == "admitted"
    assert await bus.admit("c", submit("c"), max_queue_len=2) == "queue_full"
    assert int(await bus.client.get(bus.keys.queue_depth)) == 2
    assert not await bus.client.exists(bus.keys.request_state("c"))
    state = await bus.client.hgetall(bus.keys.request_state("a"))
    stored = decode(state[b"request"])
    assert isinstance(stored, Submit) and stored.request.request_id == "a"
    assert (state[b"slot"], state[b"attempts"]) == (b"1", b"0")


async def test_release_frees_the_slot_exactly_once(bus: Bus) -> None:
    await bus.admit("a", submit("a"), max_queue_len=8)
    await bus.client.sadd(bus.keys.assignments("w"), "a", "other")
    await bus.publish_step([], [("a", 0, tokens(1))])
    await bus.release("a", "w")
    await bus.release("a", "w")
    assert int(await bus.client.get(bus.keys.queue_depth)) == 0
    assert not await bus.client.exists(bus.keys.request_state("a"), bus.keys.delivered("a"))
    assert await bus.client.smembers(bus.keys.assignments("w")) == {b"other"}


async def test_assign_and_publish_records_the_placement_and_sends(bus: Bus) -> None:
    await bus.assign_and_publish("a", ["d", "p"], bus.keys.inbox("p"), submit("a"))
    assert await bus.client.hget(bus.keys.request_state("a"), "instances") == b"d,p"
    assert await bus.client.sismember(bus.keys.assignments("d"), "a")
    [(_, fields)] = await bus.client.xrange(bus.keys.inbox("p"))
    sent = decode(fields[PAYLOAD_FIELD])
    assert isinstance(sent, Submit) and sent.request.request_id == "a"
