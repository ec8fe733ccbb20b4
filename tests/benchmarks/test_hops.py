"""The hop tables: lines of several processes' logs joined per request and token, in path order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.hops import FIRST_TOKEN_PATH, summarize


def write_hops(path: Path, pid: int, hops: list[tuple[str, str, int, float, int | None]]) -> None:
    lines = ['{"msg": "not a hop"}']
    for name, request_id, pos, t, rtt in hops:
        entry = {"hop": name, "request_id": request_id, "pos": pos, "t": t, "rtt": rtt, "pid": pid}
        lines.append(json.dumps(entry))
    path.write_text("\n".join(lines) + "\n")


def test_hops_of_every_log_join_into_the_first_and_later_token_paths(tmp_path: Path) -> None:
    (tmp_path / "cell-0").mkdir()
    write_hops(
        tmp_path / "cell-0" / "scheduler.log",
        2,
        [("scheduler.read", "r", 0, 10.0030, 5), ("scheduler.admitted", "r", 0, 10.0040, 6)],
    )
    write_hops(
        tmp_path / "cell-0" / "gateway.log",
        1,
        [
            ("gateway.http", "r", 0, 10.0000, 0),
            ("gateway.prepared", "r", 0, 10.0010, 0),
            ("gateway.submitted", "r", 0, 10.0020, 1),
            ("gateway.read", "r", 1, 10.0500, 2),
            ("gateway.read", "r", 2, 10.0700, 3),
        ],
    )
    write_hops(
        tmp_path / "cell-0" / "mixed.log",
        3,
        [
            ("core.sent", "r", 1, 10.0400, 0),
            ("core.step_start", "r", 2, 10.0420, 0),
            ("core.sent", "r", 2, 10.0600, 0),
        ],
    )
    summary = summarize(tmp_path)
    first = {row["hop"]: row for row in summary["first_token"]}
    assert first["gateway.prepared -> gateway.submitted"]["p50_ms"] == pytest.approx(1.0, abs=1e-6)
    assert first["gateway.prepared -> gateway.submitted"]["round_trips_p50"] == 1
    assert first["gateway.submitted -> scheduler.read"]["round_trips_p50"] is None  # two processes
    assert first["scheduler.read -> scheduler.admitted"]["round_trips_p50"] == 1
    assert "core.added -> core.step_start" not in first  # never logged: left out, not zero
    assert "scheduler.admitted -> core.sent" in first  # from the last hop logged before it
    later = {row["hop"]: row for row in summary["later_token"]}
    assert later["core.sent (previous) -> core.step_start"]["p50_ms"] == pytest.approx(2.0, abs=1e-6)
    assert later["core.step_start -> core.sent"]["p50_ms"] == pytest.approx(18.0, abs=1e-6)
    assert [row["hop"] for row in summary["first_token"]][:2] == [
        f"{FIRST_TOKEN_PATH[0]} -> {FIRST_TOKEN_PATH[1]}",
        f"{FIRST_TOKEN_PATH[1]} -> {FIRST_TOKEN_PATH[2]}",
    ]


def test_round_trips_are_not_counted_across_a_hop_another_process_logged(tmp_path: Path) -> None:
    """The engine core logs `core.added` with its own round trips; its worker logs the core's step
    hops under the core's pid without them (None): the pair has no count, not a negative one."""
    write_hops(
        tmp_path / "core.log",
        3,
        [("core.added", "r", 0, 10.0000, 92)],
    )
    write_hops(
        tmp_path / "mixed.log",
        3,
        [
            ("core.step_start", "r", 1, 10.0010, None),
            ("core.sent", "r", 1, 10.0020, None),
            ("core.step_start", "r", 2, 10.0030, None),
            ("core.sent", "r", 2, 10.0040, None),
        ],
    )
    summary = summarize(tmp_path)
    first = {row["hop"]: row for row in summary["first_token"]}
    assert first["core.added -> core.step_start"]["p50_ms"] == pytest.approx(1.0, abs=1e-6)
    assert first["core.added -> core.step_start"]["round_trips_p50"] is None
    later = {row["hop"]: row for row in summary["later_token"]}
    assert later["core.step_start -> core.sent"]["round_trips_p50"] is None
