"""The bus's multi-key commands: a step's outputs, delivered records and reports in one script call;
admission and release of a request in one round trip each."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from shared.bus import (
    APPEND_AT_END,
    ENDED_TTL_S,
    FIRST_EPOCH,
    OUTPUT_END,
    OUTPUT_TTL_S,
    Bus,
    DeliveredRecords,
    Placement,
)
from shared.protocol import (
    PAYLOAD_FIELD,
    TOKEN_DTYPE,
    Dispatch,
    Finished,
    GenerateRequest,
    OutputBatch,
    Reserve,
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
            delivered=[("a", 1, step, tokens(step)), ("c", 1, 2 * step, tokens(10 + step, 20 + step))],
            messages=[
                (
                    bus.keys.scheduler_replies,
                    Finished(request_id="b", instance_id="w", outcome="done", epoch=1),
                )
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
    await bus.publish_step([], [("r", 1, 0, tokens(7, 8))])
    await bus.publish_step([], [("r", 1, 2, tokens(9, OUTPUT_END))])
    assert await bus.delivered_tokens("r") == ([7, 8, 9], True)


async def test_a_repeated_publish_appends_its_tokens_once(bus: Bus) -> None:
    """A publish retried after its answer was lost (Redis had applied it) leaves the record as it was."""
    for _ in range(2):
        await bus.publish_step([], [("r", 1, 0, tokens(7, 8))])
    await bus.publish_step([], [("r", 1, 2, tokens(9))])
    await bus.publish_step([], [("r", 1, 1, tokens(8, 9))])
    assert await bus.delivered_tokens("r") == ([7, 8, 9], False)


async def test_a_record_that_lost_its_tail_stays_a_prefix(bus: Bus) -> None:
    """Tokens that start past the record's end (a restarted Redis lost the ones between) are not
    appended: a re-dispatch resumes from the prefix, and the gateway drops what it already had."""
    await bus.publish_step([], [("r", 1, 0, tokens(7))])
    await bus.publish_step([], [("r", 1, 3, tokens(10, OUTPUT_END))])
    assert await bus.delivered_tokens("r") == ([7], False)


async def test_a_record_lost_altogether_is_not_made_again_by_a_later_row(bus: Bus) -> None:
    """A record gone with a Redis restart stays gone (a re-dispatch resumes from nothing, and the
    gateway drops what it already had) rather than start with a hole."""
    await bus.publish_step([], [("r", 1, 2, tokens(9))])
    assert not await bus.client.exists(bus.keys.delivered("r"))


def step_records(*rows: tuple[str, int, list[int]], renew_ttl: bool) -> DeliveredRecords:
    """A step's records as a worker builds them: (request id, start, tokens) rows of epoch 1."""
    records = DeliveredRecords.of([(r, 1, start, tokens(*ids)) for r, start, ids in rows])
    return replace(records, renew_ttl=np.full(len(rows), renew_ttl))


async def test_a_record_gets_its_ttl_as_it_is_made_and_renewed_only_on_flagged_rows(bus: Bus) -> None:
    key = bus.keys.delivered("r")
    await bus.publish_step([], step_records(("r", 0, [7]), renew_ttl=False))
    assert 0 < await bus.client.ttl(key) <= OUTPUT_TTL_S
    await bus.client.expire(key, 100)
    await bus.publish_step([], step_records(("r", 1, [8]), renew_ttl=False))
    assert 0 < await bus.client.ttl(key) <= 100
    await bus.publish_step([], step_records(("r", 2, [9]), renew_ttl=True))
    assert 100 < await bus.client.ttl(key) <= OUTPUT_TTL_S
    await bus.client.expire(key, 100)
    await bus.publish_step([], step_records(("r", 1, [8, 9]), renew_ttl=True))  # a repeat: undone
    assert await bus.delivered_tokens("r") == ([7, 8, 9], False)
    assert 0 < await bus.client.ttl(key) <= 100


async def test_a_step_of_many_rows_appends_each_record_once_in_one_call(bus: Bus) -> None:
    """Columns of 64 rows (two tokens each, every other one ending, one id not ASCII), published
    twice (a retry after a lost answer): every record holds its row's tokens once."""
    rows = [
        (f"r{i}" + ("é" if i == 5 else ""), 0, [i, 1000 + i] + ([OUTPUT_END] * (i % 2))) for i in range(64)
    ]
    for _ in range(2):
        assert await bus.publish_step([], step_records(*rows, renew_ttl=False)) == []
    for request_id, _, ids in rows:
        assert await bus.delivered_tokens(request_id) == (ids[:2], len(ids) == 3)


