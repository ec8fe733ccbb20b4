"""On a GPU the same engine code gives the same greedy tokens as the CPU reference path."""

from __future__ import annotations

import pytest
import torch

from services.engine.llm import LLM
from shared.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_greedy_on_gpu_float32_matches_cpu(make_checkpoint) -> None:
    path = str(make_checkpoint("llama", num_hidden_layers=3))
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 384, (n,), generator=generator).tolist() for n in (5, 30, 61, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    cpu = LLM(path, device="cpu", max_model_len=128).generate(
        prompt_token_ids=prompts, sampling_params=params
    )
    gpu_llm = LLM(path, device="cuda", dtype="float32", max_model_len=128, max_num_batched_tokens=40)
    gpu = gpu_llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]


def test_bfloat16_on_gpu_runs_and_sizes_kv_from_memory(make_checkpoint) -> None:
    llm = LLM(str(make_checkpoint("qwen2")), device="cuda", max_model_len=256, gpu_memory_utilization=0.5)
    assert llm.engine.runner.dtype == torch.bfloat16
    assert llm.engine.runner.num_kv_blocks > 0
    out = llm.generate(
        prompt_token_ids=[[5, 6, 7]] * 8,
        sampling_params=SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True),
    )
    assert all(len(o.token_ids) == 16 for o in out)
