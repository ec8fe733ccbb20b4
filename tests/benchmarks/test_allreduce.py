"""benchmarks/allreduce.py: a decode step's all-reduce estimate takes the peer all-reduce's curve
where the kernel takes the message and NCCL's graph-replayed curve past its limit; on CPU the
benchmark runs through gloo with the step's own sizes measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.allreduce import _estimate_us

CURVE = [
    {"bytes": 1024, "us": 30.0, "graph_us": 20.0, "peer_us": 6.0, "peer_graph_us": 3.0},
    {"bytes": 1 << 20, "us": 30.0, "graph_us": 22.0, "peer_us": 12.0, "peer_graph_us": 8.0},
    {"bytes": 4 << 20, "us": 40.0, "graph_us": 35.0, "peer_us": None, "peer_graph_us": None},
]


def test_step_estimate_uses_the_peer_curve_up_to_its_limit() -> None:
    assert _estimate_us(CURVE, 1024, "peer_graph_us") == 3.0
    assert _estimate_us(CURVE, 1 << 20, "peer_graph_us") == 8.0
    assert _estimate_us(CURVE, 2 << 20, "peer_graph_us") == pytest.approx(22.0 + 13.0 / 3)  # NCCL's graph
    assert _estimate_us(CURVE, 2 << 20, "graph_us") == pytest.approx(22.0 + 13.0 / 3)
    assert _estimate_us(CURVE, 512, "us") == 30.0
    assert _estimate_us([{**row, "graph_us": None} for row in CURVE], 1024, "graph_us") is None


@pytest.mark.timeout(180)
def test_gloo_run_measures_the_step_sizes(tmp_path: Path) -> None:
    out = tmp_path / "ar.json"
    command = [sys.executable, "-m", "benchmarks.allreduce", "--ranks", "2", "--device", "cpu"]
    command += ["--dtype", "float32", "--sizes", "1024", "--iters", "2", "--shape", "qwen2.5-7b"]
    command += ["--batch-sizes", "1", "--out", str(out)]
    subprocess.run(command, check=True, capture_output=True, timeout=170)
    result = json.loads(out.read_text())
    assert [row["bytes"] for row in result["curve"]] == [1024, 3584 * 4]  # batch 1's [1, 3584] float32
    assert all(row["peer_us"] is None and row["graph_us"] is None for row in result["curve"])
    assert (
        result["steps"][0]["est_all_reduce_ms"] > 0
        and result["steps"][0]["est_peer_graph_all_reduce_ms"] is None
    )
