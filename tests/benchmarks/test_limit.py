"""The close-to-the-limit table: each drafting method's ideal from its acceptance and the verify step's cost."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from benchmarks.limit import limit_rows, main


def offline_cell(
    method: str, concurrency: int, drafts: int, accepted: int, steps: int, tpot: float, decode_steps: int = 0
) -> dict:
    """A cell of 10 requests whose decode steps (`steps` of them with drafts) kept their tokens."""
    spec = (
        {
            "num_draft_tokens": drafts,
            "num_accepted_tokens": accepted,
            "num_verify_steps": steps,
            "mean_accepted_length": 1 + accepted / steps if steps else 0.0,
        }
        if drafts
        else None
    )
    return {
        "method": method,
        "concurrency": concurrency,
        "summary": {
            "speculative": spec,
            "num_completed": 10,
            "output_tokens": 10 + accepted + max(decode_steps, steps),
        },
        "tpot_speedup": tpot,
    }


VERIFY_COST = {
    "card": "test card",
    "rows": [
        {"k": 1, "batch": 1, "ratio": 1.1},
        {"k": 3, "batch": 1, "ratio": 1.3},
        {"k": 3, "batch": 16, "ratio": 2.0},
    ],
}


def test_ideal_is_accepted_length_over_the_verify_cost_at_the_mean_drafts() -> None:
    offline = {
        "cells": [
            offline_cell("naive", 1, 0, 0, 0, 1.0),
            offline_cell("mtp", 1, 300, 150, 100, 1.8),  # 3 drafts a step: ratio 1.3, L = 2.5
            offline_cell("ngram", 1, 200, 100, 100, 1.5, decode_steps=400),  # 2 a step: ratio 1.2, L = 2
            offline_cell("ngram", 16, 200, 100, 100, 1.5),  # not concurrency 1
        ]
    }
    rows = limit_rows(offline, VERIFY_COST)
    assert [r["method"] for r in rows] == ["mtp", "ngram"]
    mtp, ngram = rows
    assert mtp["verify_ratio"] == pytest.approx(1.3)
    assert mtp["ideal"] == pytest.approx(2.5 / 1.3)
    assert mtp["share_of_ideal"] == pytest.approx(1.8 / (2.5 / 1.3))
    assert ngram["mean_drafts"] == pytest.approx(2.0)
    assert ngram["verify_ratio"] == pytest.approx(1.2)  # interpolated between k = 1 and 3
    assert ngram["ideal"] == pytest.approx(2.0 / 1.2)
    assert mtp["drafted_share"] == 1.0
    assert mtp["ideal_at_share"] == pytest.approx(mtp["ideal"])
    assert ngram["drafted_share"] == pytest.approx(0.25)  # 100 of 400 decode steps drafted
    assert ngram["ideal_at_share"] == pytest.approx((0.25 * 2.0 + 0.75) / (0.25 * 1.2 + 0.75))


def test_more_drafts_than_the_verify_costs_measured_is_refused() -> None:
    offline = {"cells": [offline_cell("suffix", 1, 800, 300, 100, 2.0)]}
    with pytest.raises(ValueError, match="k = 3"):
        limit_rows(offline, VERIFY_COST)


def test_command_reads_gzipped_results_and_prints_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    offline = tmp_path / "offline.json.gz"
    with gzip.open(offline, "wt") as f:
        json.dump({"cells": [offline_cell("mtp", 1, 300, 150, 100, 1.8)]}, f)
    verify = tmp_path / "vc.json"
    verify.write_text(json.dumps(VERIFY_COST))
    out = tmp_path / "limit.json"
    main(["--offline", str(offline), "--verify-cost", str(verify), "--out", str(out)])
    printed = capsys.readouterr().out
    assert "card: test card" in printed
    assert "| mtp | 2.50 | 3.00 | 1.300 | 1.92x | 100% | 1.92x | 1.80x | 94% | 94% |" in printed
    assert json.loads(out.read_text())["rows"][0]["method"] == "mtp"
