"""`python -m benchmarks.hf_baseline` on a tiny random model: bench_engine's prompts, sane rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.random_model import write_random_checkpoint

pytest.importorskip("transformers")

from benchmarks.hf_baseline import main  # noqa: E402

OUTPUT_LEN = 8
LOOKUP = 4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint("llama-tiny", tmp_path_factory.mktemp("llama-tiny"))


def test_rows_time_every_batch_and_lookup_at_batch_1(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf.json"
    argv = ["--model", str(tiny_model), "--device", "cpu", "--dtype", "float32", "--batch-sizes", "1", "2"]
    argv += ["--prompt-len", "16", "--output-len", str(OUTPUT_LEN), "--prompt-lookup-num-tokens", str(LOOKUP)]
    assert main([*argv, "--out", str(out)]) == 0

    result = json.loads(out.read_text())
    assert result["attn_implementation"] == "sdpa" and result["device"] == "cpu"
    assert (result["prompt_len"], result["output_len"]) == (16, OUTPUT_LEN)
    rows = result["rows"]
    assert [(r["variant"], r["batch"]) for r in rows] == [("hf", 1), ("hf", 2), ("hf_prompt_lookup", 1)]
    for r in rows:
        assert r["output_tokens"] == r["batch"] * OUTPUT_LEN  # EOS never stops it
        assert r["output_tok_per_s"] == pytest.approx(r["output_tokens"] / r["seconds"])
        assert 0 < r["decode_ms_per_token"] <= r["decode_step_ms"]
        num_steps = OUTPUT_LEN / r["tokens_per_step"]  # stamps, the first one ending the prefill
        assert 0 < r["ttft_ms"] + (num_steps - 1) * r["decode_step_ms"] <= 1e3 * r["seconds"] * 1.0001
    for plain in rows[:2]:
        assert plain["tokens_per_step"] == 1.0
        assert plain["decode_ms_per_token"] == pytest.approx(plain["decode_step_ms"])
    assert 1.0 <= rows[2]["tokens_per_step"] <= LOOKUP + 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_says_why_it_cannot_run(tiny_model: Path, tmp_path: Path) -> None:
    assert main(["--model", str(tiny_model), "--device", "cuda", "--out", str(tmp_path / "x.json")]) == 2
