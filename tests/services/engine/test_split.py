"""Split (prefill / decode) and resumed requests at the engine level: output never changes."""

from __future__ import annotations

import pytest
import torch

from services.engine.engine import LLMEngine, RequestError
from services.engine.llm import LLM
from shared.config import EngineConfig
from shared.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 384, (n,), generator=generator).tolist() for n in (5, 23, 40)]


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint) -> str:
    return str(make_checkpoint("llama", num_hidden_layers=2))


@pytest.fixture(scope="module")
def expected(checkpoint) -> list[list[int]]:
    return [
        o.token_ids
        for o in LLM(checkpoint, device="cpu", max_model_len=128).generate(
            prompt_token_ids=prompts(), sampling_params=PARAMS
        )
    ]


def run_to_end(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_prefill_hands_off_kv_and_decode_continues(checkpoint, expected) -> None:
    prefill = LLMEngine(EngineConfig(model=checkpoint, device="cpu", max_model_len=128, block_size=8))
    decode = LLMEngine(EngineConfig(model=checkpoint, device="cpu", max_model_len=128, block_size=4))
    first_tokens = {}
    for i, prompt in enumerate(prompts()):
        decode.reserve(f"r{i}", prompt, PARAMS)
        prefill.add_request(f"r{i}", prompt_token_ids=prompt, params=PARAMS, handoff=True)
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            assert out.finish_reason == "handoff" and len(out.new_token_ids) == 1
            first_tokens[out.request_id] = out.new_token_ids[0]
        for export in prefill.handoffs:
            for cache, index, key, value in export.layers:  # block sizes differ: 8 here, 4 there
                decode.import_kv(export.request_id, cache, index, key, value)
            decode.activate(export.request_id, export.first_token_id)
        prefill.handoffs.clear()
    assert prefill.block_manager.num_free_blocks == prefill.block_manager.num_blocks
    rest = run_to_end(decode)
    for i, want in enumerate(expected):
        assert [first_tokens[f"r{i}"]] + rest[f"r{i}"] == want


def test_resumed_request_continues_the_same_output(checkpoint, expected) -> None:
    engine = LLMEngine(EngineConfig(model=checkpoint, device="cpu", max_model_len=128))
    for i, (prompt, want) in enumerate(zip(prompts(), expected)):
        engine.add_request(f"r{i}", prompt_token_ids=prompt, params=PARAMS, resumed_token_ids=want[:10])
    rest = run_to_end(engine)
    for i, want in enumerate(expected):
        assert rest[f"r{i}"] == want[10:]


def test_resumed_seeded_sampling_continues_the_same_output(checkpoint) -> None:
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=20, ignore_eos=True)
    prompt = prompts()[1]
    whole = (
        LLM(checkpoint, device="cpu", max_model_len=128)
        .generate(prompt_token_ids=[prompt], sampling_params=params)[0]
        .token_ids
    )
    engine = LLMEngine(EngineConfig(model=checkpoint, device="cpu", max_model_len=128))
    engine.add_request("r", prompt_token_ids=prompt, params=params, resumed_token_ids=whole[:7])
    assert run_to_end(engine)["r"] == whole[7:]


def test_reservation_needs_free_blocks(checkpoint) -> None:
    engine = LLMEngine(
        EngineConfig(model=checkpoint, device="cpu", max_model_len=64, num_kv_blocks=4, block_size=16)
    )
    engine.reserve("a", list(range(3, 60)), SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="no free KV blocks"):
        engine.reserve("b", list(range(3, 40)), SamplingParams(max_tokens=4))
    assert "b" not in engine.sequences
    engine.abort_request("a")
    assert engine.block_manager.num_free_blocks == 4


LOGPROB_PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)


def streamed_logprobs(engine: LLMEngine) -> dict[str, list[float]]:
    """Each request's logprobs as a worker streams them: those of each output's new tokens, read
    once the step that produced the output returned (as the engine core reads them)."""
    streamed: dict[str, list[float]] = {}
    while engine.has_unfinished_requests():
        for rid, values in streamed_logprobs_of_step(engine).items():
            streamed.setdefault(rid, []).extend(values)
    return streamed


@pytest.mark.parametrize("num_resumed", [0, 7])
def test_streamed_logprobs_of_split_and_resumed_requests_equal_the_offline_run(
    checkpoint, num_resumed
) -> None:
    """Every output token streamed has exactly one logprob, the offline run's, whether it was
    sampled by a mixed engine, a prefill engine or a decode engine, and after a resume."""
    offline = LLM(checkpoint, device="cpu", max_model_len=128).generate(
        prompt_token_ids=prompts(), sampling_params=LOGPROB_PARAMS
    )
    want = {f"r{i}": [lp.logprob for lp in o.logprobs or []][num_resumed:] for i, o in enumerate(offline)}
    resumed = {f"r{i}": o.token_ids[:num_resumed] for i, o in enumerate(offline)}
    mixed = LLMEngine(EngineConfig(model=checkpoint, device="cpu", max_model_len=128))
    prefill = LLMEngine(EngineConfig(model=checkpoint, device="cpu", max_model_len=128, block_size=8))
    decode = LLMEngine(EngineConfig(model=checkpoint, device="cpu", max_model_len=128, block_size=4))
    for i, prompt in enumerate(prompts()):
        rid = f"r{i}"
        mixed.add_request(rid, prompt_token_ids=prompt, params=LOGPROB_PARAMS, resumed_token_ids=resumed[rid])
        decode.reserve(rid, prompt, LOGPROB_PARAMS, resumed[rid])
        prefill.add_request(
            rid, prompt_token_ids=prompt, params=LOGPROB_PARAMS, resumed_token_ids=resumed[rid], handoff=True
        )
    split: dict[str, list[float]] = {}
    while prefill.has_unfinished_requests():
        for rid, values in streamed_logprobs_of_step(prefill).items():
            split.setdefault(rid, []).extend(values)
        for export in prefill.handoffs:
            for cache, index, key, value in export.layers:
                decode.import_kv(export.request_id, cache, index, key, value)
            decode.activate(export.request_id, export.first_token_id)
        prefill.handoffs.clear()
    for rid, values in streamed_logprobs(decode).items():
        split[rid] += values
    for streamed in (streamed_logprobs(mixed), split):
        assert streamed.keys() == want.keys()
        for rid, values in want.items():
            assert streamed[rid] == pytest.approx(values, abs=1e-5), rid


def streamed_logprobs_of_step(engine: LLMEngine) -> dict[str, list[float]]:
    """`streamed_logprobs` of one step."""
    streamed: dict[str, list[float]] = {}
    for out in engine.step():
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        new = out.logprobs[len(out.logprobs) - len(out.new_token_ids) :]
        assert None not in new, "a new token without its logprob"
        streamed.setdefault(out.request_id, []).extend(lp.logprob for lp in new if lp is not None)
    return streamed
