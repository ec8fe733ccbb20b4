"""benchmarks.burst_trace: the per-step trace of a burst runs and accounts for every request."""

from __future__ import annotations

import pytest

from benchmarks import burst_trace
from shared.reference import default_model


def test_burst_trace_reports_every_first_token(capsys: pytest.CaptureFixture[str]) -> None:
    burst_trace.main(
        ["--model", default_model(), "--dtype", "float32", "--device", "cpu", "--concurrency", "3",
         "--max-tokens", "3", "--methods", "naive", "ngram", "--steps", "2"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert out.count("3 requests: every first token after") == 2
    first_steps = [line.split() for line in out.splitlines() if line[:1].isdigit()]
    assert len(first_steps) == 4  # two steps printed per method
    assert all(int(step[3]) == 3 and int(step[5]) == 3 for step in first_steps[::2])  # the prefill step
