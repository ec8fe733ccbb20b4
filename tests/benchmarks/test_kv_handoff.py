"""The KV hand-off benchmark runs every hop through real processes and accounts for every byte."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.kv_handoff import KVShape

REPO = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.kv_handoff", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_every_hop_moves_every_layer_of_every_request(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    done = run("--num-requests", "3", "--num-layers", "2", "--num-tokens", "40", "--block-size", "16",
               "--concurrency", "2", "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    shape = KVShape(2, 8, 64, "bfloat16", 40, 16)
    hops = json.loads(out.read_text())["hops"]
    assert [hop["hop"] for hop in hops] == ["wire tcp", "channel", "import", "end-to-end tcp"]
    for hop in hops:
        assert hop["MB"] == round(3 * 2 * shape.layer_bytes / 1e6, 1)
        assert hop["MB_per_s"] > 0 and 0 <= hop["layer_latency_ms_p50"] <= hop["layer_latency_ms_p90"]


def test_the_ipc_transport_moves_every_request_by_handle_beside_tcp(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    done = run("--num-requests", "3", "--num-layers", "2", "--num-tokens", "40", "--hops", "wire", "end-to-end",
               "--transport", "tcp", "ipc", "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert [hop["hop"] for hop in report["hops"]] == [
        "wire tcp",
        "wire ipc",
        "end-to-end tcp",
        "end-to-end ipc",
    ]
    shape = KVShape(2, 8, 64, "bfloat16", 40, 16)
    assert {hop["MB"] for hop in report["hops"]} == {round(3 * 2 * shape.layer_bytes / 1e6, 1)}
    assert set(report["ratios"]) == {"wire ipc / tcp", "end-to-end ipc / tcp"}


def test_a_size_below_one_is_refused_by_name() -> None:
    done = run("--num-requests", "0")
    assert done.returncode == 2 and "--num-requests must be at least 1" in done.stderr


def test_the_prefill_hop_times_a_whole_and_a_streamed_hand_off(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    done = run("--num-requests", "2", "--num-layers", "2", "--num-tokens", "40", "--num-kv-heads", "2",
               "--head-dim", "16", "--dtype", "float32", "--hops", "prefill", "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    prefill = report["prefill_handoff"]
    assert set(prefill) == {"prefill whole", "prefill streamed", "ttlb streamed / whole"}
    for mode in ("prefill whole", "prefill streamed"):
        assert 0 < prefill[mode]["prefill_step_ms_mean"] <= prefill[mode]["ttlb_ms_mean"]