async def test_an_end_marker_appended_at_the_end_needs_no_position(bus: Bus) -> None:
    await bus.publish_step([], [("r", 1, 0, tokens(7))])
    await bus.publish_step([], [("r", 1, APPEND_AT_END, tokens(OUTPUT_END))])
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
    await bus.claim_epoch("a")
    await bus.publish_step([], [("a", 1, 0, tokens(1))])
    assert await bus.delivered_tokens("a") == ([1], False)
    await bus.release("a", "w")
    await bus.release("a", "w")
    assert int(await bus.client.get(bus.keys.queue_depth)) == 0
    assert not await bus.client.exists(bus.keys.delivered("a"))
    assert await bus.client.hgetall(bus.keys.request_state("a")) == {b"ended": b"1"}
    assert await bus.client.smembers(bus.keys.assignments("w")) == {b"other"}


async def test_release_leaves_an_ended_mark_that_refuses_a_late_submit(bus: Bus) -> None:
    await bus.admit("a", submit("a"), max_queue_len=8)
    await bus.release("a")
    assert await bus.admit("a", submit("a"), max_queue_len=8) == "ended"
    assert int(await bus.client.get(bus.keys.queue_depth)) == 0
    assert 0 < await bus.client.ttl(bus.keys.request_state("a")) <= ENDED_TTL_S


async def test_each_placement_claims_the_next_epoch_once(bus: Bus) -> None:
    """Two claims that saw the same epoch (a report and a dead instance's burial, two replicas):
    one wins. An ended request has no epoch to claim."""
    await bus.admit("a", submit("a"), max_queue_len=8)
    assert await bus.claim_epoch("a") == 1
    assert await bus.claim_epoch("a", seen=1) == 2
    assert await bus.claim_epoch("a", seen=1) is None
    assert await bus.placement("a") == Placement(epoch=2, instance_ids=[])
    await bus.release("a")
    assert await bus.claim_epoch("a") is None
    assert await bus.placement("a") is None


async def test_a_dispatch_goes_out_only_under_the_current_epoch(bus: Bus) -> None:
    await bus.admit("a", submit("a"), max_queue_len=8)
    epoch = await bus.claim_epoch("a")
    assert epoch == 1
    assert await bus.dispatch("a", epoch, ["d", "p"], bus.keys.inbox("p"), submit("a"))
    assert await bus.placement("a") == Placement(epoch=1, instance_ids=["d", "p"])
    assert await bus.client.sismember(bus.keys.assignments("d"), "a")
    [(_, fields)] = await bus.client.xrange(bus.keys.inbox("p"))
    sent = decode(fields[PAYLOAD_FIELD])
    assert isinstance(sent, Submit) and sent.request.request_id == "a"
    await bus.claim_epoch("a", seen=1)  # placed again by someone else meanwhile
    assert not await bus.dispatch("a", 1, ["w"], bus.keys.inbox("w"), submit("a"))
    assert await bus.client.xlen(bus.keys.inbox("w")) == 0
    assert not await bus.client.exists(bus.keys.assignments("w"))


async def test_admission_and_first_dispatch_go_in_one_round_trip_only_for_a_new_request(bus: Bus) -> None:
    """Admitted now: its placement recorded under the first epoch and the dispatch in the inbox;
    a repeat, a full queue or an ended request dispatches nothing."""
    owned = submit("a")
    owned.request.gateway_id, owned.request.gateway_incarnation = "g1", "first"
    dispatch = Dispatch(role="mixed", request=owned.request, epoch=FIRST_EPOCH)
    assert await bus.admit_and_dispatch("a", owned, 2, "w", dispatch) == "admitted"
    assert await bus.placement("a") == Placement(epoch=FIRST_EPOCH, instance_ids=["w"])
    assert await bus.client.smembers(bus.keys.assignments("w")) == {b"a"}
    assert await bus.gateway_requests("g1") == {"a": "first"}
    [(_, fields)] = await bus.client.xrange(bus.keys.inbox("w"))
    sent = decode(fields[PAYLOAD_FIELD])
    assert isinstance(sent, Dispatch) and sent.epoch == FIRST_EPOCH and sent.request.request_id == "a"
    assert await bus.admit_and_dispatch("a", owned, 2, "w", dispatch) == "duplicate"
    assert await bus.admit("b", submit("b"), max_queue_len=2) == "admitted"
    assert await bus.admit_and_dispatch("c", submit("c"), 2, "w", dispatch) == "queue_full"
    await bus.release("b")
    assert await bus.admit_and_dispatch("b", submit("b"), 2, "w", dispatch) == "ended"
    assert await bus.client.xlen(bus.keys.inbox("w")) == 1
    assert await bus.client.smembers(bus.keys.assignments("w")) == {b"a"}
    assert int(await bus.client.get(bus.keys.queue_depth)) == 1
    # the first placement's rows go out; a claim after it is the second placement
    assert await bus.publish_step([], [("a", FIRST_EPOCH, 0, tokens(7))]) == []
    assert await bus.claim_epoch("a", seen=FIRST_EPOCH) == FIRST_EPOCH + 1


