"""Layer-streamed KV export (services/engine/kv_stream.py): a prefill engine hands each target layer
of a request to hand off over while its forward still runs the later layers, and a decode engine
fed the streamed layers continues with the mixed engine's greedy tokens, chunked prompts included."""

from __future__ import annotations

import itertools

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
    """Collects what a prefill engine streams, and notes it among other events (`log`); puts each
    request's layers together from their parts (`whole`)."""

    def __init__(self, log: list[tuple[str, int]] | None = None) -> None:
        self.starts: list[KVStreamStart] = []
        self.layers: list[KVLayers] = []
        self.log = log if log is not None else []
        self.parts: dict[tuple[str, int], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}

    def __call__(self, message: KVStreamMessage) -> None:
        if isinstance(message, KVStreamStart):
            self.starts.append(message)
            return
        self.layers.append(message)
        self.log.append(("streamed", message.index))
        parts = zip(message.request_ids, message.first_blocks, message.keys, message.values)
        for request_id, first_block, key, value in parts:
            self.parts.setdefault((request_id, message.index), []).append((first_block, key, value))

    def whole(self, request_id: str) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """(index, key, value) of each of the request's layers, its parts in order and contiguous."""
        layers = []
        for (owner, index), parts in sorted(self.parts.items()):
            if owner != request_id:
                continue
            assert [first for first, _, _ in parts] == list(
                itertools.accumulate([0] + [len(key) for _, key, _ in parts[:-1]])
            )
            layers.append((index, torch.cat([k for _, k, _ in parts]), torch.cat([v for _, _, v in parts])))
        return layers


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
        sink.layers.clear()
        for export in prefill.handoffs:
            assert export.streamed == (prefill.runner.kv_stream is not None)
            for index, key, value in sink.whole(export.request_id):
                decode.import_kv(export.request_id, "target", index, key, value)
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


def test_a_chunked_prompt_hands_over_each_chunk_s_blocks_at_its_step(checkpoint) -> None:
    """Chunks of 28 tokens in blocks of 8: each step hands over the blocks its chunk completed (a
    block a chunk ends inside goes with the next), the last step the rest."""
    token_ids = prompts(100)
    prefill, sink = engine(checkpoint, max_num_batched_tokens=28), Sink()
    assert prefill.stream_kv(sink)
    prefill.add_request("r0", prompt_token_ids=token_ids[0], params=PARAMS, handoff=True)
    prefill.step()  # tokens 0..27: blocks 0..2 whole, block 3 half
    assert len(sink.starts) == 1 and prefill.handoffs == []
    assert [(layers.index, layers.first_blocks) for layers in sink.layers] == [
        (i, [0]) for i in range(NUM_LAYERS)
    ]
    seq = prefill.sequences["r0"]
    key_cache, value_cache = prefill.runner.kv_caches[1]
    assert torch.equal(sink.layers[1].keys[0], key_cache[seq.block_table[:3]])
    assert torch.equal(sink.layers[1].values[0], value_cache[seq.block_table[:3]])
    first_blocks = []
    while not prefill.handoffs:
        sink.layers.clear()
        prefill.step()
        first_blocks.append(sink.layers[0].first_blocks[0])
    assert first_blocks == [3, 7, 10]  # tokens to 56 (7 blocks), to 84 (10), to 100 (13: the rest)
    decode = engine(checkpoint, block_size=4)
    decode.reserve("r0", token_ids[0], PARAMS)
    for index, key, value in sink.whole("r0"):
        assert key.shape[0] == 13
        decode.import_kv("r0", "target", index, key, value)
    tokens = [prefill.handoffs[0].first_token_id]
    decode.activate("r0", tokens[0])
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
