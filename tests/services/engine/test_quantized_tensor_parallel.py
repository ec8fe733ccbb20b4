"""Quantized weights under tensor parallelism on CPU (2 ranks joined by gloo): the split engine keeps
the greedy output of one rank with the same quantization, the MTP head split and quantized with the
target (its own module: one tensor-parallel engine per process at a time)."""

from __future__ import annotations

import pytest

from services.engine.llm import LLM
from tests.services.engine.spec_decode.helpers import GREEDY, repetitive_prompts
from tests.services.engine.test_quantized import SHAPE
from tests.services.engine.test_tensor_parallel import random_mtp_head


@pytest.mark.parametrize("quantization", ["int4", "fp8"])
def test_two_ranks_keep_the_greedy_output_of_one(make_checkpoint, quantization: str) -> None:
    """int4: row-parallel layers split whole groups of 128 (scales by columns); fp8: per-channel
    scales of row-parallel layers replicated."""
    target = str(make_checkpoint("llama", **SHAPE))
    spec = dict(method="mtp", model=random_mtp_head(target), num_speculative_tokens=2, adaptive=False)
    prompts = repetitive_prompts(4)

    def run(tensor_parallel_size: int) -> list[list[int]]:
        with LLM(
            target,
            device="cpu",
            max_model_len=192,
            quantization=quantization,
            tensor_parallel_size=tensor_parallel_size,
            speculative_config=spec,
        ) as llm:
            outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
            assert llm.engine.runner.rows_agree()
            return [o.token_ids for o in outputs]

    assert run(2) == run(1)
