"""benchmarks.core_channel: a command's round trip to a process that reads it as an idle core does."""

from __future__ import annotations

import re

import pytest

from benchmarks import core_channel


def test_round_trips_are_timed(capsys: pytest.CaptureFixture[str]) -> None:
    core_channel.main(["--prompt-tokens", "50", "--round-trips", "20"])
    printed = capsys.readouterr().out
    match = re.search(r"p50 ([\d.]+) us, p90 ([\d.]+) us", printed)
    assert match is not None and 0 < float(match[1]) <= float(match[2])


def test_step_batches_up_are_timed(capsys: pytest.CaptureFixture[str]) -> None:
    core_channel.main(["--rows", "8", "--round-trips", "20"])
    printed = capsys.readouterr().out
    match = re.search(r"StepBatch of 8 rows.*p50 ([\d.]+) us, p90 ([\d.]+) us", printed)
    assert match is not None and 0 < float(match[1]) <= float(match[2])


def test_a_step_batch_has_three_new_tokens_a_row() -> None:
    batch = core_channel.step_batch(5)
    assert batch.num_rows == 5 and batch.row_tokens(4).tolist() == [12, 13, 14]


def test_bad_counts_are_refused() -> None:
    with pytest.raises(SystemExit):
        core_channel.main(["--round-trips", "5"])
    with pytest.raises(SystemExit):
        core_channel.main(["--rows", "0"])
