"""Latency records, their summary, SLO goodput, speculation counters and the speedup pairing."""

from __future__ import annotations

import random

import pytest

from benchmarks.compare import add_speedups, markdown_table
from benchmarks.metrics import SLO, RequestRecord, SpecCounts, distribution_ms, summarize


def record(
    ttft_s: float, gaps_s: list[float], num_tokens: int | None = None, start: float = 10.0
) -> RequestRecord:
    times = [start + ttft_s]
    for gap in gaps_s:
        times.append(times[-1] + gap)
    r = RequestRecord("r", "w", arrived_at=start, token_times=times, finished_at=times[-1])
    r.num_output_tokens = num_tokens if num_tokens is not None else len(times)
    return r


def test_latencies_of_one_request() -> None:
    r = record(0.5, [0.1, 0.3], num_tokens=5)  # the second chunk carried 3 tokens (a speculative step)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.e2e_s == pytest.approx(0.9)
    assert r.tpot_s == pytest.approx(0.4 / 4)  # per token after the first, not per chunk
    assert r.itls_s == pytest.approx([0.1, 0.3])
    assert record(0.2, [], num_tokens=1).tpot_s is None


def test_percentiles_are_ordered_and_in_milliseconds() -> None:
    rng = random.Random(0)
    values = [rng.expovariate(10.0) for _ in range(1000)]
    d = distribution_ms(values)
    assert d["p50"] <= d["p90"] <= d["p99"] <= max(values) * 1000
    assert d["mean"] == pytest.approx(sum(values) / len(values) * 1000)
    assert distribution_ms([]) == {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}


def test_summary_throughput_and_goodput() -> None:
    fast = record(0.1, [0.01] * 9)  # 10 tokens, TPOT 10 ms
    slow = record(2.0, [0.05] * 9)  # TTFT 2 s
    failed = RequestRecord("x", "w", arrived_at=10.0, error="HTTP 500")
    summary = summarize([fast, slow, failed], duration_s=4.0, slo=SLO(ttft_ms=500, tpot_ms=20))
    assert summary["num_completed"] == 2 and summary["num_failed"] == 1
    assert summary["output_tokens"] == 20
    assert summary["output_tok_per_s"] == pytest.approx(5.0)
    assert summary["requests_per_s"] == pytest.approx(0.5)
    assert summary["goodput_requests_per_s"] == pytest.approx(0.25)  # only `fast` meets both
    assert summary["slo_attainment"] == pytest.approx(1 / 3)
    assert summary["errors"] == ["HTTP 500"]


def test_spec_counts_sum_and_define_accepted_length() -> None:
    total = SpecCounts()
    total.add(
        SpecCounts.from_stats(
            {
                "num_draft_tokens": 6,
                "num_accepted_tokens": 3,
                "num_verify_steps": 3,
                "drafted_per_position": [3, 2, 1],
                "accepted_per_position": [2, 1, 0],
            }
        )
    )
    total.add(
        SpecCounts.from_stats(
            {
                "num_draft_tokens": 2,
                "num_accepted_tokens": 2,
                "num_verify_steps": 2,
                "drafted_per_position": [2],
                "accepted_per_position": [2],
            }
        )
    )
    summary = total.summary()
    assert summary["drafted_per_position"] == [5, 2, 1]
    assert summary["accepted_per_position"] == [4, 1, 0]
    assert summary["acceptance_per_position"] == pytest.approx([0.8, 0.5, 0.0])
    assert summary["acceptance_rate"] == pytest.approx(5 / 8)
    assert summary["mean_accepted_length"] == pytest.approx((5 + 5) / 5)  # bonus token included
    assert SpecCounts().summary()["mean_accepted_length"] == 1.0


def cell(method: str, tok_per_s: float, tpot_p50: float, concurrency: int = 1) -> dict:
    spec = SpecCounts().summary()
    dist = {"mean": 1.0, "p50": tpot_p50, "p90": tpot_p50, "p99": tpot_p50}
    summary = {
        "output_tok_per_s": tok_per_s,
        "requests_per_s": 1.0,
        "goodput_requests_per_s": 1.0,
        "num_failed": 0,
        "ttft_ms": dist,
        "tpot_ms": dist,
        "itl_ms": dist,
        "e2e_ms": dist,
        "speculative": spec,
    }
    return {
        "method": method,
        "workload": "w",
        "concurrency": concurrency,
        "request_rate": None,
        "summary": summary,
    }


def test_speedup_pairs_each_cell_with_naive_of_the_same_key() -> None:
    cells = add_speedups(
        [
            cell("naive", 10.0, 20.0),
            cell("ngram", 25.0, 8.0),
            cell("naive", 100.0, 40.0, 16),
            cell("ngram", 50.0, 80.0, 16),
        ]
    )
    assert [c["speedup"] for c in cells] == pytest.approx([1.0, 2.5, 1.0, 0.5])
    assert [c["tpot_speedup"] for c in cells] == pytest.approx([1.0, 2.5, 1.0, 0.5])
    assert add_speedups([cell("ngram", 1.0, 1.0)])[0]["speedup"] is None
    table = markdown_table(cells)
    assert table.count("\n") == 5 and "2.50x" in table and "0.50x" in table


def test_overhead_is_mesh_minus_in_process() -> None:
    from benchmarks.overhead import overhead_row, overhead_table

    in_process, mesh = cell("naive", 100.0, 10.0), cell("naive", 80.0, 12.5)
    mesh["backend"] = "mesh"
    row = overhead_row(in_process, mesh)
    assert row["tpot_ms_overhead_p50"] == pytest.approx(2.5)
    assert row["throughput_ratio"] == pytest.approx(0.8)
    assert "(+2.5)" in overhead_table([row]) and "(0.80x)" in overhead_table([row])


def test_the_split_mesh_is_a_column_beside_mixed() -> None:
    from benchmarks.overhead import overhead_row, overhead_table

    in_process, mesh, split = cell("naive", 100.0, 10.0), cell("naive", 90.0, 11.0), cell("naive", 85.0, 12.0)
    mesh["backend"], split["backend"] = "mesh", "mesh-pd"
    mesh["summary"]["cores_busy"] = {"mixed": 0.4, "mixed/engine-core": 0.9}
    split["summary"]["cores_busy"] = {"prefill": 0.1, "decode/engine-core": 0.8}
    row = overhead_row(in_process, mesh, split)
    assert row["throughput_ratio_pd"] == pytest.approx(0.85) and row["tpot_ms_overhead_pd_p50"] == 2.0
    table = overhead_table([row])
    assert "in-process / mesh / pd" in table and "(0.90x, 0.85x)" in table and "(+1.0, +2.0)" in table
    assert "| mesh-pd |" in table and "decode/engine-core cores" in table


def test_worker_per_position_counters_are_parsed() -> None:
    from benchmarks.launch import _per_position, _total

    page = (
        "# HELP specmesh_worker_drafted_per_position_total Drafts verified at each position\n"
        'specmesh_worker_drafted_per_position_total{instance="a",position="1",role="mixed"} 4.0\n'
        'specmesh_worker_drafted_per_position_total{instance="a",position="0",role="mixed"} 9.0\n'
        'specmesh_worker_accepted_per_position_total{instance="a",position="0",role="mixed"} 7.0\n'
    )
    assert _per_position(page, "specmesh_worker_drafted_per_position_total") == [9, 4]
    assert _per_position(page, "specmesh_worker_accepted_per_position_total") == [7]
    assert _per_position(page, "specmesh_worker_missing_total") == []
    assert _total(page, "specmesh_worker_drafted_per_position_total") == 13.0