async def test_admission_and_first_reserve_go_in_one_round_trip_only_for_a_new_request(bus: Bus) -> None:
    """Admitted now: the first epoch claimed and the Reserve in the decode instance's inbox, where
    it runs not yet recorded (the prefill's dispatch records it); a repeat, a full queue or an
    ended request sends nothing."""
    owned = submit("a")
    owned.request.gateway_id, owned.request.gateway_incarnation = "g1", "first"
    reserve = Reserve(request=owned.request, epoch=FIRST_EPOCH, timeout_s=5, reply_to="replies")
    assert await bus.admit_and_reserve("a", owned, 2, "d", reserve) == "admitted"
    assert await bus.placement("a") == Placement(epoch=FIRST_EPOCH, instance_ids=[])
    assert await bus.gateway_requests("g1") == {"a": "first"}
    [(_, fields)] = await bus.client.xrange(bus.keys.inbox("d"))
    sent = decode(fields[PAYLOAD_FIELD])
    assert isinstance(sent, Reserve) and sent.epoch == FIRST_EPOCH and sent.request.request_id == "a"
    assert await bus.admit_and_reserve("a", owned, 2, "d", reserve) == "duplicate"
    assert await bus.admit("b", submit("b"), max_queue_len=2) == "admitted"
    assert await bus.admit_and_reserve("c", submit("c"), 2, "d", reserve) == "queue_full"
    await bus.release("b")
    assert await bus.admit_and_reserve("b", submit("b"), 2, "d", reserve) == "ended"
    assert await bus.client.xlen(bus.keys.inbox("d")) == 1
    assert int(await bus.client.get(bus.keys.queue_depth)) == 1
    # the placement's dispatch goes out under the epoch the admission claimed
    assert await bus.dispatch("a", FIRST_EPOCH, ["d", "p"], bus.keys.inbox("p"), submit("a"))
    assert await bus.claim_epoch("a", seen=FIRST_EPOCH) == FIRST_EPOCH + 1


async def test_rows_of_a_stale_epoch_are_fenced_and_nothing_of_the_step_is_written(bus: Bus) -> None:
    """A worker taken for dead comes back and publishes a step with a row of a request placed
    elsewhere since: the whole step is refused (the fenced ids come back) and writes nothing; the
    current placement's rows go through."""
    for request_id in ("a", "b"):
        await bus.admit(request_id, submit(request_id), max_queue_len=8)
        await bus.claim_epoch(request_id)
    await bus.publish_step([], [("a", 1, 0, tokens(7))])
    await bus.claim_epoch("a", seen=1)  # "a" re-dispatched: epoch 2
    report = Finished(request_id="b", instance_id="w", outcome="done", epoch=1)
    fenced = await bus.publish_step(
        [("g", batch(TokenEvent(request_id="a", token_ids=[8])))],
        [("a", 1, 1, tokens(8)), ("b", 1, 0, tokens(5, OUTPUT_END))],
        [(bus.keys.scheduler_replies, report)],
    )
    assert fenced == ["a"]
    assert not await bus.client.exists(bus.keys.outputs("g"), bus.keys.scheduler_replies)
    assert await bus.delivered_tokens("a") == ([7], False)
    assert await bus.delivered_tokens("b") == ([], False)
    assert await bus.publish_step([], [("a", 2, 1, tokens(9))]) == []
    assert await bus.delivered_tokens("a") == ([7, 9], False)


async def test_rows_of_an_ended_request_are_fenced(bus: Bus) -> None:
    await bus.admit("a", submit("a"), max_queue_len=8)
    await bus.claim_epoch("a")
    await bus.release("a")  # its client left
    assert await bus.publish_step([("g", batch(TokenEvent(request_id="a")))], [("a", 1, 0, tokens(7))]) == [
        "a"
    ]
    assert not await bus.client.exists(bus.keys.outputs("g"), bus.keys.delivered("a"))
