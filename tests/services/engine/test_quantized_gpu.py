"""Quantized weights on a GPU: the model through the CUDA kernels stays close to the torch reference
of the same quantized model, and the engine's CUDA graphs replay the quantized step exactly as it
runs eagerly, for every scheme (naive and n-gram drafting; a padded bf16 batch may round
differently, so a late divergence is allowed, not an early one, as for bf16 in test_cuda_graph)."""

from __future__ import annotations

import pytest
import torch

from kernels.quant_gemm import FP8_GEMV_MAX_ROWS
from services.engine.llm import LLM
from shared.model import load_model
from tests.services.engine.spec_decode.helpers import GREEDY, repetitive_prompts
from tests.services.engine.test_quantized import METHODS, SHAPE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("quantization", METHODS)
@torch.no_grad()
def test_kernels_match_the_reference_of_the_same_quantized_model(make_checkpoint, quantization: str) -> None:
    """Logits of 1, 8 (the one-row kernel) and 40 token rows (tensor cores / dequantize + cuBLAS)
    in bf16 on CUDA against the float32 torch reference of the same quantized weights (CPU)."""
    path = make_checkpoint("llama", **SHAPE)
    cuda = load_model(path, torch.bfloat16, torch.device("cuda"), 64, quantization=quantization)
    reference = load_model(path, torch.float32, torch.device("cpu"), 64, quantization=quantization)
    # int8 / int4 layers on the GPU run quant_tiled over the tile layout made at load
    assert (cuda.layers[0].mlp.gate_up_proj.tiled is not None) == (quantization != "fp8")
    generator = torch.Generator().manual_seed(12)
    for num_rows in (1, 8, 40):
        hidden = torch.randn(num_rows, SHAPE["hidden_size"], generator=generator)
        for got, want in zip(
            (
                cuda.layers[0].mlp(hidden.to("cuda", torch.bfloat16)),
                cuda.layers[0].self_attn.qkv_proj(hidden.cuda().bfloat16()),
            ),
            (reference.layers[0].mlp(hidden), reference.layers[0].self_attn.qkv_proj(hidden)),
        ):
            error = float((got.double().cpu() - want.double()).norm() / want.double().norm())
            # bf16 activations; FP8 past FP8_GEMV_MAX_ROWS rows also quantizes them per token
            # (3 mantissa bits: a few percent a product, two in the MLP)
            assert error < (8e-2 if quantization == "fp8" and num_rows > FP8_GEMV_MAX_ROWS else 2e-2), (
                f"{num_rows} rows: {error:.2e}"
            )


@pytest.mark.parametrize("quantization", METHODS)
def test_cuda_graphs_replay_the_quantized_step_as_it_runs_eagerly(make_checkpoint, quantization: str) -> None:
    path = str(make_checkpoint("llama", **SHAPE))
    for spec in ({}, {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}):
        outputs = []
        for eager in (False, True):
            llm = LLM(
                path,
                device="cuda",
                max_model_len=192,
                quantization=quantization,
                enforce_eager=eager,
                speculative_config=spec,
                gpu_memory_utilization=0.3,
            )
            result = llm.generate(prompt_token_ids=repetitive_prompts(4), sampling_params=GREEDY)
            graphs = llm.engine.runner.graphs
            assert graphs is None if eager else graphs is not None and graphs.num_replays > 10
            outputs.append([o.token_ids[:8] for o in result])
        assert outputs[0] == outputs[1], f"{quantization} {spec or 'naive'}"
