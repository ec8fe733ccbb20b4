"""Tensor parallelism end to end on CPU (2 ranks joined by gloo): the split engine keeps every
output of one rank, for every speculative method, and its ranks stay in step."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.engine.block_manager import NO_HASH, chain_hash
from services.engine.llm import LLM
from services.engine.tensor_parallel import EXIT_RANK_LOST
from shared.config import EngineConfig
from shared.model import ModelConfigError, load_model
from shared.model.mtp import MTPHead, save_mtp_head
from shared.model.parallel import TensorParallel
from shared.sampling_params import SamplingParams
from shared.speculative_config import SpeculativeOverride
from shared.structured_output import StructuredOutput
from tests.services.engine.spec_decode.helpers import GREEDY, repetitive_prompts
from tests.services.engine.spec_decode.test_async_scheduling import count_ahead

SHAPES = {
    "llama": ("llama", {"num_key_value_heads": 2}),  # GQA: one KV head per rank
    "qwen2": ("qwen2", {"num_key_value_heads": 1, "tie_word_embeddings": True}),  # the KV head replicated
}
OVERRIDES = {
    "naive": SpeculativeOverride(enabled=False),
    "ngram": SpeculativeOverride(method="ngram"),
    "mtp": SpeculativeOverride(method="mtp"),
}
SEEDED = SamplingParams(
    temperature=0.8, top_k=40, seed=3, max_tokens=20, ignore_eos=True, presence_penalty=0.5, logprobs=2
)
"""Penalties and logprobs: verified by rank 0's torch sampler, its result sent to the other rank."""


def random_mtp_head(target: str) -> str:
    """An untrained MTP head for `target`: its drafts are mostly rejected, which exercises rollback."""
    head = MTPHead(load_model(target, torch.float32, torch.device("cpu"), 192))
    torch.manual_seed(0)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return str(save_mtp_head(head, tempfile.mkdtemp(prefix="mtp-")))


def speculative_llm(target: str, mtp: str, tensor_parallel_size: int) -> LLM:
    spec = dict(method="mtp", model=mtp, num_speculative_tokens=3, prompt_lookup_max=3, adaptive=False)
    return LLM(
        target,
        device="cpu",
        max_model_len=192,
        tensor_parallel_size=tensor_parallel_size,
        speculative_config=spec,
    )


def generate(llm: LLM, params: SamplingParams) -> list:
    return llm.generate(prompt_token_ids=repetitive_prompts(4), sampling_params=params)


@pytest.fixture(scope="module", params=sorted(SHAPES))
def target(request, make_checkpoint) -> tuple[str, str]:
    arch, overrides = SHAPES[request.param]
    path = str(make_checkpoint(arch, **overrides))
    return path, random_mtp_head(path)


@pytest.fixture(scope="module")
def split(target) -> Iterator[LLM]:
    with speculative_llm(*target, tensor_parallel_size=2) as llm:
        yield llm


@pytest.fixture(scope="module")
def single(target) -> LLM:
    return speculative_llm(*target, tensor_parallel_size=1)


