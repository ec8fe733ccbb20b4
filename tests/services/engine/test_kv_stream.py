"""Layer-streamed KV export (services/engine/kv_stream.py): a prefill engine hands each target layer
of a request to hand off over while its forward still runs the later layers, and a decode engine
fed the streamed layers continues with the mixed engine's greedy tokens, chunked prompts included."""

from __future__ import annotations

import pytest
import torch

from services.engine.engine import LLMEngine
from services.engine.kv_export import KVLayers, KVStreamMessage, KVStreamStart
from services.engine.llm import LLM
from shared.config import EngineConfig
from shared.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
NUM_LAYERS = 3


def prompts(*lengths: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, 384, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint) -> str:
    return str(make_checkpoint("llama", num_hidden_layers=NUM_LAYERS))


def engine(checkpoint: str, **overrides: object) -> LLMEngine:
    settings: dict = {"model": checkpoint, "device": "cpu", "max_model_len": 256, "block_size": 8}
    return LLMEngine(EngineConfig(**{**settings, **overrides}))


def mixed_tokens(checkpoint: str, token_ids: list[list[int]], **overrides: object) -> list[list[int]]:
    settings: dict = {"device": "cpu", "max_model_len": 256}
    llm = LLM(checkpoint, **{**settings, **overrides})
    return [o.token_ids for o in llm.generate(prompt_token_ids=token_ids, sampling_params=PARAMS)]


class Sink:
    """Collects what a prefill engine streams, and notes it among other events (`log`)."""

    def __init__(self, log: list[tuple[str, int]] | None = None) -> None:
        self.starts: list[KVStreamStart] = []
        self.layers: list[KVLayers] = []
        self.log = log if log is not None else []

    def __call__(self, message: KVStreamMessage) -> None:
        if isinstance(message, KVStreamStart):
            self.starts.append(message)
        else:
            self.layers.append(message)
            self.log.append(("streamed", message.index))


def split_run(
    prefill: LLMEngine, decode: LLMEngine, sink: Sink, token_ids: list[list[int]]
) -> list[list[int]]:
    """Prefill hands every request off through `sink` and its exports; decode runs them to the end."""
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(token_ids):
        decode.reserve(f"r{i}", prompt, PARAMS)
        prefill.add_request(f"r{i}", prompt_token_ids=prompt, params=PARAMS, handoff=True)
    while prefill.has_unfinished_requests():
        prefill.step()
        for layers in sink.layers:
            for request_id, key, value in zip(layers.request_ids, layers.keys, layers.values):
                decode.import_kv(request_id, "target", layers.index, key, value)
        sink.layers.clear()
        for export in prefill.handoffs:
            assert export.streamed == (prefill.runner.kv_stream is not None)
            for cache, index, key, value in export.layers:  # a whole export's (none streamed here)
                decode.import_kv(export.request_id, cache, index, key, value)
            decode.activate(export.request_id, export.first_token_id)
            tokens[export.request_id] = [export.first_token_id]
        prefill.handoffs.clear()
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[f"r{i}"] for i in range(len(token_ids))]


def test_streamed_handoff_gives_the_mixed_engines_greedy_tokens(checkpoint) -> None:
    token_ids = prompts(5, 23, 40)
    prefill, sink = engine(checkpoint), Sink()
    assert prefill.stream_kv(sink)
    assert split_run(prefill, engine(checkpoint, block_size=4), sink, token_ids) == mixed_tokens(
        checkpoint, token_ids
    )
    assert prefill.handoffs == [] and sink.layers == []
    assert [start.request_id for start in sink.starts] == ["r0", "r1", "r2"]
    assert {(c, i) for c, i, _ in sink.starts[2].layer_shapes} == {("target", i) for i in range(NUM_LAYERS)}
    key_cache = prefill.runner.kv_caches[0][0]
    assert sink.starts[2].layer_shapes[0][2] == (5, *key_cache.shape[1:])  # 40 tokens in blocks of 8
    assert prefill.block_manager.num_free_blocks == prefill.block_manager.num_blocks
    assert prefill.runner.kv_stream is not None and prefill.runner.kv_stream.requests == {}


