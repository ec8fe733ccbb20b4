"""The online benchmark end to end on CPU: a launched mesh per method, the reference model, 6 short
requests; the result file and plots exist and are sane."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from benchmarks import serving
from shared.reference import default_model
from tests.benchmarks.smoke_workload import write_smoke_workload

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
    # services/serve.py's Mesh.start hands each child its log file and drops the handle (a CLI that
    # exits soon after); the garbage collector then closes it, with a ResourceWarning
    pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning"),
]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NGRAM_K = 5


@pytest.fixture(scope="module")
def smoke_result(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    tmp = tmp_path_factory.mktemp("serving-smoke")
    workload = write_smoke_workload(tmp / "code_editing.jsonl", num_requests=6, max_tokens=24)
    out = tmp / "serving.json"
    serving.main(
        [
            "--launch",
            "--model",
            default_model(),
            "--device",
            "cpu",
            "--max-model-len",
            "512",
            "--num-kv-blocks",
            "256",
            "--torch-threads",
            "1",
            "--workload",
            str(workload),
            "--concurrency",
            "3",
            "--methods",
            "naive",
            "ngram",
            "--slo-ttft-ms",
            "60000",
            "--slo-tpot-ms",
            "10000",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    return json.loads(out.read_text()), out


def test_writes_json_and_plots(smoke_result: tuple[dict[str, Any], Path]) -> None:
    result, out = smoke_result
    assert result["kind"] == "serving" and result["date"] and result["machine"]["cpu_count"]
    assert "benchmarks.serving" in result["command"]
    for name in ("speedup", "acceptance", "latency_cdf"):
        png = out.with_name(f"{out.stem}_{name}.png")
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000


def test_every_request_completes_with_sane_latencies(smoke_result: tuple[dict[str, Any], Path]) -> None:
    result, _ = smoke_result
    assert [c["method"] for c in result["cells"]] == ["naive", "ngram"]
    for cell in result["cells"]:
        summary = cell["summary"]
        assert summary["num_completed"] == summary["num_requests"] == 6, summary["errors"]
        assert summary["output_tokens"] == 6 * 24 or summary["output_tokens"] > 0
        assert summary["output_tok_per_s"] > 0 and summary["requests_per_s"] > 0
        assert 0 < summary["goodput_requests_per_s"] <= summary["requests_per_s"] + 1e-9
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            d = summary[metric]
            assert 0 < d["p50"] <= d["p90"] <= d["p99"], (metric, d)
        assert summary["ttft_ms"]["p99"] <= summary["e2e_ms"]["p99"]
        assert len(cell["records"]) == 6 and all(r["ok"] for r in cell["records"])


def test_speedup_is_a_side_by_side_ratio(smoke_result: tuple[dict[str, Any], Path]) -> None:
    result, _ = smoke_result
    naive, ngram = result["cells"]
    assert naive["speedup"] == pytest.approx(1.0)
    expected = ngram["summary"]["output_tok_per_s"] / naive["summary"]["output_tok_per_s"]
    assert ngram["speedup"] == pytest.approx(expected)
    assert ngram["tpot_speedup"] > 0


def test_accepted_rates_are_in_range(smoke_result: tuple[dict[str, Any], Path]) -> None:
    result, _ = smoke_result
    naive, ngram = (c["summary"]["speculative"] for c in result["cells"])
    assert naive["num_draft_tokens"] == 0 and naive["mean_accepted_length"] == 1.0
    assert ngram["num_verify_steps"] > 0 and ngram["num_draft_tokens"] > 0
    assert 0.0 <= ngram["acceptance_rate"] <= 1.0
    assert 1.0 <= ngram["mean_accepted_length"] <= NGRAM_K + 1
    per_position = ngram["acceptance_per_position"]
    assert 1 <= len(per_position) <= NGRAM_K
    assert all(0.0 <= a <= 1.0 for a in per_position)
    assert sum(ngram["accepted_per_position"]) == ngram["num_accepted_tokens"]


def test_each_mesh_process_cpu_is_measured(smoke_result: tuple[dict[str, Any], Path]) -> None:
    """The cores each process kept busy: the worker's engine core generated every token, so it used
    CPU, and its bus side published them; none can use more than the machine has."""
    result, _ = smoke_result
    for cell in result["cells"]:
        busy = cell["summary"]["cores_busy"]
        roles = {"redis", "scheduler", "suffix-cache", "mixed", "mixed/engine-core", "gateway", "client"}
        assert set(busy) == roles
        assert busy["mixed/engine-core"] > 0.05 and busy["mixed"] > 0 and busy["gateway"] > 0
        assert all(0 <= cores <= result["machine"]["cpu_count"] + 0.5 for cores in busy.values()), busy
