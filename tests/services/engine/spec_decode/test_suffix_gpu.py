"""On a GPU, suffix decoding feeds its global tree in the device's window, runs the steps it does
not draft for ahead, and keeps greedy output."""

from __future__ import annotations

import pytest
import torch

from services.engine.llm import LLM
from services.engine.sequence import Sequence
from services.engine.spec_decode.adaptive import AdaptiveSpeculation
from services.engine.spec_decode.suffix import DeferredGlobalIndex
from shared.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_suffix_feeds_the_global_tree_while_the_device_runs(make_checkpoint) -> None:
    """Two rounds of the same requests, one at a time and then four at a time: greedy output
    equals naive's, the in-process global tree is the deferred one, and outputs went into it
    during the run's steps (a device that never outlasts the host's work would leave them all
    waiting: the tree would never grow)."""
    path = str(make_checkpoint("llama", num_hidden_layers=3))
    generator = torch.Generator().manual_seed(5)
    spans = [torch.randint(3, 384, (8,), generator=generator).tolist() for _ in range(4)]
    prompts = [span * 3 for span in spans]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    naive = LLM(path, device="cuda", dtype="float32", max_model_len=256)
    expected = [o.token_ids for o in naive.generate(prompt_token_ids=prompts, sampling_params=params)]
    spec = dict(method="suffix", num_speculative_tokens=6)
    llm = LLM(path, device="cuda", dtype="float32", max_model_len=256, speculative_config=spec)
    index = llm.engine.drafter.suffix.global_index
    assert isinstance(index, DeferredGlobalIndex)
    first = [llm.generate(prompt_token_ids=[p], sampling_params=params)[0].token_ids for p in prompts]
    second = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert first == second == expected
    print(f"outputs indexed {len(index.index)}, waiting {index.num_pending}")
    assert len(index.index) >= 1


def test_suffix_steps_left_at_k_0_run_ahead_on_the_gpu(
    make_checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With CUDA graphs, suffix requests the controller leaves at k = 0 (every other stretch of
    four output tokens) launch their steps ahead of the read-back, completed on the device, and the
    steps that need the host's drafts wait for them: greedy output equals naive's, eight requests at
    a time. The steps that waited for host drafts recorded the device's idle time before them (the
    host gap the controller prices), each step launched ahead none; naive's steps waited less."""
    path = str(make_checkpoint("llama", num_hidden_layers=3))
    generator = torch.Generator().manual_seed(7)
    spans = [torch.randint(3, 384, (8,), generator=generator).tolist() for _ in range(8)]
    prompts = [span * 3 for span in spans]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine_args: dict = dict(device="cuda", dtype="float32", max_model_len=256, cuda_graph_max_tokens=128)
    naive = LLM(path, **engine_args)
    expected = [o.token_ids for o in naive.generate(prompt_token_ids=prompts, sampling_params=params)]

    def every_other_stretch(
        self: AdaptiveSpeculation,
        seqs: list[Sequence],
        num_other_tokens: int,
        mixed: bool = False,
        backlogs: list[int] | None = None,
    ) -> list[int]:
        return [seq.spec.max_k if seq.num_output_tokens // 4 % 2 == 0 else 0 for seq in seqs]

    monkeypatch.setattr(AdaptiveSpeculation, "choose", every_other_stretch)
    spec = dict(method="suffix", num_speculative_tokens=6)
    llm = LLM(path, speculative_config=spec, **engine_args)
    assert llm.engine.runner.graphs is not None
    ahead = [0]
    launch_ahead = llm.engine.runner.launch_ahead

    def counted(*args):  # type: ignore[no-untyped-def]
        ahead[0] += 1
        return launch_ahead(*args)

    llm.engine.runner.launch_ahead = counted  # type: ignore[method-assign]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outputs] == expected
    assert ahead[0] > 10
    counts = llm.engine.step_counts
    assert counts.num_waited > 5 and counts.host_gap_s > 0
    assert counts.num_waited + ahead[0] <= counts.num_steps
    assert 0 < llm.engine.drafter.adaptive.host_gap.samples.num_recorded <= counts.num_waited
    assert naive.engine.step_counts.num_waited < counts.num_waited
    print("suffix steps:", counts.summary(), "naive steps:", naive.engine.step_counts.summary())
