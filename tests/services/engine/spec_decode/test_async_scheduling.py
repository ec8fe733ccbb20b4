"""Asynchronous scheduling (decode steps launched before the previous step's result is read) changes
nothing a user sees: the same tokens, text, finish reasons and usage as `--no-async-scheduling`,
for every method that drafts on the device, through stops, aborts, joins and preemption; steps
of host-drafted requests that draft nothing run ahead too, and so do steps with grammar rows."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

from services.engine.engine import LLMEngine, RequestOutput
from services.engine.llm import LLM
from services.engine.model_runner import LaunchedStep, PendingTail
from services.engine.scheduler import ScheduledBatch
from services.engine.sequence import Sequence
from services.engine.spec_decode.adaptive import AdaptiveSpeculation
from services.engine.verify_update import StepPlan
from shared.sampling_params import SamplingParams
from tests.services.engine.spec_decode.helpers import CHOICES, GRAMMARS, SMALL_DRAFT_MODEL, repetitive_prompts

ALL_ALIKE = (
    "token_ids",
    "text",
    "finish_reason",
    "stop_reason",
    "logprobs",
    "num_cached_prompt_tokens",
)
"""What a request's last output must carry alike with and without asynchronous scheduling."""


@pytest.fixture(scope="module")
def methods(make_checkpoint, mtp_head) -> dict[str, dict]:
    """Speculative configs by method: a trained MTP head (with n-gram drafts after its own), a
    small random draft model (its drafts mostly rejected: rollback every step)."""
    draft = make_checkpoint("llama", **SMALL_DRAFT_MODEL)
    return {
        "naive": {},
        "ngram": dict(method="ngram", num_speculative_tokens=4, prompt_lookup_max=3),
        "mtp": dict(method="mtp", model=mtp_head, num_speculative_tokens=3, mtp_strategy="with_ngram"),
        "draft_model": dict(method="draft_model", model=str(draft), num_speculative_tokens=3),
    }


def make_llm(target: str, spec: dict, async_scheduling: bool, **engine) -> LLM:
    spec = {"adaptive": False, **spec} if spec else {}
    return LLM(
        target,
        device="cpu",
        max_model_len=192,
        speculative_config=spec,
        async_scheduling=async_scheduling,
        **engine,
    )


def count_ahead(engine: LLMEngine) -> list[int]:
    """Counts the steps the engine launches ahead (one-element list, updated in place)."""
    count = [0]
    launch_ahead = engine.runner.launch_ahead

    def counted(*args, **kwargs):
        count[0] += 1
        return launch_ahead(*args, **kwargs)

    engine.runner.launch_ahead = counted  # type: ignore[method-assign]
    return count


