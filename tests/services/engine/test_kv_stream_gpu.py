"""Layer-streamed KV export on a GPU: the copies on the copy stream, handed over from the streamer's
thread, give a decode engine the KV the whole export gives: the same greedy tokens, whole prompts and
chunked ones. Run by `scripts/gpu_check.sh kvipc`."""

from __future__ import annotations

import pytest
import torch

from tests.services.engine.test_kv_stream import Sink, engine, prompts, split_run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint) -> str:
    return str(make_checkpoint("llama", num_hidden_layers=3))


@pytest.mark.parametrize("max_num_batched_tokens", [None, 32])  # whole prompts; chunks of 32
def test_streamed_handoff_on_the_gpu_gives_the_whole_exports_greedy_tokens(
    checkpoint, max_num_batched_tokens
) -> None:
    """The whole export's prefill runs eagerly too (a streamed step always does): the same kernels."""
    token_ids = prompts(5, 40, 150)
    tokens = {}
    for stream in (False, True):
        prefill = engine(
            checkpoint, device="cuda", enforce_eager=True, max_num_batched_tokens=max_num_batched_tokens
        )
        sink = Sink()
        if stream:
            assert prefill.stream_kv(sink)
        decode = engine(checkpoint, block_size=4, device="cuda")
        tokens[stream] = split_run(prefill, decode, sink, token_ids)
        assert prefill.block_manager.num_free_blocks == prefill.block_manager.num_blocks
        prefill.close()
        decode.close()
    assert tokens[True] == tokens[False]
