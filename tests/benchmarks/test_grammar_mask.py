"""The grammar benchmark on CPU at a tiny size: the engine mode (both runs decode, and the grammar run
fills a mask every decode step) and the step-masks mode (the engine's fill, k + 1 rows a request,
under each schema and thread count; its answers follow their schemas)."""

from __future__ import annotations

import pytest

from benchmarks.grammar_mask import engine_step_cost, main, step_masks_cost
from shared.reference import default_model


def test_engine_mode_times_plain_and_constrained_steps() -> None:
    [row] = engine_step_cost(str(default_model()), "cpu", "float32", [2], max_tokens=6, repeats=1)
    assert row["batch"] == 2 and row["plain_step_ms"] > 0 and row["grammar_step_ms"] > 0
    assert row["num_fills"] >= 4  # a step's masks filled on every step of the constrained run
    assert row["mask_cost_fraction"] == (row["grammar_step_ms"] - row["plain_step_ms"]) / row["plain_step_ms"]


def test_step_masks_mode_times_the_engines_fill_per_schema_and_thread_count() -> None:
    rows = step_masks_cost(["code", "json_editing"], [2], [0, 2], [1, 2], num_steps=3, repeats=1)
    cells = [(row["schema"], row["threads"], row["batch"], row["k"], row["rows"]) for row in rows]
    assert cells == [
        (schema, threads, 2, k, 2 * (k + 1))
        for schema in ("code", "json_editing")
        for threads in (1, 2)
        for k in (0, 2)
    ]
    assert all(row["fill_ms_median"] > 0 for row in rows)


def test_step_masks_mode_refuses_a_thread_count_below_one(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--step-masks", "--threads", "2", "0"])
    assert "--threads must be at least 1" in capsys.readouterr().err
