"""The draft model under tensor parallelism: replicated on every rank, it drafts the same tokens
on each (its own module: one tensor-parallel engine per process, and test_tensor_parallel.py's
stays up for its whole module)."""

from __future__ import annotations

from services.engine.llm import LLM
from tests.services.engine.spec_decode.helpers import GREEDY, repetitive_prompts
from tests.services.engine.test_tensor_parallel import SHAPES


def test_replicated_draft_model_keeps_greedy_output_and_accepts_itself(make_checkpoint) -> None:
    """The target as its own (replicated) draft model: every draft passes on both ranks, so the
    ranks accept several tokens a step and must still agree."""
    arch, overrides = SHAPES["llama"]
    target = str(make_checkpoint(arch, **overrides))
    spec = dict(method="draft_model", model=target, num_speculative_tokens=3, adaptive=False)
    expected = LLM(target, device="cpu", max_model_len=192).generate(
        prompt_token_ids=repetitive_prompts(4), sampling_params=GREEDY
    )
    with LLM(
        target, device="cpu", max_model_len=192, tensor_parallel_size=2, speculative_config=spec
    ) as split:
        outputs = split.generate(prompt_token_ids=repetitive_prompts(4), sampling_params=GREEDY)
        assert split.engine.runner.rows_agree()
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    for o in outputs:
        assert o.spec_stats["acceptance_per_position"] == [1.0, 1.0, 1.0]
