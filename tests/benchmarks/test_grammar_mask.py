"""The grammar benchmark on CPU at a tiny size: the engine mode (both runs decode, and the grammar run
fills a mask every decode step) and the step-masks mode (the engine's fill, k + 1 rows a request)."""

from __future__ import annotations

from benchmarks.grammar_mask import engine_step_cost, step_masks_cost
from shared.reference import default_model


def test_engine_mode_times_plain_and_constrained_steps() -> None:
    [row] = engine_step_cost(str(default_model()), "cpu", "float32", [2], max_tokens=6, repeats=1)
    assert row["batch"] == 2 and row["plain_step_ms"] > 0 and row["grammar_step_ms"] > 0
    assert row["num_fills"] >= 4  # a step's masks filled on every step of the constrained run
    assert row["mask_cost_fraction"] == (row["grammar_step_ms"] - row["plain_step_ms"]) / row["plain_step_ms"]


def test_step_masks_mode_times_the_engines_fill_with_drafts() -> None:
    rows = step_masks_cost([2], [0, 2], num_steps=3, repeats=1, num_threads=2)
    assert [(row["batch"], row["k"], row["threads"]) for row in rows] == [(2, 0, 2), (2, 2, 2)]
    assert all(row["fill_ms_median"] > 0 for row in rows)
