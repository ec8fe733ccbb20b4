"""A quantized target in the engine: greedy speculative output equals naive decoding of the same
quantized target for every drafting method (the MTP head and the draft model quantized with it),
and `--quantization` is checked where users set it (LLM, EngineConfig, `specmesh generate`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.engine.llm import LLM
from shared.config import EngineConfig
from shared.model import ModelConfigError
from shared.model.quant_config import QuantScheme
from shared.model.quantization import QuantizedLinear
from tests.services.engine.spec_decode.helpers import GREEDY, repetitive_prompts
from tests.services.engine.test_tensor_parallel import random_mtp_head

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
METHODS = ("fp8", "int8", "int4")
REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def target(make_checkpoint) -> str:
    return str(make_checkpoint("llama", **SHAPE))


@pytest.fixture(scope="module")
def mtp_head(target) -> str:
    return random_mtp_head(target)


@pytest.fixture(scope="module")
def unquantized_tokens(target) -> list[list[int]]:
    return greedy_tokens(quantized_llm(target, None))[0]


def speculative_configs(target: str, mtp_head: str) -> dict[str, dict]:
    return {
        "ngram": dict(method="ngram", num_speculative_tokens=4, prompt_lookup_max=3),
        "suffix": dict(method="suffix", num_speculative_tokens=6),
        "mtp": dict(method="mtp", model=mtp_head, num_speculative_tokens=2),
        "draft_model": dict(method="draft_model", model=target, num_speculative_tokens=3),
    }


def quantized_llm(target: str, quantization: str | None, **spec) -> LLM:
    speculative_config = {**spec, "adaptive": False} if spec else {}
    return LLM(
        target,
        device="cpu",
        max_model_len=192,
        quantization=quantization,
        speculative_config=speculative_config,
    )


def greedy_tokens(llm: LLM) -> tuple[list[list[int]], list[float]]:
    outputs = llm.generate(prompt_token_ids=repetitive_prompts(4), sampling_params=GREEDY)
    lengths = [float(o.spec_stats.get("mean_accepted_length", 1.0)) for o in outputs]  # type: ignore[arg-type]
    return [o.token_ids for o in outputs], lengths


@pytest.mark.parametrize("quantization", METHODS)
def test_speculative_output_equals_naive_with_the_same_quantized_target(
    target, mtp_head, unquantized_tokens, quantization
) -> None:
    naive, _ = greedy_tokens(quantized_llm(target, quantization))
    assert naive != unquantized_tokens  # the quantized target really is another model
    for method, spec in speculative_configs(target, mtp_head).items():
        llm = quantized_llm(target, quantization, **spec)
        runner = llm.engine.runner
        assert runner.quantization == QuantScheme.default(quantization)
        drafting = runner.mtp_head.layer.mlp.down_proj if runner.mtp_head else None
        drafting = runner.draft_model.layers[0].mlp.down_proj if runner.draft_model else drafting
        assert drafting is None or isinstance(drafting, QuantizedLinear)
        tokens, accepted_lengths = greedy_tokens(llm)
        assert tokens == naive, f"{method} with {quantization}"
        if method == "draft_model":  # the quantized target drafting for itself: its drafts pass
            assert min(accepted_lengths) > 2.0


def test_bad_quantization_values_are_refused_with_the_choices(target, make_checkpoint) -> None:
    with pytest.raises(ValidationError, match="'fp8', 'int8' or 'int4'"):
        EngineConfig(model=target, quantization="int3")  # type: ignore[arg-type]
    small = str(make_checkpoint("llama"))  # hidden_size 96: no whole groups of 128
    with pytest.raises(ModelConfigError, match=r"qkv_proj cannot be quantized as int4 \(groups of 128\)"):
        LLM(small, device="cpu", max_model_len=64, quantization="int4")
    draft = str(REPO_ROOT / "models" / "specmesh-code-draft")  # 192 input features
    with pytest.raises(
        ModelConfigError, match=rf"{draft}: layers.0.self_attn.qkv_proj cannot be quantized as int4"
    ):
        LLM(
            target,
            device="cpu",
            max_model_len=64,
            quantization="int4",
            speculative_config={"method": "draft_model", "model": draft},
        )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "generate",
            "--model",
            target,
            "--prompt",
            "x",
            "--quantization",
            "int3",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "invalid choice: 'int3' (choose from 'fp8', 'int8', 'int4')" in result.stderr


def test_generate_quantizes_at_load_and_says_so(target) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "generate",
            "--model",
            target,
            "--prompt",
            "def f(x):",
            "--max-tokens",
            "4",
            "--device",
            "cpu",
            "--quantization",
            "int4",
            "--max-model-len",
            "64",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "weights int4 (groups of 128)" in result.stderr
