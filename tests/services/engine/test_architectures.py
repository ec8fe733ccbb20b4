"""Greedy generation through the engine is token-identical to transformers `generate()` for every
architecture and RoPE scaling, with and without speculation (chunked prefill, paged KV, batching)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.engine.llm import LLM
from shared.sampling_params import SamplingParams
from tests.services.engine.test_generation import transformers_greedy
from tests.shared.model.test_hf_logits import GEMMA2_CAPPED, GEMMA3, YARN_ROPE, hf_model

MAX_TOKENS = 20
DYNAMIC_ROPE = {"rope_type": "dynamic", "factor": 2.0}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("qwen3", {"head_dim": 20}),
    "phi3": ("phi3", {"sliding_window": 9, "num_key_value_heads": 2}),
    "gemma2-softcapped": ("gemma2", GEMMA2_CAPPED),
    "gemma3": ("gemma3", {**GEMMA3, "final_logit_softcapping": 3.0}),
    "llama-yarn": ("llama", {"rope_scaling": YARN_ROPE, "max_position_embeddings": 64}),
    # prompts within the 32 pretrained positions, generation past them: every new token rescaled
    "llama-dynamic": ("llama", {"rope_scaling": DYNAMIC_ROPE, "max_position_embeddings": 32}),
}
PROMPT_LENGTHS = [5, 23]
SPECULATION: dict[str, dict[str, Any]] = {
    "plain": {},
    "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
}


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    # a repeated stretch, so n-gram drafts are proposed (and some accepted)
    return [(torch.randint(3, 384, (n,), generator=generator).tolist() * 2)[: n + 4] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def checkpoints(make_checkpoint) -> dict[str, Any]:
    return {case: make_checkpoint(arch, **overrides) for case, (arch, overrides) in CASES.items()}


@pytest.mark.parametrize("speculation", sorted(SPECULATION))
@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_matches_transformers(checkpoints, case: str, speculation: str) -> None:
    path = checkpoints[case]
    llm = LLM(
        str(path),
        device="cpu",
        max_model_len=64,
        block_size=4,
        max_num_batched_tokens=16,
        **SPECULATION[speculation],
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts(), sampling_params=greedy)
    assert [o.token_ids for o in outputs] == transformers_greedy(hf_model(path), prompts(), MAX_TOKENS)
