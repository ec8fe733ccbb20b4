"""Tensor parallelism on GPUs (the peer all-reduce and NCCL, CUDA graphs captured with the
collectives inside): the same greedy tokens as one GPU, for every speculative method. Run by
`scripts/gpu_check.sh tp`."""

from __future__ import annotations

import pytest
import torch

from services.engine.llm import LLM
from tests.services.engine.spec_decode.helpers import GREEDY, repetitive_prompts
from tests.services.engine.spec_decode.test_async_scheduling import count_ahead
from tests.services.engine.test_tensor_parallel import OVERRIDES, SHAPES, random_mtp_head

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_greedy_output_of_two_gpus_is_one_gpus(make_checkpoint, shape: str) -> None:
    """Decode steps launched ahead on both GPUs (each completes them from its own input batch,
    between a graph's copy-in and its replay) give one GPU's tokens, and so do the same two GPUs
    with asynchronous scheduling off."""
    arch, overrides = SHAPES[shape]
    target = str(make_checkpoint(arch, **overrides))
    spec = dict(method="mtp", model=random_mtp_head(target), num_speculative_tokens=3, adaptive=False)
    settings = dict(device="cuda", dtype="float32", max_model_len=192, speculative_config=spec)
    outputs = {}
    for size in (1, 2):
        with LLM(target, tensor_parallel_size=size, **settings) as llm:
            assert llm.engine.runner.graphs is not None
            ahead = count_ahead(llm.engine)
            outputs[size] = generate_each_method(llm)
            assert ahead[0] > 20
            if size == 2:
                assert llm.engine.runner.rows_agree()
                assert llm.engine.runner.tp.peer is not None  # the peer all-reduce, the default
                llm.engine.config.async_scheduling = False
                outputs["2-sync"] = generate_each_method(llm)
                assert llm.engine.runner.rows_agree()
    assert outputs[2] == outputs[1]
    assert outputs["2-sync"] == outputs[1]


def generate_each_method(llm: LLM) -> dict[str, list[list[int]]]:
    """Greedy tokens of the prompts under each speculative method."""
    return {
        method: [
            o.token_ids
            for o in llm.generate(
                prompt_token_ids=repetitive_prompts(4),
                sampling_params=GREEDY.model_copy(update={"speculative": override}),
            )
        ]
        for method, override in OVERRIDES.items()
    }