@pytest.mark.parametrize("method", sorted(OVERRIDES))
def test_greedy_output_of_two_ranks_is_one_ranks(split, single, method: str) -> None:
    params = GREEDY.model_copy(update={"speculative": OVERRIDES[method]})
    expected = generate(single, params)
    outputs = generate(split, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    drafted = sum(o.spec_stats["num_draft_tokens"] for o in outputs)
    if method == "ngram":
        assert sum(o.spec_stats["num_accepted_tokens"] for o in outputs) > 0
    assert (drafted > 0) == (method != "naive")
    assert split.engine.runner.rows_agree()


def mixed_finishes(single: LLM, method: str) -> list[SamplingParams]:
    """Per prompt, a request that ends its own way while steps run ahead: max_tokens, a stop id met
    mid-run, EOS not ignored, or seeded sampling (the fused kernel's noise, alike on every rank)."""
    greedy = GREEDY.model_copy(update={"speculative": OVERRIDES[method]})
    reference = [o.token_ids for o in generate(single, greedy)]
    kinds = [
        {"max_tokens": 7},
        {"stop_token_ids": [reference[1][9]]},
        {"ignore_eos": False},
        {"temperature": 0.8, "top_p": 0.9, "seed": 5},
    ]
    return [greedy.model_copy(update=kind) for kind in kinds]


@pytest.mark.parametrize("method", sorted(OVERRIDES))
def test_steps_ahead_on_two_ranks_return_what_one_rank_and_sync_steps_do(
    split, single, monkeypatch, method: str
) -> None:
    """With asynchronous scheduling (the default) both ranks launch decode steps ahead, each
    completing them from its own input batch: the tokens and finishes are one rank's, and those
    of the same two ranks with it off."""
    params = mixed_finishes(single, method)
    expected = generate(single, params)
    runner = split.engine.runner
    # the count's wrapper (below) goes with the test
    monkeypatch.setattr(runner, "launch_ahead", runner.launch_ahead)
    ahead = count_ahead(split.engine)
    outputs = generate(split, params)
    launched_ahead = ahead[0]
    monkeypatch.setattr(split.engine.config, "async_scheduling", False)
    sync = generate(split, params)
    for got in (outputs, sync):
        assert [(o.token_ids, o.finish_reason) for o in got] == [
            (o.token_ids, o.finish_reason) for o in expected
        ]
    assert {o.finish_reason for o in outputs} == {"length", "stop"}
    assert launched_ahead > 20 and ahead[0] == launched_ahead  # none with it off
    assert split.engine.runner.rows_agree()
    engine = split.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.inputs.slot_of


def test_seeded_sampling_with_penalties_and_logprobs_matches_one_rank(split, single) -> None:
    params = SEEDED.model_copy(update={"speculative": OVERRIDES["ngram"]})
    expected = generate(single, params)
    outputs = generate(split, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    for a, b in zip(outputs, expected):
        assert a.logprobs is not None and b.logprobs is not None
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
    assert split.engine.runner.rows_agree()


@pytest.mark.parametrize("method", ["naive", "ngram"])
def test_grammar_requests_of_two_ranks_are_one_ranks(split, single, method: str) -> None:
    """Rank 0 fills the grammar masks and sends them: both ranks verify the same masked rows in the
    fused tail, so the split engine follows the grammar exactly as one rank does."""
    grammar = StructuredOutput(kind="regex", spec="[a-e ]{4,60}")
    params = GREEDY.model_copy(
        update={"speculative": OVERRIDES[method], "structured": grammar, "ignore_eos": False}
    )
    expected = generate(single, params)
    outputs = generate(split, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    for output in outputs:
        text = split.tokenizer.decode(output.token_ids)
        assert re.fullmatch("[a-e ]*", text), text
    assert split.engine.runner.rows_agree()


def test_prompt_logprobs_of_two_ranks_are_one_ranks(split, single) -> None:
    """Every rank scores the prompt rows (the LM head gathers the vocabulary over the ranks)."""
    params = GREEDY.model_copy(update={"prompt_logprobs": 2, "max_tokens": 4})
    expected = generate(single, params)
    outputs = generate(split, params)
    for a, b in zip(outputs, expected):
        assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
        assert a.prompt_logprobs[0] is None and len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x is not None and y is not None
            assert (x.token_id, x.rank, list(x.top)) == (y.token_id, y.rank, list(y.top))
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
    assert split.engine.runner.rows_agree()


def test_kv_blocks_exported_from_two_ranks_carry_every_head(split, single) -> None:
    """What a split prefill worker hands off (gathered from both ranks) equals one rank's KV,
    and what a split decode worker imports is scattered back to each rank's heads."""
    prompt = list(range(40, 80))
    params = GREEDY.model_copy(update={"max_tokens": 1})
    split.generate(prompt_token_ids=[prompt], sampling_params=params)
    single.generate(prompt_token_ids=[prompt], sampling_params=params)
    exported = split.engine.runner.export_blocks(cached_blocks(split, prompt))
    expected = single.engine.runner.export_blocks(cached_blocks(single, prompt))
    assert [(c, i) for c, i, *_ in exported] == [(c, i) for c, i, *_ in expected]
    assert len(exported) == 3  # two target layers and the MTP head's
    for (cache, _, key, value), (_, _, want_key, want_value) in zip(exported, expected):
        atol = 1e-5 * max(1.0, want_key.abs().max().item())
        torch.testing.assert_close(key, want_key, atol=atol, rtol=1e-4, msg=cache)
        torch.testing.assert_close(value, want_value, atol=atol, rtol=1e-4, msg=cache)

    # gathered into one device buffer for the ipc transport: the same KV, views of that buffer
    for llm, host_copy in ((split, exported), (single, expected)):
        buffer, caches = llm.engine.runner.gather_blocks(cached_blocks(llm, prompt), host_buffer)
        gathered = [(c, i, kv[0], kv[1]) for c, stacked in caches.items() for i, kv in enumerate(stacked)]
        assert [(c, i) for c, i, *_ in gathered] == [(c, i) for c, i, *_ in host_copy]
        for (*_, key, value), (*_, want_key, want_value) in zip(gathered, host_copy):
            assert torch.equal(key, want_key) and torch.equal(value, want_value)
        assert {view.untyped_storage().data_ptr() for view in caches.values()} == {buffer.data_ptr()}

    spare = [split.engine.runner.num_kv_blocks - 1 - i for i in range(key.shape[0])]
    _, _, key, value = exported[1]
    split.engine.runner.import_blocks("target", 1, spare, key.flip(0), value.flip(0))
    again = split.engine.runner.export_blocks(spare)
    assert torch.equal(again[1][2], key.flip(0)) and torch.equal(again[1][3], value.flip(0))


def host_buffer(num_bytes: int) -> torch.Tensor:
    return torch.empty(num_bytes, dtype=torch.uint8)


def cached_blocks(llm: LLM, token_ids: list[int]) -> list[int]:
    """The ids of the prefix-cached blocks that hold `token_ids`' full blocks."""
    manager = llm.engine.block_manager
    block_ids, parent = [], NO_HASH
    for start in range(0, len(token_ids) - manager.block_size + 1, manager.block_size):
        parent = chain_hash(parent, tuple(token_ids[start : start + manager.block_size]))
        block_ids.append(manager.cached[parent])
    return block_ids


def test_heads_that_do_not_split_are_refused_by_name(make_checkpoint) -> None:
    three_kv_heads = str(make_checkpoint("llama"))  # 6 query heads, 3 KV heads
    with pytest.raises(ModelConfigError, match="num_key_value_heads 3"):
        LLM(three_kv_heads, device="cpu", tensor_parallel_size=2)
    with pytest.raises(ModelConfigError, match="num_attention_heads 6 is not divisible by 4"):
        LLM(three_kv_heads, device="cpu", tensor_parallel_size=4)


def test_more_ranks_than_cuda_devices_is_refused(make_checkpoint, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    model = str(make_checkpoint("llama"))
    assert EngineConfig(model=model, device="cuda", tensor_parallel_size=2).rank_device(1) == torch.device(
        "cuda", 1
    )
    with pytest.raises(ValueError, match=r"needs cuda:1..cuda:2, but 2 CUDA device\(s\) are visible"):
        EngineConfig(model=model, device="cuda:1", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="needs cuda:0..cuda:3"):
        EngineConfig(model=model, device="cuda", tensor_parallel_size=4)


def test_the_dense_forward_is_refused_on_a_split_model(make_checkpoint) -> None:
    arch, overrides = SHAPES["llama"]
    model = load_model(
        make_checkpoint(arch, **overrides), torch.float32, torch.device("cpu"), 64, TensorParallel(0, 2)
    )
    with pytest.raises(NotImplementedError, match="one rank"):
        model.forward_dense(torch.tensor([[1, 2, 3]]))


RANK_0 = """
import sys
from services.engine.llm import LLM
from services.engine.tensor_parallel import EXIT_RANK_LOST
from shared.sampling_params import SamplingParams
llm = LLM(sys.argv[1], device="cpu", max_model_len=192, tensor_parallel_size=2)
print(llm.engine.runner.ranks.followers[0].pid, flush=True)
params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
while True:
    llm.generate(prompt_token_ids=[[5, 6, 7]] * 4, sampling_params=params)
"""


def test_rank_0_exits_when_a_follower_dies_mid_generation(make_checkpoint) -> None:
    """Its collectives would otherwise wait on the dead rank (for the group's 30-minute timeout)."""
    arch, overrides = SHAPES["llama"]
    rank_0 = subprocess.Popen(
        [sys.executable, "-c", RANK_0, str(make_checkpoint(arch, **overrides))],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=Path(__file__).resolve().parents[3],
    )
    try:
        assert rank_0.stdout is not None
        follower = int(rank_0.stdout.readline())
        time.sleep(0.5)  # generating
        os.kill(follower, signal.SIGKILL)
        assert rank_0.wait(timeout=60) == EXIT_RANK_LOST
    finally:
        rank_0.kill()
        rank_0.wait()
        assert rank_0.stdout is not None
        rank_0.stdout.close()


EXIT = """
import sys, time
from services.engine.llm import LLM
from shared.sampling_params import SamplingParams
llm = LLM(sys.argv[1], device="cpu", max_model_len=96, tensor_parallel_size=2)
llm.generate(prompt_token_ids=[[5, 6, 7]] * 2, sampling_params=SamplingParams(temperature=0.0, max_tokens=12))
if sys.argv[2] == "close":
    started = time.monotonic()
    llm.close()
    print(time.monotonic() - started, llm.engine.runner.ranks.followers[0].returncode, flush=True)
"""


@pytest.mark.parametrize("how", ["close", "exit"])
def test_a_group_ends_cleanly_closed_or_left_open_at_exit(make_checkpoint, how: str) -> None:
    """Every rank leaves the group before any rank's process ends, the followers exit by
    themselves (not killed), and nothing aborts in the interpreters' teardown; an engine nobody
    closed is closed at exit."""
    arch, overrides = SHAPES["llama"]
    done = subprocess.run(
        [sys.executable, "-c", EXIT, str(make_checkpoint(arch, **overrides)), how],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tensor-parallel rank 1 left the group" in done.stderr
    for sign in ("terminate called", "did not", "NOT been destroyed", "Traceback"):
        assert sign not in done.stderr
    if how == "close":
        seconds, follower_code = done.stdout.split()
        assert float(seconds) < 10 and follower_code == "0"
