"""The EAGLE-3 head under tensor parallelism: replicated with its KV cache, every rank drafts the
same chain from the same target streams (its own module: one tensor-parallel engine per process,
and test_tensor_parallel.py's stays up for its whole module)."""

from __future__ import annotations

from services.engine.llm import LLM
from shared.sampling_params import SamplingParams
from tests.services.engine.spec_decode.helpers import GREEDY, eagle3_head_for, repetitive_prompts
from tests.services.engine.test_tensor_parallel import SHAPES

SEEDED = SamplingParams(temperature=0.8, top_k=40, seed=3, max_tokens=20, ignore_eos=True)


def test_eagle3_output_of_two_ranks_is_one_ranks(make_checkpoint) -> None:
    arch, overrides = SHAPES["llama"]
    target = str(make_checkpoint(arch, **overrides))
    spec = dict(method="eagle3", model=str(eagle3_head_for(target)), num_speculative_tokens=3, adaptive=False)
    single = LLM(target, device="cpu", max_model_len=192, speculative_config=spec)
    expected = [
        single.generate(prompt_token_ids=repetitive_prompts(4), sampling_params=p) for p in (GREEDY, SEEDED)
    ]
    with LLM(
        target, device="cpu", max_model_len=192, tensor_parallel_size=2, speculative_config=spec
    ) as split:
        outputs = [
            split.generate(prompt_token_ids=repetitive_prompts(4), sampling_params=p)
            for p in (GREEDY, SEEDED)
        ]
        assert split.engine.runner.rows_agree()
    for got, want in zip(outputs, expected):
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert sum(o.spec_stats["num_draft_tokens"] for o in got) > 0
