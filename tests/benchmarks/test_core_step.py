"""benchmarks.core_step: the same requests in-process and through a real engine core, every token
counted on both, and the closed loop never over its limit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import core_step
from shared.reference import default_model
from shared.sampling_params import SamplingParams


def test_the_closed_loop_keeps_its_limit_and_marks_each_admission() -> None:
    loop = core_step.Closed([[1], [2], [3]], limit=2, params=SamplingParams(max_tokens=1))
    assert [request_id for request_id, _ in loop.due()] == ["r0", "r1"]
    loop.fresh = False
    assert list(loop.due()) == [] and not loop.fresh  # full: nothing admitted
    loop.running.discard("r0")
    assert list(loop.due()) == [("r2", [3])] and loop.fresh
    loop.running.clear()
    assert loop.done


def test_a_step_s_gap_is_its_period_less_its_step() -> None:
    times = core_step.StepTimes(
        step_s=[0.010, 0.012, 0.011],
        period_s=[0.015, 0.016],
        delivery_s=[0.03, 0.02],
        num_tokens=6,
        wall_s=2.0,
    )
    summary = times.summary()
    assert summary["delivery_p50_ms"] == pytest.approx(25.0) and summary["num_steps"] == 3
    assert summary["step_p50_ms"] == pytest.approx(11.0)
    assert summary["period_p50_ms"] == pytest.approx(15.5)
    assert summary["gap_p50_ms"] == pytest.approx(4.5)
    assert summary["output_tok_per_s"] == pytest.approx(3.0) and summary["num_tokens"] == 6


def test_both_paths_make_every_requested_token_and_the_core_s_extra_calls_are_listed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "core-step.json"
    core_step.main(
        ["--model", default_model(), "--dtype", "float32", "--device", "cpu", "--cpu-threads", "1",
         "--num-requests", "2", "--max-tokens", "5", "--paths", "in-process", "core", "--out", str(out), "--profile", str(tmp_path / "prof")]
    )  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [row["path"] for row in rows] == ["in-process", "core"]
    for row in rows:
        assert row["num_tokens"] == 10  # 2 requests x 5 tokens
        assert row["output_tok_per_s"] > 0 and row["period_p50_ms"] > 0
        assert 0 < row["delivery_p50_ms"] < 60_000
    assert rows[0]["num_steps"] == rows[1]["num_steps"] >= 10  # the same steps (prefill chunks too)
    printed = capsys.readouterr().out
    assert f"| core | {rows[1]['num_steps']} |" in printed
    # profiled: the core's loop sends a batch each step, which the engine in-process never does
    [send] = [line for line in printed.splitlines() if "channel.py" in line and "(send)" in line]
    assert float(send.split("|")[2]) == 0 and float(send.split("|")[3]) >= 1


def test_bad_counts_are_refused() -> None:
    with pytest.raises(SystemExit, match="at least 1"):
        core_step.main(["--model", "m", "--concurrency", "0"])
