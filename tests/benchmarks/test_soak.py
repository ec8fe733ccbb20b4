"""The soak's bookkeeping: lost and changed tokens counted exactly, the fault schedule, and a
command line that names what is wrong with a bad value."""

from __future__ import annotations

import pytest

from benchmarks.soak import Expected, Judged, Record, fault_schedule, judge, parse_args, window_stats

OFFLINE = Expected("ab cd ef", [0, 2, 3, 5, 6])
"""Tokens "ab", " ", "cd", " ", "ef"."""


def streamed(*tokens: str) -> Record:
    return Record(stream=0, prompt=0, sent_at=0.0, text="".join(tokens), done=True)


def test_a_whole_stream_loses_nothing() -> None:
    assert judge(streamed("ab", " ", "cd", " ", "ef"), OFFLINE) == Judged(0, 0, False)


def test_a_gap_in_the_middle_counts_each_missing_token_as_lost() -> None:
    assert judge(streamed("ab", " ", "ef"), OFFLINE) == Judged(2, 0, True)


def test_a_token_replaced_by_another_is_changed_not_lost() -> None:
    assert judge(streamed("ab", " ", "XY", " ", "ef"), OFFLINE) == Judged(0, 1, True)


def test_a_stream_cut_short_loses_its_tail() -> None:
    assert judge(streamed("ab", " "), OFFLINE) == Judged(3, 0, True)


def test_a_repeated_token_makes_the_text_wrong() -> None:
    assert judge(streamed("ab", " ", "cd", " ", "cd", " ", "ef"), OFFLINE) == Judged(0, 0, True)


def test_faults_follow_the_schedule_and_stay_inside_the_load() -> None:
    config = parse_args(["--duration-s", "600", "--kill-worker-every-s", "120", "--kill-redis-at-s", "300"])
    assert fault_schedule(config) == [
        (120.0, "mixed"),
        (240.0, "mixed"),
        (300.0, "redis"),
        (360.0, "mixed"),
        (480.0, "mixed"),
    ]


def test_windows_hold_the_requests_that_ended_in_them() -> None:
    records = [
        Record(0, 0, sent_at=0.0, first_token_at=1.0, ended_at=5.0, done=True),
        Record(1, 0, sent_at=5.0, first_token_at=5.5, ended_at=12.0, done=True),
        Record(2, 0, sent_at=5.0, ended_at=6.0, error="HTTP 503"),
    ]
    windows = window_stats(records, window_s=10.0, num_tokens=3)
    assert [(w["from_s"], w["completed"]) for w in windows] == [(0.0, 1), (10.0, 1)]
    assert windows[0]["ttft_ms"]["p50"] == 1000.0 and windows[0]["tpot_ms"]["p50"] == 2000.0
    assert windows[1]["tpot_ms"]["p99"] == 3250.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--streams", "0"], "--streams must be at least 1"),
        (["--duration-s", "-5"], "--duration-s must be positive"),
        (["--duration-s", "60", "--warmup-s", "60"], "--warmup-s must be in [0, --duration-s)"),
        (["--kill-worker-every-s", "0"], "--kill-worker-every-s must be positive"),
        (
            ["--duration-s", "60", "--kill-redis-at-s", "90"],
            "--kill-redis-at-s must be within (0, --duration-s)",
        ),
        (["--max-tokens", "512", "--max-model-len", "512"], "must leave room for a prompt"),
        (["--streams", "many"], "invalid int value"),
    ],
)
def test_bad_values_are_refused_with_the_flag_named(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_flags_after_a_double_dash_go_to_serve() -> None:
    config = parse_args(["--streams", "8", "--", "--speculative-config", '{"method": "ngram"}', "--pd"])
    assert config.streams == 8
    assert config.serve_args == ["--speculative-config", '{"method": "ngram"}', "--pd"]