def stop_params(reference: list[list[int]], texts: list[str]) -> list[SamplingParams]:
    """Per prompt, requests that end every way one can: a stop id met mid-run, a stop string cut
    from the text, max_tokens, EOS (not ignored), min_tokens holding a stop id back, and a seeded
    sampled request."""
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    params = []
    for i, (tokens, text) in enumerate(zip(reference, texts)):
        kind = i % 6
        if kind == 0:
            params.append(greedy.model_copy(update={"stop_token_ids": [tokens[12]]}))
        elif kind == 1:
            params.append(greedy.model_copy(update={"stop": [text[len(text) // 3 : len(text) // 3 + 2]]}))
        elif kind == 2:
            params.append(greedy.model_copy(update={"max_tokens": 5 + i}))
        elif kind == 3:
            params.append(greedy.model_copy(update={"ignore_eos": False}))
        elif kind == 4:
            params.append(greedy.model_copy(update={"min_tokens": 9, "stop_token_ids": [tokens[3]]}))
        else:
            params.append(SamplingParams(temperature=0.8, top_p=0.95, seed=11 + i, max_tokens=33))
    return params


def assert_alike(sync: list[RequestOutput], ahead: list[RequestOutput]) -> None:
    for a, b in zip(sync, ahead, strict=True):
        for name in ALL_ALIKE:
            assert getattr(a, name) == getattr(b, name), (a.request_id, name)
        assert len(a.token_ids) == len(b.token_ids)


@pytest.fixture(scope="module")
def reference(target) -> tuple[list[list[int]], list[str]]:
    """Greedy tokens and texts of the prompts, synchronous naive decoding."""
    llm = make_llm(target, {}, async_scheduling=False)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=repetitive_prompts(12), sampling_params=params)
    return [o.token_ids for o in outputs], [o.text for o in outputs]


@pytest.mark.parametrize("method", ["naive", "ngram", "mtp", "draft_model"])
def test_async_scheduling_returns_what_sync_scheduling_does(target, methods, reference, method) -> None:
    spec = methods[method]
    params = stop_params(*reference)
    prompts = repetitive_prompts(12)
    sync = make_llm(target, spec, async_scheduling=False).generate(
        prompt_token_ids=prompts, sampling_params=params
    )
    llm = make_llm(target, spec, async_scheduling=True)
    ahead = count_ahead(llm.engine)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert_alike(sync, outputs)
    assert {o.finish_reason for o in outputs} == {"stop", "length"}
    assert {type(o.stop_reason) for o in outputs} == {str, int, type(None)}  # strings, ids, neither
    assert ahead[0] > 20
    if method != "naive":
        assert sum(o.spec_stats["num_accepted_tokens"] for o in outputs) > 0
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.inputs.slot_of and not engine.has_unfinished_requests()


def test_suffix_requests_left_at_k_0_run_ahead(target, reference, monkeypatch: pytest.MonkeyPatch) -> None:
    """Suffix-decoding requests drafted on the host: a step whose requests the controller left at
    k = 0 (here every other stretch of four output tokens) is launched ahead, as a naive one is; a
    step that needs the host's drafts waits for them. Greedy output is naive's either way, and the
    drafts made are accepted."""

    def every_other_stretch(
        self: AdaptiveSpeculation,
        seqs: list[Sequence],
        num_other_tokens: int,
        mixed: bool = False,
        backlogs: list[int] | None = None,
    ) -> list[int]:
        return [seq.spec.max_k if seq.num_output_tokens // 4 % 2 == 0 else 0 for seq in seqs]

    monkeypatch.setattr(AdaptiveSpeculation, "choose", every_other_stretch)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    spec = dict(method="suffix", num_speculative_tokens=4, adaptive=True)
    llm = make_llm(target, spec, async_scheduling=True)
    engine = llm.engine
    query_lens: list[int] = []
    launch_ahead = engine.runner.launch_ahead

    def recorded(batch: ScheduledBatch, plan: StepPlan) -> LaunchedStep:
        query_lens.extend(batch.num_new_tokens)
        return launch_ahead(batch, plan)

    engine.runner.launch_ahead = recorded  # type: ignore[method-assign]
    outputs = llm.generate(prompt_token_ids=repetitive_prompts(12), sampling_params=params)
    assert [o.token_ids for o in outputs] == reference[0]
    assert len(query_lens) > 20
    assert set(query_lens) == {1}  # a request that drafts (on the host) never runs ahead
    assert sum(o.spec_stats["num_accepted_tokens"] for o in outputs) > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.inputs.slot_of and not engine.has_unfinished_requests()


def drive(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, RequestOutput]:
    """Runs requests 0..2 from the start, aborts request 1 after 6 steps and lets the others join
    after 4 and 9 steps; the last output of each request."""
    for i in range(3):
        engine.add_request(f"r{i}", prompt_token_ids=prompts[i], params=params)
    last: dict[str, RequestOutput] = {}
    num_steps = 0
    while engine.has_unfinished_requests() or num_steps < 10:
        if num_steps == 4:
            engine.add_request("r3", prompt_token_ids=prompts[3], params=params)
        if num_steps == 6 and (aborted := engine.abort_request("r1")) is not None:
            last["r1"] = aborted
        if num_steps == 9:
            engine.add_request("r4", prompt_token_ids=prompts[4], params=params)
        for output in engine.step():
            last[output.request_id] = output
        num_steps += 1
    return last


@pytest.mark.parametrize("method", ["naive", "ngram", "mtp"])
def test_abort_and_joins_mid_run(target, methods, reference, method) -> None:
    spec = methods[method]
    prompts = repetitive_prompts(12)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    sync = drive(make_llm(target, spec, async_scheduling=False).engine, prompts, params)
    llm = make_llm(target, spec, async_scheduling=True)
    ahead = count_ahead(llm.engine)
    outputs = drive(llm.engine, prompts, params)
    assert ahead[0] > 10
    for request_id in ("r0", "r2", "r3", "r4"):
        assert_alike([sync[request_id]], [outputs[request_id]])
    aborted = outputs["r1"]
    assert aborted.finished and aborted.finish_reason == "abort"
    assert aborted.token_ids == reference[0][1][: len(aborted.token_ids)]
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.inputs.slot_of


def test_preemption_and_a_full_batch_keep_the_output(target, reference) -> None:
    """Too few KV blocks for the batch (requests are preempted and recomputed) and fewer slots than
    requests (the rest wait): steps run ahead only between those events."""
    prompts = repetitive_prompts(12)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for engine_args in (dict(num_kv_blocks=24, block_size=8), dict(max_num_seqs=3)):
        spec = dict(method="ngram", num_speculative_tokens=3)
        sync = make_llm(target, spec, False, **engine_args).generate(
            prompt_token_ids=prompts, sampling_params=params
        )
        llm = make_llm(target, spec, True, **engine_args)
        ahead = count_ahead(llm.engine)
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert_alike(sync, outputs)
        assert [o.token_ids for o in outputs] == reference[0]
        assert ahead[0] > 0
    assert llm.engine.scheduler.num_preemptions == 0  # max_num_seqs: waiting, never preempted


@pytest.mark.parametrize("method", ["naive", "ngram", "mtp"])
def test_steps_ahead_through_the_graphs_static_buffers(target, methods, reference, method) -> None:
    """A step launched ahead, completed on the device between a graph's copy-in and its replay
    (here graphs that run eagerly, test_cuda_graph.EagerGraphs: padded buckets, the scratch slot),
    gives the synchronous eager engine's outputs."""
    from tests.services.engine.test_cuda_graph import with_eager_graphs

    spec = methods[method]
    params = stop_params(*reference)
    prompts = repetitive_prompts(12)
    sync = make_llm(target, spec, async_scheduling=False)
    sync.engine.drafter.max_graph_tokens = 40  # drafts trimmed alike with and without graphs
    expected = sync.generate(prompt_token_ids=prompts, sampling_params=params)
    llm = make_llm(target, spec, async_scheduling=True)
    graphs = with_eager_graphs(llm, max_tokens=40)
    ahead = count_ahead(llm.engine)
    assert_alike(expected, llm.generate(prompt_token_ids=prompts, sampling_params=params))
    assert ahead[0] > 20 and graphs.num_tail_replays > ahead[0]


def test_a_step_ahead_is_completed_inside_its_forward_graph(target, methods, monkeypatch) -> None:
    """Through the graphs, a step launched ahead runs nothing of its own between its copy-in and
    its forward's replay: the completion is part of what the forward graph runs (on a GPU, the
    graph's first kernel), and it completes only steps launched ahead."""
    from services.engine.verify_update import StepTensors
    from tests.services.engine.test_cuda_graph import EagerGraph, with_eager_graphs

    llm = make_llm(target, methods["ngram"], async_scheduling=True)
    graphs = with_eager_graphs(llm, max_tokens=40)
    events: list[str] = []
    copy_in, replay, complete = graphs._copy_in, EagerGraph.replay, StepTensors.complete_ahead

    def copied_in(step, *args) -> None:
        events.append("copy ahead" if step.ahead else "copy")
        copy_in(step, *args)

    def replayed(graph: EagerGraph) -> None:
        events.append("replay")
        replay(graph)

    def completed(tensors: StepTensors, *args) -> None:
        events.append("complete")
        complete(tensors, *args)

    monkeypatch.setattr(graphs, "_copy_in", copied_in)
    monkeypatch.setattr(EagerGraph, "replay", replayed)
    monkeypatch.setattr(StepTensors, "complete_ahead", completed)
    ahead = count_ahead(llm.engine)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm.generate(prompt_token_ids=repetitive_prompts(4), sampling_params=params)
    assert ahead[0] > 5 and events.count("copy ahead") == ahead[0]
    steps = " ".join(events).replace("copy ahead", "ahead").split()
    for i, event in enumerate(steps[:-1]):
        if event in ("ahead", "copy"):  # the forward graph runs next, completing first
            assert steps[i + 1 : i + 3] == ["replay", "complete"], steps[i : i + 4]
    assert steps.count("complete") == steps.count("ahead") + steps.count("copy")


KERNEL_LAUNCHES = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"}


def profiled(run: Callable[[], Any], seen: list[tuple[int, int]]) -> Any:
    """`run()`, noting in `seen` what it launched on the GPU: (kernels launched on their own, CUDA
    graphs launched)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], acc_events=True) as profiler:
        result = run()
        torch.cuda.synchronize()
    names = [event.name for event in profiler.events()]
    seen.append((sum(name in KERNEL_LAUNCHES for name in names), names.count("cudaGraphLaunch")))
    return result


def profile_launches_ahead(llm: LLM, seen: list[tuple[int, int]]) -> None:
    """Every step the engine launches ahead notes what it launched in `seen` (`profiled`)."""
    runner = llm.engine.runner
    launch_ahead = runner.launch_ahead
    runner.launch_ahead = lambda *args: profiled(lambda: launch_ahead(*args), seen)  # type: ignore[method-assign]


def ending_params(prompts: list[list[int]]) -> list[SamplingParams]:
    """Per prompt in turn: greedy to max_tokens, a stop id (its last token), EOS, seeded sampling."""
    params = []
    for i, prompt in enumerate(prompts):
        fields: dict = {"temperature": 0.0, "max_tokens": 8 + 3 * i, "ignore_eos": True}
        endings: list[dict] = [
            {},
            {"stop_token_ids": [prompt[-1]]},
            {"ignore_eos": False},
            {"temperature": 0.8, "seed": i},
        ]
        params.append(SamplingParams(**(fields | endings[i % 4])))
    return params


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_step_ahead_launches_only_its_two_graphs_on_the_gpu(make_checkpoint) -> None:
    """On a GPU the launch of a step ahead is its inputs' copy, the forward graph (which completes
    it), the tail graph and the result's copy: no kernel launched on its own."""
    seen: list[tuple[int, int]] = []
    profiled(lambda: torch.ones(3, device="cuda").add_(1), seen)
    assert seen.pop()[0] >= 1  # the profiler sees a launch
    path = str(make_checkpoint("llama", num_hidden_layers=2))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(path, device="cuda", dtype="float32", max_model_len=256, speculative_config=spec)
    profile_launches_ahead(llm, seen)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm.generate(prompt_token_ids=repetitive_prompts(5, seed=3), sampling_params=params)
    assert llm.engine.runner.graphs is not None
    llm.close()
    assert len(seen) > 5 and all(launched == (0, 2) for launched in seen), seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["naive", "ngram", "mtp", "draft_model", "eagle3"])
def test_steps_ahead_on_the_gpu_return_what_sync_steps_do(make_checkpoint, method: str) -> None:
    """With CUDA graphs on a GPU (steps completed on the device between the copy-in and the replay,
    results read back behind the next step's launch), greedy, stop ids, EOS, max_tokens and seeded
    requests end as without asynchronous scheduling."""
    from tests.services.engine.spec_decode.helpers import eagle3_head_for
    from tests.services.engine.test_cuda_graph import mtp_head_for

    path = str(make_checkpoint("llama", num_hidden_layers=2))
    spec: dict = {}
    if method != "naive":
        spec = {"method": method, "num_speculative_tokens": 4 if method == "ngram" else 3}
    models = {"draft_model": lambda target: target, "mtp": mtp_head_for, "eagle3": eagle3_head_for}
    if method in models:
        spec["model"] = str(models[method](path))
    prompts = repetitive_prompts(21, seed=5)
    params = ending_params(prompts)
    outputs = []
    for async_scheduling in (False, True):
        llm = LLM(
            path,
            device="cuda",
            dtype="float32",
            max_model_len=256,
            speculative_config={"adaptive": False, **spec} if spec else {},
            async_scheduling=async_scheduling,
            cuda_graph_max_tokens=64,
        )
        ahead = count_ahead(llm.engine)
        outputs.append(llm.generate(prompt_token_ids=prompts, sampling_params=params))
        assert llm.engine.runner.graphs is not None
        assert (ahead[0] > 10) == async_scheduling
        llm.close()
    assert_alike(*outputs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["mtp", "eagle3"])
@pytest.mark.parametrize("with_ngram", [False, True], ids=["tree", "tree-with-ngram"])
def test_tree_steps_ahead_on_the_gpu_return_what_sync_steps_do(
    make_checkpoint, method: str, with_ngram: bool
) -> None:
    """Draft trees on a GPU with CUDA graphs: tree steps are launched ahead, each launch its inputs'
    copy and the two graphs (the forward's first kernel lays the trees out from the drafts'
    parents), and greedy, stop ids, EOS, max_tokens and seeded requests end as without
    asynchronous scheduling."""
    from tests.services.engine.spec_decode.helpers import eagle3_head_for
    from tests.services.engine.test_cuda_graph import mtp_head_for

    path = str(make_checkpoint("llama", num_hidden_layers=2))
    head = {"mtp": mtp_head_for, "eagle3": eagle3_head_for}[method](path)
    spec: dict = {"method": method, "model": str(head), "adaptive": False, "tree": [3, 2, 1]}
    if with_ngram:
        spec |= {"with_ngram": True, "tree_budget": 16 + 5}
    prompts = repetitive_prompts(12, seed=5)
    params = ending_params(prompts)
    seen: list[tuple[int, int]] = []
    outputs = []
    for async_scheduling in (False, True):
        llm = LLM(
            path,
            device="cuda",
            dtype="float32",
            max_model_len=256,
            speculative_config=spec,
            async_scheduling=async_scheduling,
            cuda_graph_max_tokens=128,
            max_num_seqs=8,
        )
        ahead = count_ahead(llm.engine)
        profile_launches_ahead(llm, seen)
        outputs.append(llm.generate(prompt_token_ids=prompts, sampling_params=params))
        graphs = llm.engine.runner.graphs
        assert graphs is not None and graphs.trees
        assert (ahead[0] > 10) == async_scheduling
        llm.close()
    assert_alike(*outputs)
    assert len(seen) > 10 and all(launched == (0, 2) for launched in seen), seen


# ---- grammar requests: the forward launched ahead, the tail once the step before has landed ------


def grammar_params(reference: list[list[int]], texts: list[str]) -> list[SamplingParams]:
    """Per prompt, grammar requests beside plain ones: a JSON schema ending at its grammar's end
    (EOS not ignored), a regex whose grammar ends while the request goes on unconstrained (EOS
    ignored), a choice under seeded sampling, a plain greedy request with a stop string, a JSON
    schema cut by max_tokens, and `stop_params`' seeded sampled plain request."""
    plain = stop_params(reference, texts)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, top_k=50, seed=5, max_tokens=30)
    params = []
    for i, plain_params in enumerate(plain):
        kind = i % 6
        if kind == 0:
            update = {"structured": GRAMMARS["json_schema"], "ignore_eos": False}
            params.append(greedy.model_copy(update=update))
        elif kind == 1:
            params.append(greedy.model_copy(update={"structured": GRAMMARS["regex"]}))
        elif kind == 2:
            params.append(sampled.model_copy(update={"structured": GRAMMARS["choice"], "ignore_eos": False}))
        elif kind == 4:
            params.append(greedy.model_copy(update={"structured": GRAMMARS["json_schema"], "max_tokens": 9}))
        else:
            params.append(plain_params)
    return params


def count_pending_tails(engine: LLMEngine) -> list[int]:
    """Counts the tails launched after the step before landed (one-element list, updated in place)."""
    count = [0]
    launch_tail = engine.runner.launch_tail

    def counted(pending: PendingTail) -> LaunchedStep:
        count[0] += 1
        return launch_tail(pending)

    engine.runner.launch_tail = counted  # type: ignore[method-assign]
    return count


def assert_grammars_followed(outputs: list[RequestOutput], params: list[SamplingParams]) -> None:
    """Every grammar request that ended at its grammar's end gave a complete answer."""
    for output, request_params in zip(outputs, params, strict=True):
        structured = request_params.structured
        if structured is None or output.finish_reason != "stop":
            continue
        if structured == GRAMMARS["json_schema"]:
            json.loads(output.text)
        elif structured == GRAMMARS["choice"]:
            assert output.text in CHOICES
    assert any(p.structured is not None and o.finish_reason == "stop" for o, p in zip(outputs, params))


@pytest.mark.parametrize("method", ["naive", "ngram", "mtp"])
def test_grammar_requests_run_ahead_and_return_what_sync_scheduling_does(
    target, methods, reference, method, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Grammar and plain requests in one batch, ending every way (their grammar's end found a step
    late, max_tokens, a stop string, a stop id): asynchronous scheduling returns the synchronous
    outputs. A step ahead with grammar rows launches its tail only after the step before landed;
    grammar requests that verify drafts never run ahead (the drafting methods' controller here
    leaves every request at k = 0 for every other stretch of four steps)."""
    choices = [0]

    def every_other_stretch(
        self: AdaptiveSpeculation,
        seqs: list[Sequence],
        num_other_tokens: int,
        mixed: bool = False,
        backlogs: list[int] | None = None,
    ) -> list[int]:
        choices[0] += 1
        return [seq.spec.max_k if choices[0] // 4 % 2 else 0 for seq in seqs]

    monkeypatch.setattr(AdaptiveSpeculation, "choose", every_other_stretch)
    spec = {**methods[method], "adaptive": True} if method != "naive" else {}
    params = grammar_params(*reference)
    prompts = repetitive_prompts(12)
    sync = make_llm(target, spec, async_scheduling=False).generate(
        prompt_token_ids=prompts, sampling_params=params
    )
    llm = make_llm(target, spec, async_scheduling=True)
    engine = llm.engine
    pending = count_pending_tails(engine)
    grammar_query_lens: list[int] = []
    launch_ahead = engine.runner.launch_ahead

    def recorded(batch: ScheduledBatch, plan: StepPlan) -> LaunchedStep | PendingTail:
        grammar_query_lens.extend(n for seq, n in zip(batch.seqs, batch.num_new_tokens) if seq.grammar)
        return launch_ahead(batch, plan)

    engine.runner.launch_ahead = recorded  # type: ignore[method-assign]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert_alike(sync, outputs)
    assert_grammars_followed(outputs, params)
    assert pending[0] > 10
    assert set(grammar_query_lens) == {1}  # a grammar request that drafts never runs ahead
    if method != "naive":
        assert sum(o.spec_stats["num_draft_tokens"] for o in outputs if o.spec_stats) > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.inputs.slot_of and not engine.has_unfinished_requests()


def test_a_grammar_step_ahead_fills_its_masks_after_the_step_before_lands(
    target, methods, reference, monkeypatch
) -> None:
    """Through the graphs (run eagerly here): a step ahead with grammar rows replays its forward,
    then the step before is read back, then its masks are filled and its tail replayed; the outputs
    are the synchronous engine's, with aborts and joins mid-run."""
    from services.engine.grammar import StepMasks
    from tests.services.engine.test_cuda_graph import with_eager_graphs

    prompts = repetitive_prompts(12)
    params = grammar_params(*reference)[0].model_copy(update={"max_tokens": 30})
    sync = drive(make_llm(target, {}, async_scheduling=False).engine, prompts, params)
    llm = make_llm(target, {}, async_scheduling=True)
    graphs = with_eager_graphs(llm, max_tokens=40)
    events: list[str] = []
    replay_forward, replay_tail = graphs.replay_forward, graphs.replay_tail
    result, fill = LaunchedStep.result, StepMasks.fill

    def forward(step, *args):
        events.append("forward ahead" if step.ahead else "forward")
        return replay_forward(step, *args)

    def tail(*args):
        events.append("tail")
        return replay_tail(*args)

    monkeypatch.setattr(graphs, "replay_forward", forward)
    monkeypatch.setattr(graphs, "replay_tail", tail)
    monkeypatch.setattr(LaunchedStep, "result", lambda self: events.append("result") or result(self))
    monkeypatch.setattr(StepMasks, "fill", lambda self, *args: events.append("fill") or fill(self, *args))
    outputs = drive(llm.engine, prompts, params)
    for request_id in ("r0", "r2", "r3", "r4"):
        assert_alike([sync[request_id]], [outputs[request_id]])
    assert outputs["r1"].finish_reason == "abort"
    ahead = [i for i, event in enumerate(events) if event == "forward ahead"]
    assert len(ahead) > 10
    for i in ahead:  # the step before lands between the forward and the masks of the step ahead
        assert events[i : i + 4] == ["forward ahead", "result", "fill", "tail"]
    assert not llm.engine.inputs.slot_of


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["naive", "ngram"])
def test_grammar_steps_ahead_on_the_gpu_return_what_sync_steps_do(make_checkpoint, method: str) -> None:
    """With CUDA graphs on a GPU (a grammar step's forward replayed ahead, its masks copied in and
    its tail replayed once the step before has landed), grammar and plain requests end as without
    asynchronous scheduling."""
    path = str(make_checkpoint("llama", num_hidden_layers=2))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False} if method == "ngram" else {}
    prompts = repetitive_prompts(12, seed=5)
    reference = [[int(t) for t in prompt[:16]] for prompt in prompts]
    params = grammar_params(reference, ["ab" * 8] * len(prompts))
    outputs = []
    for async_scheduling in (False, True):
        llm = LLM(
            path,
            device="cuda",
            dtype="float32",
            max_model_len=256,
            speculative_config=spec,
            async_scheduling=async_scheduling,
            cuda_graph_max_tokens=64,
        )
        pending = count_pending_tails(llm.engine)
        outputs.append(llm.generate(prompt_token_ids=prompts, sampling_params=params))
        assert llm.engine.runner.graphs is not None
        if method == "naive":
            assert (pending[0] > 10) == async_scheduling
        llm.close()
    assert_alike(*outputs)
    assert_grammars_followed(outputs[1], params)
