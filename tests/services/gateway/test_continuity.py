"""The gateway's continuity check: every token once and in order, duplicates dropped, a gap never
finished over (held for a replay, then an error)."""

from __future__ import annotations

import time

from services.gateway.continuity import Continuity
from shared.protocol import ErrorInfo, TokenEvent


def row(start: int, *token_ids: int, finished: bool = False) -> TokenEvent:
    """A row of tokens `token_ids` at output positions start, start + 1, ...; text "<id>" per token."""
    return TokenEvent(
        request_id="r",
        token_ids=list(token_ids),
        text="".join(f"<{t}>" for t in token_ids),
        finished=finished,
        finish_reason="length" if finished else None,
        num_output_tokens=start + len(token_ids),
    )


def text_of(events: list[TokenEvent]) -> str:
    return "".join(e.text for e in events)


def feed(continuity: Continuity, *rows: TokenEvent) -> list[TokenEvent]:
    return [out for r in rows for out in continuity.accept(r)]


def test_rows_in_order_pass_through() -> None:
    out = feed(Continuity("r"), row(0, 1, 2), row(2, 3), row(3, 4, finished=True))
    assert text_of(out) == "<1><2><3><4>" and out[-1].finished


def test_a_repeated_row_is_dropped() -> None:
    """A worker's publish repeated after a lost answer: the same rows again."""
    out = feed(Continuity("r"), row(0, 1, 2), row(2, 3), row(0, 1, 2), row(2, 3), row(3, 4, finished=True))
    assert text_of(out) == "<1><2><3><4>"


def test_a_gap_holds_the_rest_and_never_finishes() -> None:
    continuity = Continuity("r", replay_timeout_s=60)
    out = feed(continuity, row(0, 1), row(2, 3), row(3, 4, finished=True))
    assert text_of(out) == "<1>" and not any(e.finished for e in out)
    assert continuity.wait_s(600) <= 60


def test_a_replay_fills_the_gap_and_the_held_rows_follow() -> None:
    """A re-dispatch resumed from a record that ends before the gap: its rows fill the gap, then
    repeat what was held (dropped), and the held finish is delivered once the output is whole."""
    continuity = Continuity("r")
    assert text_of(feed(continuity, row(0, 1), row(2, 3))) == "<1>"
    out = feed(continuity, row(1, 2), row(2, 3), row(3, 4, finished=True))
    assert text_of(out) == "<2><3><4>" and out[-1].finished
    assert continuity.gap_since is None


def test_a_gap_not_replayed_in_time_ends_in_an_error() -> None:
    continuity = Continuity("r", replay_timeout_s=0.05)
    feed(continuity, row(0, 1), row(3, 4, finished=True))
    time.sleep(0.06)
    assert continuity.wait_s(600) == 0
    error = continuity.timeout_error()
    assert error is not None and error.error is not None and error.error.code == 500
    assert "tokens 1 to 2" in error.error.message and error.finish_reason == "error"


def test_no_gap_means_no_timeout_error() -> None:
    continuity = Continuity("r")
    feed(continuity, row(0, 1))
    assert continuity.timeout_error() is None and continuity.wait_s(7) == 7


def test_the_first_row_of_a_resumed_request_continues_where_the_client_is() -> None:
    """A request resumed after 2 delivered tokens: its first row counts them (num_output_tokens 3
    for one new token), so it starts at 2, where the client is."""
    continuity = Continuity("r")
    feed(continuity, row(0, 1, 2))
    out = feed(continuity, row(2, 3), row(3, 4, finished=True))
    assert text_of(out) == "<3><4>"


def test_a_resumed_request_s_first_row_with_nothing_delivered_starts_at_zero() -> None:
    out = feed(Continuity("r"), row(0, 5, finished=True))
    assert text_of(out) == "<5>" and out[-1].finished


def test_a_row_that_contradicts_what_was_streamed_fails_the_request() -> None:
    continuity = Continuity("r")
    feed(continuity, row(0, 1, 2))
    [out] = feed(continuity, row(1, 9))
    assert out.error is not None and out.finished and "differ" in out.error.message


def test_a_row_partly_new_partly_repeated_fails_the_request() -> None:
    """Its text delta cannot be cut at a token: better an error than a repeated or missing piece."""
    continuity = Continuity("r")
    feed(continuity, row(0, 1, 2))
    [out] = feed(continuity, row(1, 2, 3))
    assert out.error is not None


def test_an_error_ends_the_request_whatever_its_position() -> None:
    continuity = Continuity("r")
    feed(continuity, row(0, 1), row(5, 6))
    error = TokenEvent(
        request_id="r", finished=True, error=ErrorInfo(code=503, type="service_unavailable", message="x")
    )
    assert feed(continuity, error) == [error]