def test_each_layer_is_handed_over_before_the_forward_computes_the_next(checkpoint) -> None:
    log: list[tuple[str, int]] = []
    prefill, sink = engine(checkpoint), Sink(log)
    assert prefill.stream_kv(sink)
    for index, layer in enumerate(prefill.runner.model.layers):
        layer.register_forward_hook(lambda *_, index=index: log.append(("computed", index)))
    prefill.add_request("r", prompt_token_ids=prompts(30)[0], params=PARAMS, handoff=True)
    prefill.step()
    log.append(("exported", len(prefill.handoffs)))
    assert log == [
        *[event for i in range(NUM_LAYERS) for event in (("computed", i), ("streamed", i))],
        ("exported", 1),
    ]


def test_a_chunked_prompt_copies_each_chunk_at_its_step_and_hands_over_with_the_last(checkpoint) -> None:
    token_ids = prompts(100)
    prefill, sink = engine(checkpoint, max_num_batched_tokens=32), Sink()
    assert prefill.stream_kv(sink)
    streamer = prefill.runner.kv_stream
    assert streamer is not None
    prefill.add_request("r0", prompt_token_ids=token_ids[0], params=PARAMS, handoff=True)
    prefill.step()  # tokens 0..31: blocks 0..3, copied now; nothing handed over yet
    assert len(sink.starts) == 1 and sink.layers == [] and prefill.handoffs == []
    seq = prefill.sequences["r0"]
    host = streamer.requests["r0"]
    key_cache, value_cache = prefill.runner.kv_caches[1]
    assert torch.equal(host.keys[1, :4], key_cache[seq.block_table[:4]])
    assert torch.equal(host.values[1, :4], value_cache[seq.block_table[:4]])
    prefill.handoffs.clear()
    decode = engine(checkpoint, block_size=4)
    decode.reserve("r0", token_ids[0], PARAMS)
    tokens = [1]
    while prefill.has_unfinished_requests():
        prefill.step()
        for layers in sink.layers:
            decode.import_kv("r0", "target", layers.index, layers.keys[0], layers.values[0])
        handed_over, sink.layers = len(sink.layers), []
        for export in prefill.handoffs:
            assert handed_over == NUM_LAYERS  # every layer whole, with the last chunk's step
            decode.activate("r0", export.first_token_id)
            tokens = [export.first_token_id]
        prefill.handoffs.clear()
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens += out.new_token_ids
    assert tokens == mixed_tokens(checkpoint, token_ids)[0]


def test_a_request_that_ends_at_its_first_token_drops_its_stream(checkpoint) -> None:
    prefill, sink = engine(checkpoint), Sink()
    assert prefill.stream_kv(sink)
    prefill.add_request(
        "r", prompt_token_ids=prompts(12)[0], params=SamplingParams(max_tokens=1), handoff=True
    )
    while prefill.has_unfinished_requests():
        prefill.step()
    assert prefill.handoffs == [] and len(sink.layers) == NUM_LAYERS
    assert prefill.runner.kv_stream is not None and prefill.runner.kv_stream.requests == {}


def test_an_aborted_request_drops_its_host_buffer(checkpoint) -> None:
    prefill, sink = engine(checkpoint, max_num_batched_tokens=32), Sink()
    assert prefill.stream_kv(sink)
    prefill.add_request("r", prompt_token_ids=prompts(100)[0], params=PARAMS, handoff=True)
    prefill.step()
    assert prefill.runner.kv_stream is not None and "r" in prefill.runner.kv_stream.requests
    prefill.abort_request("r")
    assert prefill.runner.kv_stream.requests == {}
    assert prefill.block_manager.num_free_blocks == prefill.block_manager.num_blocks
