"""A chained draft launches its model's kernels and the sampler, nothing else: no gathers, copies,
cats, fills or adds per draft (their inputs are computed once before the chain), counted on CPU
by `benchmarks.chain_launches` as a GPU would launch them."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.chain_launches import (
    ATTENTION,
    CAST,
    GEMM,
    chain_launches,
    others,
    per_chained_draft,
    write_models,
)

MODEL_KERNELS = {GEMM, ATTENTION, CAST, "fused_add_rms_norm", "rotary_write_kv", "silu_and_mul"}
"""What a decoder layer and an LM head launch (the cast: the LM head's float32 logits)."""


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    return write_models(tmp_path_factory.mktemp("chain"))


def test_a_chained_mtp_draft_is_the_heads_layer_one_input_kernel_and_the_sampler(models) -> None:
    target, methods = models
    extra = per_chained_draft(*(chain_launches(target, methods["mtp"], k) for k in (3, 2)))
    # eh_proj, qkv, o, gate_up, down, LM head; one attention
    assert extra[GEMM] == 6 and extra[ATTENTION] == 1
    assert set(extra) <= MODEL_KERNELS | {"embed_norm_concat", "verify_sample"}, extra
    assert extra["embed_norm_concat"] == 1 and extra["verify_sample"] == 1
    assert extra["fused_add_rms_norm"] == 3  # the layer's two and the final one (with the last residual add)
    assert others(extra) <= 8


def test_a_chained_draft_models_draft_is_the_model_and_the_sampler(models) -> None:
    target, methods = models
    extra = per_chained_draft(*(chain_launches(target, methods["draft_model"], k) for k in (3, 2)))
    assert set(extra) <= MODEL_KERNELS | {"embedding", "verify_sample"}, extra
    assert extra["embedding"] == 1 and extra["verify_sample"] == 1
