"""benchmarks.output_path: every hop of a step's outputs timed, the gateway's over real SSE streams."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks import output_path


def test_every_hop_is_timed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    out = tmp_path / "path.json"
    output_path.main(
        ["--rows", "8", "--gateways", "2", "--steps", "5", "--gateway-steps", "6", "--behind", "3"]
        + ["--gateway-interval-ms", "5", "--repeats", "1", "--out", str(out)]
    )
    assert "| 8 |" in capsys.readouterr().out
    [ms] = json.loads(out.read_text())["ms"].values()
    assert set(ms) == set(output_path.HOPS)
    assert all(len(values) == 1 for values in ms.values())
    assert all(ms[hop][0] > 0 for hop in ("core", "channel", "worker"))  # the gateway's: less its idle CPU


def test_a_step_batch_holds_one_new_token_a_request() -> None:
    batch = output_path.step_batch(output_path.request_ids(4), step=7)
    assert batch.num_rows == 4 and batch.token_ids.tolist() == [7] * 4
    assert batch.num_output_tokens.tolist() == [8] * 4
