"""benchmarks.step_stalls: bursts run to their end and every step over the threshold is listed."""

from __future__ import annotations

import pytest

from benchmarks import step_stalls
from shared.reference import default_model


def test_every_step_over_the_threshold_is_listed(capsys: pytest.CaptureFixture[str]) -> None:
    step_stalls.main(
        ["--model", default_model(), "--dtype", "float32", "--device", "cpu", "--concurrency", "3",
         "--max-tokens", "3", "--methods", "naive", "ngram", "--runs", "2", "--threshold-ms", "0"]
    )  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    runs = [line.split() for line in lines if line.startswith("== ")]
    assert [run[1:4] for run in runs] == [
        ["naive", "run", "1:"], ["naive", "run", "2:"], ["ngram", "run", "1:"], ["ngram", "run", "2:"]
    ]  # fmt: skip
    for run in runs:  # every step is over 0 ms, so each run lists all of its steps
        steps, listed = int(run[6]), int(run[11])
        assert steps >= 3 and listed == steps
    assert sum(line.startswith("step ") for line in lines) == sum(int(run[11]) for run in runs)
