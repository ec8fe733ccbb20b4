"""The grammar benchmark's engine mode, on CPU at a tiny size: both runs decode, and the grammar run
fills a mask every decode step."""

from __future__ import annotations

from benchmarks.grammar_mask import engine_step_cost
from shared.reference import default_model


def test_engine_mode_times_plain_and_constrained_steps() -> None:
    [row] = engine_step_cost(str(default_model()), "cpu", "float32", [2], max_tokens=6, repeats=1)
    assert row["batch"] == 2 and row["plain_step_ms"] > 0 and row["grammar_step_ms"] > 0
    assert row["num_fills"] >= 4  # a step's masks filled on every step of the constrained run
    assert row["mask_cost_fraction"] == (row["grammar_step_ms"] - row["plain_step_ms"]) / row["plain_step_ms"]
