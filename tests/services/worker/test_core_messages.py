"""Step batches: rows selected per gateway and concatenated steps keep every request's tokens, ends
and logprobs on the right rows, and survive the bus encoding."""

from __future__ import annotations

import numpy as np

from services.worker.core_messages import EngineLoad, RowEnd, StepBatch, concat
from shared.bus import OUTPUT_END
from shared.protocol import TOKEN_DTYPE, ErrorInfo, OutputBatch, decode, encode


def step(rows: dict[str, list[int]], ends: list[RowEnd] | None = None) -> StepBatch:
    ids = list(rows)
    return StepBatch(
        request_ids=ids,
        cu_num_tokens=np.cumsum([0, *(len(t) for t in rows.values())], dtype=TOKEN_DTYPE),
        token_ids=np.asarray([t for ts in rows.values() for t in ts], TOKEN_DTYPE),
        texts=[f"<{r}>" for r in ids],
        num_output_tokens=np.asarray([len(t) for t in rows.values()], TOKEN_DTYPE),
        epochs=[1] * len(ids),
        ends=ends or [],
        logprobs=[(1, [(t, -0.5, [(t, -0.5)]) for t in rows[ids[1]]])] if len(ids) > 1 else [],
        handoffs=[],
        step_s=[0.01],
        load=EngineLoad(),
    )


def as_rows(batch: OutputBatch) -> list[tuple[str, list[int], str, bool]]:
    return [(e.request_id, e.token_ids, e.text, e.finished) for e in batch.events()]


def test_rows_of_one_gateway_keep_their_tokens_ends_and_logprobs() -> None:
    error = ErrorInfo(code=500, type="server_error", message="x")
    batch = step(
        {"a": [1, 2], "b": [3], "c": [], "d": [4, 5, 6]},
        ends=[RowEnd(row=2, finish_reason="error", error=error), RowEnd(row=3, finish_reason="stop")],
    )
    selected = decode(encode(batch.output_batch(np.asarray([1, 3]))))
    assert isinstance(selected, OutputBatch)
    assert as_rows(selected) == [("b", [3], "<b>", False), ("d", [4, 5, 6], "<d>", True)]
    events = selected.events()
    assert [lp.token_id for lp in events[0].logprobs] == [3] and events[1].finish_reason == "stop"
    whole = decode(encode(batch.output_batch()))
    assert isinstance(whole, OutputBatch)
    assert [e.error for e in whole.events()] == [None, None, error, None]


def test_a_handoff_is_no_end_for_the_client() -> None:
    batch = step({"a": [7]}, ends=[RowEnd(row=0, handoff=True)])
    assert as_rows(batch.output_batch()) == [("a", [7], "<a>", False)]


def test_concatenated_steps_keep_each_request_in_order() -> None:
    first = step({"a": [1], "b": [2]})
    second = step({"a": [3], "b": [4]}, ends=[RowEnd(row=1, finish_reason="length")])
    both = concat([first, second])
    assert as_rows(both.output_batch()) == [
        ("a", [1], "<a>", False),
        ("b", [2], "<b>", False),
        ("a", [3], "<a>", False),
        ("b", [4], "<b>", True),
    ]
    assert [row for row, _ in both.logprobs] == [1, 3]
    assert both.step_s == [0.01, 0.01]


def test_prompt_logprobs_stay_on_their_request_through_selection_concat_and_the_bus() -> None:
    first = step({"a": [1], "b": [2]})
    second = step({"c": [3], "d": [4]})
    second.prompt_logprobs = [(1, [None, (9, -1.5, 4, [(8, -0.5)])])]
    both = concat([first, second])
    selected = decode(encode(both.output_batch(np.asarray([0, 3]))))
    assert isinstance(selected, OutputBatch)
    events = {e.request_id: e for e in selected.events()}
    assert events["a"].prompt_logprobs is None
    entries = events["d"].prompt_logprobs
    assert entries is not None and entries[0] is None
    assert entries[1] is not None and (entries[1].token_id, entries[1].rank, entries[1].top) == (
        9,
        4,
        [(8, -0.5)],
    )


def test_delivered_records_of_selected_rows_carry_their_tokens_and_end_markers() -> None:
    batch = step(
        {"a": [1, 2], "b": [3], "c": [], "d": [4, 5, 6]},
        ends=[
            RowEnd(row=2, finish_reason="abort"),
            RowEnd(row=3, finish_reason="stop"),
            RowEnd(row=0, handoff=True),
        ],
    )
    renew = np.asarray([True, False, True, False])
    for rows, expected in (
        (None, {"a": [1, 2], "b": [3], "c": [OUTPUT_END], "d": [4, 5, 6, OUTPUT_END]}),
        (np.asarray([0, 2, 3]), {"a": [1, 2], "c": [OUTPUT_END], "d": [4, 5, 6, OUTPUT_END]}),
    ):
        records = batch.delivered_records(rows, renew)
        cu = np.cumsum([0, *records.num_tokens]).tolist()
        assert {
            request_id: records.token_ids[cu[i] : cu[i + 1]].tolist()
            for i, request_id in enumerate(records.request_ids)
        } == expected
        # every row here holds its request's first tokens
        assert records.starts.tolist() == [0] * len(expected)
        kept = list(range(4)) if rows is None else rows.tolist()
        assert records.renew_ttl.tolist() == renew[kept].tolist()
