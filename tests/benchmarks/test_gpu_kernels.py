"""The quant_linear section's summary (benchmarks/gpu_kernels.py): the dispatch thresholds by kernel
and the findings the lead sets them from, on rows shaped as a GPU run writes them."""

from __future__ import annotations

from typing import Any

from benchmarks.gpu_kernels import quant_dispatch_findings, quant_thresholds, summarize_quant_dispatch


def _row(matrix: str, rows: int, path: str, times: dict[str, float], splits: int = 1) -> dict[str, Any]:
    row: dict[str, Any] = dict(model="qwen2.5-7b", matrix=matrix, rows=rows, int8_path=path, int4_path=path)
    for scheme in ("int8", "int4"):
        row.update({f"{scheme}_{key}_us": us for key, us in times.items()})
        row[f"{scheme}_tiled_splits"] = splits
        row[f"{scheme}_tiled_reduce"] = "reduce_kernel" if splits > 1 else "none"
    return row


def test_findings_name_the_slower_dispatches_and_each_split_products_faster_way() -> None:
    rows = [
        _row("o", 16, "tiled", dict(tiled=11.0, mma=13.0, gemv=30.0)),
        _row("gate_up", 16, "tiled", dict(tiled=80.0, mma=75.0, gemv=300.0)),
        _row(
            "down",
            16,
            "tiled",
            dict(tiled=40.0, mma=47.0, gemv=330.0, tiled_last_block=38.5, tiled_reduce_kernel=40.0),
            splits=15,
        ),
    ]
    findings = quant_dispatch_findings(rows)
    assert (
        "quant dispatch int4 rows= 16: fastest on 2/3: slower: qwen2.5-7b gate_up tiled 80.0 us vs mma 75.0"
        in findings
    )
    split_lines = [line for line in findings if line.startswith("quant split int4")]
    assert split_lines == [
        "quant split int4: last block faster / split products, by K splits: 15: 1/1; "
        "15 splits: qwen2.5-7b down rows=16 38.5 vs 40.0 us"
    ]


def test_the_thresholds_are_printed_by_kernel(capsys) -> None:
    thresholds = quant_thresholds()
    assert {"TILED_MIN_ROWS", "TILED_MAX_ROWS", "TILED_MIN_WIDTH", "LAST_BLOCK_MAX_SPLITS"} <= set(thresholds)
    summarize_quant_dispatch(
        [_row("o", 64, "tiled", dict(tiled=20.0, mma=33.0, dequantize=60.0))], thresholds
    )
    printed = capsys.readouterr().out
    assert f"quant_tiled TILED_MIN_ROWS={thresholds['TILED_MIN_ROWS']}" in printed
    assert "quant dispatch int4 rows= 64: fastest on 1/1" in printed
