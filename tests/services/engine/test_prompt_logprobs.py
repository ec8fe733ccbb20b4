"""Prompt logprobs (vLLM's `prompt_logprobs`) equal a log-softmax of transformers' logits at every
prompt position, however the engine prefills the prompt."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine import prompt_logprobs
from services.engine.llm import LLM
from shared.sampling_params import SamplingParams

PROMPT_LENGTHS = [37, 5, 61]
TOLERANCE = 1e-4


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(3, 384, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint) -> Path:
    return make_checkpoint("llama", num_hidden_layers=2)


@pytest.fixture(scope="module")
def reference_logits(checkpoint: Path) -> list[torch.Tensor]:
    """[prompt_len, vocab_size] float32 logits of each prompt from transformers."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(torch.tensor([ids])).logits[0].float() for ids in prompts()]


def assert_match(
    entries, prompt: list[int], logits: torch.Tensor, num_top: int, temperature: float = 1.0
) -> None:
    """Entry i scores prompt[i] with the log-softmax of position i - 1's logits."""
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None
    expected = torch.log_softmax(logits / temperature, dim=-1)
    for position in range(1, len(prompt)):
        entry, row = entries[position], expected[position - 1]
        token = prompt[position]
        assert entry.token_id == token
        assert abs(entry.logprob - float(row[token])) < TOLERANCE, position
        assert entry.rank == int((row > row[token]).sum()) + 1
        top = torch.topk(row, num_top)
        assert list(entry.top) == top.indices.tolist()
        assert list(entry.top.values()) == pytest.approx(top.values.tolist(), abs=TOLERANCE)


ENGINES = {
    "whole-prompt": dict(),
    "chunked-prefill": dict(enable_chunked_prefill=True, max_num_batched_tokens=16),
    "ngram-speculation": dict(
        max_num_batched_tokens=24,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    ),
    # 14 blocks of 8 tokens, fewer than the batch needs: requests are preempted and recomputed
    "preemption": dict(num_kv_blocks=14, max_num_batched_tokens=40),
}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_prompt_logprobs_match_transformers(
    checkpoint: Path, reference_logits, engine: str, monkeypatch
) -> None:
    monkeypatch.setattr(prompt_logprobs, "MAX_CHUNK_LOGITS", 7 * 384)  # rows scored 7 at a time
    llm = LLM(str(checkpoint), device="cpu", max_model_len=96, block_size=8, **ENGINES[engine])
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=3),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0, logprobs=2),
    ]
    outputs = llm.generate(prompt_token_ids=prompts(), sampling_params=params)
    assert_match(outputs[0].prompt_logprobs, prompts()[0], reference_logits[0], 3)
    assert outputs[1].prompt_logprobs is None
    assert_match(outputs[2].prompt_logprobs, prompts()[2], reference_logits[2], 0)
    assert len(outputs[2].logprobs or []) == 12
    if engine == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("mode", ["processed", "raw"])
def test_logprobs_mode_sets_the_temperature(checkpoint: Path, reference_logits, mode: str) -> None:
    """`processed`: the logits divided by the request's temperature, as its sampled tokens see them."""
    llm = LLM(str(checkpoint), device="cpu", max_model_len=96, logprobs_mode=mode)
    params = SamplingParams(temperature=0.5, max_tokens=2, seed=1, prompt_logprobs=2)
    [output] = llm.generate(prompt_token_ids=prompts()[:1], sampling_params=params)
    temperature = 0.5 if mode == "processed" else 1.0
    assert_match(output.prompt_logprobs, prompts()[0], reference_logits[0], 2, temperature)


def test_no_prefix_cache_hit_for_prompt_logprobs(checkpoint: Path, reference_logits) -> None:
    """Cached blocks come without logits: a request that scores its prompt prefills all of it."""
    llm = LLM(str(checkpoint), device="cpu", max_model_len=96, block_size=4, enable_prefix_caching=True)
    plain = SamplingParams(temperature=0, max_tokens=4)
    prompt = prompts()[:1]
    llm.generate(prompt_token_ids=prompt, sampling_params=plain)
    [scored] = llm.generate(
        prompt_token_ids=prompt, sampling_params=plain.model_copy(update={"prompt_logprobs": 1})
    )
    assert scored.num_cached_prompt_tokens == 0
    assert_match(scored.prompt_logprobs, prompt[0], reference_logits[0], 1)
    [again] = llm.generate(prompt_token_ids=prompt, sampling_params=plain)
    assert again.num_cached_prompt_tokens > 0  # the cache was warm all along


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("engine_args", [dict(), dict(max_num_batched_tokens=16)], ids=["whole", "chunked"])
def test_prompt_logprobs_on_gpu_from_cuda_graphs(checkpoint: Path, reference_logits, engine_args) -> None:
    """On a GPU the prompt rows are scored after the step's graph replay, from its hidden buffer."""
    llm = LLM(str(checkpoint), device="cuda", dtype="float32", max_model_len=128, **engine_args)
    assert llm.engine.runner.graphs is not None
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    outputs = llm.generate(prompt_token_ids=prompts(), sampling_params=params)
    for output, prompt, logits in zip(outputs, prompts(), reference_logits):
        entries = output.prompt_logprobs
        assert entries is not None and entries[0] is None and len(entries) == len(prompt)
        expected = torch.log_softmax(logits, dim=-1)
        for position in range(1, len(prompt)):
            assert entries[position].token_id == prompt[position]
            assert abs(entries[position].logprob - float(expected[position - 1, prompt[position]])) < 1e-3
