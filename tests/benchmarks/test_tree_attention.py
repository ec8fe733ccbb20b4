"""`python -m benchmarks.tree_attention` on a tiny CPU case: both variants run and are reported."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.tree_attention import main


def test_tiny_tree_attention_timing(tmp_path: Path) -> None:
    out = tmp_path / "tree.json"
    argv = ["--device", "cpu", "--dtype", "float32", "--tree", "2,1", "--batch-sizes", "1", "2"]
    assert main([*argv, "--context", "20", "--heads", "2", "1", "16", "--reps", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["query_len"] == 5 for r in rows)
    assert all(r["chain_ms"] > 0 and r["tree_ms"] > 0 for r in rows)
