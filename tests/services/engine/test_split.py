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


def received_layers(
    engine: LLMEngine, num_blocks: int, block_size: int
) -> list[tuple[str, int, torch.Tensor, torch.Tensor]]:
    """Random K and V for every target layer of `engine`, as a sender of `block_size` sends them."""
    generator = torch.Generator().manual_seed(5)
    layers = []
    for index, (key_cache, _) in enumerate(engine.runner.caches("target")):
        shape = (num_blocks, block_size, *key_cache.shape[2:])
        key, value = (torch.randn(shape, generator=generator).to(key_cache.dtype) for _ in "kv")
        layers.append(("target", index, key, value))
    return layers


def stored(engine: LLMEngine, request_id: str) -> list[torch.Tensor]:
    """The request's blocks of every target layer, K and V, as the cache holds them."""
    blocks = engine.reserved[request_id].block_table
    return [cache[blocks].clone() for pair in engine.runner.caches("target") for cache in pair]


@pytest.mark.parametrize("sender_block_size", [4, 8])
def test_importing_a_request_at_once_stores_what_layer_by_layer_does(checkpoint, sender_block_size) -> None:
    engine = LLMEngine(EngineConfig(model=checkpoint, device="cpu", max_model_len=128, block_size=4))
    prompt = prompts()[2]  # 40 tokens: 10 blocks of 4, 5 of 8
    for request_id in ("by-layer", "at-once"):
        engine.reserve(request_id, prompt, PARAMS)
    layers = received_layers(engine, -(-len(prompt) // sender_block_size), sender_block_size)
    for cache, index, key, value in layers:
        engine.import_kv("by-layer", cache, index, key, value)
    engine.import_layers("at-once", layers)
    by_layer, at_once = stored(engine, "by-layer"), stored(engine, "at-once")
    for one, other in zip(by_layer, at_once, strict=True):
        assert torch.equal(one, other)
    sent_key = layers[1][2].flatten(0, 1)[: len(prompt)]
    assert torch.equal(at_once[2].flatten(0, 1)[: len(prompt)], sent_key)  # layer 1's K, token by token


def test_importing_an_unknown_cache_writes_nothing(checkpoint) -> None:
    engine = LLMEngine(EngineConfig(model=checkpoint, device="cpu", max_model_len=128, block_size=4))
    engine.reserve("r", prompts()[1], PARAMS)
    before = stored(engine, "r")
    layers = received_layers(engine, 6, 4)
    key, value = layers[0][2:]
    with pytest.raises(ValueError, match="unknown KV cache 'nope'"):
        engine.import_layers("r", [*layers, ("nope", 0, key, value)])
    for old, now in zip(before, stored(engine, "r"), strict=True):
        assert torch.equal(old, now)


@pytest.mark.parametrize("sender_block_size", [4, 8])
def test_importing_stacked_caches_stores_what_layer_by_layer_does(checkpoint, sender_block_size) -> None:
    """The ipc transport's import, one copy per cache (same block size) or reblocked layer by layer."""
    engine = LLMEngine(EngineConfig(model=checkpoint, device="cpu", max_model_len=128, block_size=4))
    assert engine.runner._stack("target") is not None  # the caches are views of one tensor
    prompt = prompts()[2]
    for request_id in ("by-layer", "stacked"):
        engine.reserve(request_id, prompt, PARAMS)
    layers = received_layers(engine, -(-len(prompt) // sender_block_size), sender_block_size)
    engine.import_layers("by-layer", layers)
    engine.import_stacked("stacked", {"target": torch.stack([torch.stack([k, v]) for _, _, k, v in layers])})
    for one, other in zip(stored(engine, "by-layer"), stored(engine, "stacked"), strict=True):
        assert torch.equal(one, other)


def test_gathered_blocks_of_every_layer_come_out_in_one_buffer_as_exported(checkpoint) -> None:
    engine = LLMEngine(EngineConfig(model=checkpoint, device="cpu", max_model_len=128, block_size=4))
    engine.add_request("r", prompt_token_ids=prompts()[2], params=PARAMS.model_copy(update={"max_tokens": 1}))
    run_to_end(engine)
    block_ids = [3, 0, 7, 2]
    blocks = torch.tensor(block_ids)
    want = [(k[blocks], v[blocks]) for k, v in engine.runner.caches("target")]
    assert any(key.abs().sum() > 0 for key, _ in want)  # the prompt's KV is in those blocks
    for layers in (engine.runner.export_blocks(block_ids), gathered_layers(engine, block_ids)):
        assert [(c, i) for c, i, *_ in layers] == [("target", i) for i in range(len(want))]
        for (*_, key, value), (want_key, want_value) in zip(layers, want, strict=True):
            assert torch.equal(key, want_key) and torch.equal(value, want_value)


def gathered_layers(
    engine: LLMEngine, block_ids: list[int]
) -> list[tuple[str, int, torch.Tensor, torch.Tensor]]:
    buffer, caches = engine.runner.gather_blocks(block_ids, lambda n: torch.empty(n, dtype=torch.uint8))
    assert caches["target"].untyped_storage().data_ptr() == buffer.data_ptr()
    return [(c, i, kv[0], kv[1]) for c, stacked in caches.items() for i, kv in enumerate(stacked)]
