"""Greedy generation is token-identical to transformers `generate()`, however the engine batches."""

from __future__ import annotations

import pytest
import torch

from services.engine.llm import LLM
from shared.sampling_params import SamplingParams

PROMPT_LENGTHS = [3, 17, 40, 64, 9, 33]
MAX_TOKENS = 24


def prompts(count: int = len(PROMPT_LENGTHS)) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, 384, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS[:count]]


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint("llama", num_hidden_layers=3)


def transformers_greedy(model, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Exactly `max_tokens` greedy tokens after each prompt from a transformers model's generate()."""
    outputs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            generated = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(generated[0, len(ids) :].tolist())
    return outputs


@pytest.fixture(scope="module")
def expected(checkpoint) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return transformers_greedy(model, prompts(), MAX_TOKENS)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

ENGINE_VARIANTS = {
    "chunked+prefix": dict(
        enable_chunked_prefill=True, enable_prefix_caching=True, max_num_batched_tokens=32
    ),
    "no-chunk": dict(enable_chunked_prefill=False, enable_prefix_caching=False),
    "chunked-no-prefix": dict(
        enable_chunked_prefill=True, enable_prefix_caching=False, max_num_batched_tokens=20
    ),
    # 12 blocks of 8 tokens: fewer than the batch needs, so sequences are preempted and recomputed
    "preemption": dict(num_kv_blocks=12, block_size=8, max_num_batched_tokens=40),
    "one-seq-at-a-time": dict(max_num_seqs=1),
}


@pytest.mark.parametrize("variant", sorted(ENGINE_VARIANTS))
def test_greedy_matches_transformers(checkpoint, expected, variant: str) -> None:
    llm = LLM(str(checkpoint), device="cpu", max_model_len=96, **ENGINE_VARIANTS[variant])
    outputs = llm.generate(prompt_token_ids=prompts(), sampling_params=GREEDY)
    assert [o.token_ids for o in outputs] == expected
    if variant == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_cache_reuses_blocks_and_keeps_output(checkpoint, expected) -> None:
    llm = LLM(str(checkpoint), device="cpu", max_model_len=96, block_size=4)
    first = llm.generate(prompt_token_ids=prompts(), sampling_params=GREEDY)
    again = llm.generate(prompt_token_ids=prompts(), sampling_params=GREEDY)
    assert [o.token_ids for o in again] == [o.token_ids for o in first] == expected
    assert sum(o.num_cached_prompt_tokens for o in again) > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_prefill_chunks_beside_decodes_are_cut_to_the_graph_limit(checkpoint, expected) -> None:
    """With a prefill chunk limit (a GPU engine's CUDA-graph prefill class), a prompt that joins
    while others decode is prefilled in chunks of at most that many tokens; a step without
    decoding requests spends the whole budget; the tokens stay transformers' own."""
    llm = LLM(str(checkpoint), device="cpu", max_model_len=96, max_num_batched_tokens=64, max_num_seqs=2)
    scheduler = llm.engine.scheduler
    scheduler.decode_chunk_limit = 8
    chunks: list[tuple[bool, list[int]]] = []
    schedule = scheduler.schedule

    def recording_schedule():
        decoding = any(seq.num_uncomputed_tokens == 1 for seq in scheduler.running)
        batch = schedule()
        prefills = [n for seq, n in zip(batch.seqs, batch.num_new_tokens) if seq.num_uncomputed_tokens > 1]
        chunks.append((decoding, prefills))
        return batch

    scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    outputs = llm.generate(prompt_token_ids=prompts(), sampling_params=GREEDY)
    assert [o.token_ids for o in outputs] == expected
    beside_decodes = [n for decoding, prefills in chunks if decoding for n in prefills]
    alone = [n for decoding, prefills in chunks if not decoding for n in prefills]
    assert beside_decodes and max(beside_decodes) == 8
    assert max(alone) > 8  # the first prompts, before anything decodes
