"""The soak's short version, as CI runs it: 64 greedy streams for 60 s through `specmesh serve`, the
worker SIGKILLed once (serve restarts it): no token lost or changed, no wrong text, none hung; and
Redis's memory read as Redis accounts for it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from benchmarks.soak import parse_args, run_soak

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


def test_64_streams_for_60_s_through_a_worker_kill_lose_nothing_and_none_hangs(tmp_path: Path) -> None:
    config = parse_args(
        [
            "--streams=64",
            "--duration-s=60",
            "--warmup-s=10",
            "--window-s=20",
            "--kill-worker-every-s=30",
            "--max-tokens=32",
            "--num-prompts=8",
            "--request-timeout-s=90",
            f"--out={tmp_path / 'soak.json'}",
            "--",
            "--speculative-config",
            '{"method": "ngram"}',
        ]
    )
    report = run_soak(config, tmp_path / "logs")
    totals = report["totals"]
    assert [f["role"] for f in report["faults"] if "skipped" not in f] == ["mixed"], report["faults"]
    assert any("mixed exited with code -9" in line for line in report["serve"]["restarts"])
    # every stream completed at least one request across the kill (more on an idle machine)
    assert totals["completed"] >= config.streams, "the soak completed too little to test anything"
    assert (totals["tokens_lost"], totals["tokens_changed"], totals["wrong_text"]) == (0, 0, 0), totals
    assert totals["hung"] == 0, totals
    # Redis's own account of its memory, beside its RSS, at both marks (read as serve's admin)
    for mark in ("warmup", "end"):
        redis_memory = report["redis_memory"][mark]
        assert redis_memory is not None, mark
        assert redis_memory["used_memory"] > 0 and redis_memory["used_memory_rss"] > 0
        assert redis_memory["keys"] > 0
    assert (tmp_path / "soak.json").is_file()
