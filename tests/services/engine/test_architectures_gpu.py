"""On a GPU (the fused kernels): the new architectures' greedy output equals transformers' (float32),
and a model whose attention soft-capping the CUDA kernel lacks is refused by name."""

from __future__ import annotations

import pytest
import torch

from services.engine.llm import LLM
from shared.model import ModelConfigError
from shared.sampling_params import SamplingParams
from tests.services.engine.test_architectures import CASES, MAX_TOKENS, prompts, transformers_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("case", sorted(set(CASES) - {"gemma2-softcapped"}))
def test_greedy_on_gpu_matches_transformers(make_checkpoint, case: str) -> None:
    arch, overrides = CASES[case]
    path = make_checkpoint(arch, **overrides)
    llm = LLM(str(path), device="cuda", dtype="float32", max_model_len=64, block_size=16)
    outputs = llm.generate(prompt_token_ids=prompts(), sampling_params=GREEDY)
    assert [o.token_ids for o in outputs] == transformers_greedy(path)


def test_attention_softcapping_is_refused_on_the_cuda_kernel(make_checkpoint) -> None:
    arch, overrides = CASES["gemma2-softcapped"]
    with pytest.raises(ModelConfigError, match="attn_logit_softcapping"):
        LLM(str(make_checkpoint(arch, **overrides)), device="cuda", dtype="float32", max_model_len=64)
