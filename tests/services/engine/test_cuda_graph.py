"""Decode steps replayed from CUDA graphs: padding that changes nothing, the same tokens as eager
steps for every drafting method, one output buffer for every graph."""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from services.engine.cuda_graph import BUCKETS, DecodeGraphs
from services.engine.llm import LLM
from services.engine.tensor_parallel import Ranks
from services.engine.verify_update import StepPlan
from shared.model import load_model
from shared.sampling_params import SamplingParams
from shared.speculative_config import SpeculativeOverride
from shared.structured_output import StructuredOutput
from shared.tokenizer import Tokenizer
from tests.services.engine.spec_decode.helpers import eagle3_head_for, repetitive_prompts

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BLOCK = 4


def test_bucket_lookup_takes_the_smallest_fit() -> None:
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.buckets = [b for b in BUCKETS if b < 100] + [100]
    graphs.query_lens = [1, 6, 64]
    graphs.max_num_seqs = 40
    assert graphs.lookup(1, 1) == (1, 1)
    assert graphs.lookup(13, 1) == (16, 1)
    assert graphs.lookup(13, 4) == (16, 6)
    assert graphs.lookup(97, 6) == (100, 6)
    assert graphs.lookup(39, 1) == (40, 1)  # no more one-token steps than requests
    assert graphs.lookup(41, 1) is None
    assert graphs.lookup(8, 7) == (8, 64)  # a prefill chunk
    assert graphs.lookup(97, 64) == (100, 64)
    assert graphs.lookup(101, 1) is None  # past the largest bucket: eager
    assert graphs.lookup(20, 65) is None  # a longer query than any graph was captured for


def test_a_chain_replays_the_shortest_captured_tail_that_covers_it() -> None:
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.chain_lengths = [0, 1, 2, 3]
    assert [graphs.chain_key(n) for n in range(4)] == [0, 1, 2, 3]
    graphs.chain_lengths = [0, 3]  # a tree server: its head drafts the whole tree
    assert [graphs.chain_key(n) for n in range(4)] == [0, 3, 3, 3]


def test_graphs_are_off_on_cpu(make_checkpoint) -> None:
    llm = LLM(str(make_checkpoint("llama", num_hidden_layers=1)), device="cpu", max_model_len=64)
    assert llm.engine.runner.graphs is None


class EagerGraph:
    """Stands in for a captured graph: `replay` runs what was captured, into the same output."""

    def __init__(self, run: Callable[[], torch.Tensor | None], out: torch.Tensor | None = None):
        self.run, self.out = run, out
        self.released = False

    def reset(self) -> None:
        self.released = True

    def replay(self) -> None:
        result = self.run()
        if self.out is not None and result is not None:
            self.out.copy_(result)


class EagerGraphs(DecodeGraphs):
    """DecodeGraphs whose graphs run eagerly: what a replay computes (the static buffers of a
    padded bucket: padding tokens, empty grid sequences, the scratch slot) on a CPU, through the
    kernels' torch twins."""

    def capture(self) -> None:
        for bucket, query_len in self.shapes():
            forward = functools.partial(self._forward, bucket, query_len)
            self.graphs[bucket, query_len] = EagerGraph(forward)  # type: ignore[assignment]
            for chain, only in itertools.product(self.chain_lengths, self.onlys):
                plan = StepPlan([], [], chain, only=only)
                width = self.tail.width(self.max_rows(query_len))
                out = torch.empty(self.num_rows(bucket), width, dtype=torch.int32)
                run = functools.partial(self._run_tail, bucket, query_len, plan)
                self.tails[bucket, query_len, chain, only] = (EagerGraph(run, out), out)  # type: ignore[assignment]

    def _run_tail(self, bucket: int, query_len: int, plan: StepPlan) -> torch.Tensor:
        rows = self.num_rows(bucket)
        return self.tail(self.logits[:rows], self.tensors(bucket, query_len), plan)


def with_eager_graphs(llm: LLM, max_tokens: int, prefill_len: int | None = None) -> EagerGraphs:
    """Installs graphs that run eagerly into a CPU engine, as a GPU engine captures them (with a
    prefill query class of `prefill_len` when given; tree graphs on a server that drafts trees)."""
    runner, drafter = llm.engine.runner, llm.engine.drafter
    k = runner.spec.k
    assert runner.tail is not None
    graphs = EagerGraphs(
        runner.model,
        runner.kv_caches,
        runner.tail,
        runner.inputs,
        max_tokens,
        [1, *runner.verify_query_lens()] + ([prefill_len] if prefill_len else []),
        runner.chain_lengths() if runner.tree is not None else list(range(k + 1)),
        [None] if drafter.own is None else [None, drafter.own],
        runner.max_model_len,
        runner.block_size,
        runner.config.max_num_seqs,
        runner.aux_layers,
        trees=runner.tree is not None,
    )
    graphs.capture()
    runner.graphs = graphs
    drafter.max_graph_tokens = graphs.max_decode_tokens
    return graphs


class LeavingRanks(Ranks):
    """A group of one that notes, when it is left, whether `graphs` were all destroyed by then."""

    def __init__(self, graphs: list[EagerGraph]):
        self.graphs = graphs
        self.left_after_graphs: list[bool] = []

    def close(self) -> None:
        self.left_after_graphs.append(all(graph.released for graph in self.graphs))


def every_graph(graphs: DecodeGraphs) -> list[EagerGraph]:
    return [*graphs.graphs.values(), *(graph for graph, _ in graphs.tails.values())]  # type: ignore[list-item]


def test_closing_destroys_the_graphs_before_the_group_is_left(make_checkpoint) -> None:
    """NCCL does not destroy a communicator while a graph that captured its collectives lives:
    closing an engine destroys every graph before its ranks leave the group (else the leave waits
    for them and its teardown runs whenever they are freed, during a later capture perhaps);
    steps then run eagerly."""
    llm = LLM(str(make_checkpoint("llama", num_hidden_layers=1)), device="cpu", max_model_len=64)
    graphs = with_eager_graphs(llm, max_tokens=8)
    captured = every_graph(graphs)
    ranks = llm.engine.runner.ranks = LeavingRanks(captured)
    llm.close()
    assert ranks.left_after_graphs == [True] and len(captured) > 1
    assert llm.engine.runner.graphs is None and not every_graph(graphs)


def test_a_failed_capture_destroys_the_graphs_it_captured(make_checkpoint, monkeypatch) -> None:
    """A capture that fails part way (the engine's start-up then leaves the group) destroys the
    graphs captured before it."""
    llm = LLM(str(make_checkpoint("llama", num_hidden_layers=1)), device="cpu", max_model_len=64)
    graphs = with_eager_graphs(llm, max_tokens=8)
    graphs.graphs.clear()
    graphs.tails.clear()
    captured: list[EagerGraph] = []

    def capture(run: Callable[[], None], pool: Any) -> EagerGraph:
        if len(captured) == 3:
            raise RuntimeError("capture invalidated")
        run()  # what a capture records (a tail's packed result among it)
        captured.append(EagerGraph(run))
        return captured[-1]

    monkeypatch.setattr(graphs, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 1))
    with pytest.raises(RuntimeError, match="capture invalidated"):
        DecodeGraphs.capture(graphs)
    assert len(captured) == 3 and all(graph.released for graph in captured)
    assert not every_graph(graphs)


CASES = {
    "naive": {},
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
    "mtp": {"method": "mtp", "num_speculative_tokens": 3},
    "mtp-with-ngram": {
        "method": "mtp",
        "num_speculative_tokens": 4,
        "num_model_steps": 2,
        "mtp_strategy": "with_ngram",
    },
    "eagle3": {"method": "eagle3", "num_speculative_tokens": 3},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},
}


def fixed_k_spec(case: str, target: str) -> dict:
    """The speculative config of a CASES entry with adaptive speculation off, the drafting model
    being the target itself (draft_model) or an untrained MTP head for it (mtp)."""
    spec = dict(CASES[case])
    if spec:
        spec["adaptive"] = False
    if spec.get("method") == "draft_model":
        spec["model"] = target
    if spec.get("method") == "mtp":
        spec["model"] = str(mtp_head_for(target))
    if spec.get("method") == "eagle3":
        spec["model"] = str(eagle3_head_for(target))
    return spec


@pytest.mark.parametrize("sampling", ["greedy", "seeded", "stops"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_padded_graph_steps_give_the_eager_tokens(make_checkpoint, case: str, sampling: str) -> None:
    """Steps run through the graphs' static buffers (padded to buckets, 13 requests finishing at
    different lengths so batches cross bucket sizes) emit the eager engine's tokens and stop where
    it does, for every drafting method; the MTP head and the draft model are the target's own
    (an MTP head initialised from the target's last layer)."""
    path = str(make_checkpoint("llama", num_hidden_layers=2))
    spec = fixed_k_spec(case, path)
    eos = min(Tokenizer(path).eos_token_ids)
    prompts = repetitive_prompts(13, seed=3)
    params = []
    for i in range(13):
        fields: dict = {"temperature": 0.0, "max_tokens": 6 + 3 * i, "ignore_eos": True}
        if sampling == "seeded":
            fields |= {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 7}
        if sampling == "stops":
            fields |= [{"ignore_eos": False}, {"stop_token_ids": [prompts[i][-1], eos]}, {"min_tokens": 5}][
                i % 3
            ]
        params.append(SamplingParams(**fields))
    outputs = []
    for graphs in (False, True):
        llm = LLM(path, device="cpu", max_model_len=192, speculative_config=spec)
        fake = with_eager_graphs(llm, max_tokens=24) if graphs else None
        llm.engine.drafter.max_graph_tokens = 24  # drafts trimmed alike with and without graphs
        generated = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        outputs.append(
            [(o.token_ids, o.finish_reason, o.spec_stats["num_accepted_tokens"]) for o in generated]
        )
        if fake is not None:
            assert fake.num_tail_replays > 10
    assert outputs[1] == outputs[0]


def recording(plan: Callable[..., StepPlan], planned: list[StepPlan]) -> Callable[..., StepPlan]:
    """`plan`, keeping what it returns in `planned`."""

    def record(*args: Any, **kwargs: Any) -> StepPlan:
        planned.append(plan(*args, **kwargs))
        return planned[-1]

    return record


def test_the_servers_own_proposer_runs_alone_unless_a_request_asks_for_another(make_checkpoint) -> None:
    """On an MTP server, a step whose requests all draft with the MTP head replays tails that run
    only the head; once a request asks for n-gram drafting its steps run both proposers. The tokens
    and acceptance equal the eager engine's either way."""
    path = str(make_checkpoint("llama", num_hidden_layers=2))
    spec = fixed_k_spec("mtp", path)
    prompts = repetitive_prompts(5, seed=5)
    ngram = SpeculativeOverride(method="ngram")
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=8 + 2 * i, ignore_eos=True, speculative=ngram if i == 4 else None
        )
        for i in range(5)
    ]
    outputs, onlys = [], []
    for graphs in (False, True):
        llm = LLM(path, device="cpu", max_model_len=192, speculative_config=spec)
        drafter = llm.engine.drafter
        fake = with_eager_graphs(llm, max_tokens=24) if graphs else None
        drafter.max_graph_tokens = 24
        planned: list[StepPlan] = []
        drafter.plan = recording(drafter.plan, planned)  # type: ignore[method-assign]
        first = llm.generate(prompt_token_ids=prompts[:4], sampling_params=params[:4])
        mixed = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        outputs.append([(o.token_ids, o.spec_stats["num_accepted_tokens"]) for o in first + mixed])
        onlys.append({p.only for p in planned})
        if fake is not None:
            assert fake.num_tail_replays > 10
    assert outputs[1] == outputs[0]
    mtp = drafter.device_methods.index("mtp")
    assert drafter.own == mtp
    assert onlys[1] == {mtp, None}


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("case", ["naive", "ngram", "mtp", "eagle3", "draft_model"])
def test_steps_with_prefill_chunks_replay_the_eager_tokens(make_checkpoint, case: str, sampling: str) -> None:
    """With 3 requests running at a time out of 9, a request joins as another finishes, so most
    steps carry a prefill chunk beside decoding requests and their drafts; those steps go through
    the graphs' static buffers too (prefill class of 24 tokens, chunks cut to fit) and emit the
    eager engine's tokens for every drafting method."""
    path = str(make_checkpoint("llama", num_hidden_layers=2))
    spec = fixed_k_spec(case, path)
    prompts = repetitive_prompts(9, seed=5)
    params = []
    for i in range(9):
        fields: dict = {"temperature": 0.0, "max_tokens": 5 + 4 * i, "ignore_eos": True}
        if sampling == "seeded":
            fields |= {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 11}
        params.append(SamplingParams(**fields))
    outputs = []
    for graphs in (False, True):
        llm = LLM(
            path,
            device="cpu",
            max_model_len=192,
            speculative_config=spec,
            max_num_seqs=3,
            max_num_batched_tokens=24,
        )
        fake = with_eager_graphs(llm, max_tokens=24, prefill_len=24) if graphs else None
        llm.engine.drafter.max_graph_tokens = 12  # drafts trimmed alike with and without graphs
        generated = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        outputs.append(
            [(o.token_ids, o.finish_reason, o.spec_stats["num_accepted_tokens"]) for o in generated]
        )
        if fake is not None:
            assert fake.num_mixed_replays > 10
            assert fake.num_tail_replays > fake.num_mixed_replays
    assert outputs[1] == outputs[0]


GRAMMAR_REGEX = r"[a-e]{3,40}"


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("case", ["naive", "ngram", "draft_model"])
def test_grammar_steps_replay_the_tail_with_their_masks(make_checkpoint, case: str, sampling: str) -> None:
    """Grammar requests beside plain ones go through the tail graph: the host fills their rows'
    masks into the graphs' persistent buffer after the forward's replay, and the tokens equal the
    eager engine's, every constrained output following its regex (a random model's own choices
    almost never would)."""
    path = str(make_checkpoint("llama", num_hidden_layers=2))
    spec = fixed_k_spec(case, path)
    prompts = repetitive_prompts(8, seed=9)
    extra: dict = {"temperature": 0.0}
    if sampling == "seeded":
        extra = {"temperature": 0.8, "top_k": 40, "seed": 3}
    grammar = StructuredOutput(kind="regex", spec=GRAMMAR_REGEX)
    params = [
        SamplingParams(max_tokens=10 + 2 * i, structured=grammar if i % 2 else None, **extra)
        for i in range(8)
    ]
    outputs = []
    for graphs in (False, True):
        llm = LLM(path, device="cpu", max_model_len=192, speculative_config=spec)
        fake = with_eager_graphs(llm, max_tokens=24) if graphs else None
        llm.engine.drafter.max_graph_tokens = 24
        generated = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        outputs.append([(o.token_ids, o.finish_reason) for o in generated])
        for i, output in enumerate(generated):
            text = llm.engine.tokenizer.decode(output.token_ids)
            if i % 2:  # the whole answer, or a prefix of one cut by max_tokens
                assert re.fullmatch(GRAMMAR_REGEX if output.finish_reason == "stop" else "[a-e]*", text), text
        if fake is not None:
            assert fake.num_tail_replays == fake.num_replays > 5
    assert outputs[1] == outputs[0]


_HEADS: dict[str, object] = {}


def mtp_head_for(target: str):
    """An untrained MTP head for `target` (its layer copied from the target's last), saved once."""
    import tempfile

    from shared.model.mtp import MTPHead, save_mtp_head

    if target not in _HEADS:
        model = load_model(target, torch.float32, torch.device("cpu"), 192)
        head = MTPHead(model)
        torch.manual_seed(0)
        for p in head.parameters():
            torch.nn.init.normal_(p, std=0.05)
        _HEADS[target] = save_mtp_head(head, tempfile.mkdtemp(prefix="mtp-"))
    return _HEADS[target]


@pytest.mark.parametrize(
    "method,sampling",
    [
        ("naive", "greedy"),
        ("ngram", "greedy"),
        ("ngram", "seeded"),
        ("suffix", "greedy"),
        ("ngram", "penalty"),
        ("mtp", "greedy"),
        ("mtp", "seeded"),
        ("eagle3", "greedy"),
        ("eagle3", "seeded"),
        ("draft_model", "greedy"),
        ("draft_model", "seeded"),
        ("ngram", "grammar"),
        ("mtp", "grammar"),
        ("draft_model", "grammar"),
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_replay_gives_the_eager_tokens(make_checkpoint, method: str, sampling: str, dtype: str) -> None:
    """Tokens from graph replays (forward, then verify + drafting in the tail graph) equal eager
    ones, with batches that cross bucket sizes (sequences finish at different lengths) and drafts
    of varying length; penalties take the eager verifier after the forward replay, grammar requests
    the tail graph with their masks."""
    path = str(make_checkpoint("llama", num_hidden_layers=2))
    spec: dict = {"method": method}
    if method != "naive":
        spec |= {"num_speculative_tokens": 4 if method in ("ngram", "suffix") else 3, "adaptive": False}
    if method == "draft_model":
        spec["model"] = path
    if method == "mtp":
        spec["model"] = str(mtp_head_for(path))
    if method == "eagle3":
        spec["model"] = str(eagle3_head_for(path))
    generator = torch.Generator().manual_seed(5)
    prompts = []
    for i in range(21):
        span = torch.randint(3, 384, (5 + i % 7,), generator=generator).tolist()
        prompts.append(torch.randint(3, 384, (i,), generator=generator).tolist() + span * 3)
    extra = {
        "greedy": {"temperature": 0.0},
        "seeded": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 7},
        "penalty": {"temperature": 0.0, "repetition_penalty": 1.2},
        "grammar": {"temperature": 0.0, "structured": StructuredOutput(kind="regex", spec="[a-e ]+")},
    }[sampling]
    params = [SamplingParams(max_tokens=8 + 3 * i, ignore_eos=True, **extra) for i in range(21)]
    outputs = {}
    for eager in (True, False):
        llm = LLM(
            path,
            device="cuda",
            dtype=dtype,
            max_model_len=256,
            speculative_config=spec,
            enforce_eager=eager,
            cuda_graph_max_tokens=64,
        )
        generated = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        outputs[eager] = [o.token_ids for o in generated]
        graphs = llm.engine.runner.graphs
        if eager:
            assert graphs is None
            continue
        assert graphs is not None and graphs.num_replays > 10
        if sampling == "penalty":
            assert graphs.num_tail_replays == 0  # penalties are applied by the eager verifier
        else:
            assert graphs.num_tail_replays == graphs.num_replays
        # a repetition penalty rejects repeats; a random model's drafts rarely follow a grammar; the
        # random EAGLE-3 head drafts from every other token, none of which a random target may choose
        if method == "eagle3":
            assert sum(o.spec_stats["num_draft_tokens"] for o in generated) > 0
        elif method != "naive" and sampling not in ("penalty", "grammar"):
            assert sum(o.spec_stats["num_accepted_tokens"] for o in generated) > 0
    if dtype == "float32":
        assert outputs[False] == outputs[True]
    else:  # bf16 GEMMs of a padded batch may round differently: allow a late divergence, not an early one
        for graph_tokens, eager_tokens in zip(outputs[False], outputs[True]):
            assert graph_tokens[:4] == eager_tokens[:4]


@pytest.mark.gpu
@needs_cuda
def test_graph_outputs_share_one_buffer(make_checkpoint) -> None:
    """Every graph writes into one persistent max-bucket output buffer and the pool keeps one
    capture's temporaries: capturing all buckets up to 256 for two query classes reserves about two
    max-bucket logits buffers (plus small change), where per-graph outputs took the sum over
    buckets (~8 of them). A large vocabulary makes the logits dominate."""
    vocab_size, max_tokens = 131072, 256
    device = torch.device("cuda")
    path = str(make_checkpoint("llama", num_hidden_layers=1, vocab_size=vocab_size))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    llm = LLM(
        path,
        device="cuda",
        dtype="float32",
        max_model_len=256,
        cuda_graph_max_tokens=max_tokens,
        max_num_seqs=max_tokens,
        num_kv_blocks=64,
        block_size=BLOCK,
    )
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    torch.cuda.empty_cache()
    grown = torch.cuda.memory_reserved(device) - before
    one_logits = max_tokens * vocab_size * 4
    assert graphs.logits.shape == (max_tokens, vocab_size)
    assert grown < 3.5 * one_logits, f"graphs reserve {grown / one_logits:.1f} max-bucket logits buffers"


@pytest.mark.gpu
@needs_cuda
def test_graph_replay_stops_where_eager_does(make_checkpoint) -> None:
    """EOS, stop ids, min_tokens, ignore_eos and max_tokens under accepted n-gram drafts through the
    engine: the tail graph's post-step update ends each request where the eager path does
    (tokens, finish and stop reasons, draft and acceptance counts)."""
    path = str(make_checkpoint("llama", num_hidden_layers=2))
    eos = min(Tokenizer(path).eos_token_ids)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False, "accept_policy": "accept_all"}
    generator = torch.Generator().manual_seed(9)
    prompts, params = [], []
    for i in range(16):
        span = torch.randint(3, 384, (7,), generator=generator).tolist()
        span[4] = eos  # the drafts that follow span[:2] reach an EOS at their third token
        prompts.append(torch.randint(3, 384, (i,), generator=generator).tolist() + span * 3 + span[:2])
        fields: dict = {"temperature": 0.0, "max_tokens": 6 + 2 * i}
        fields |= [{}, {"ignore_eos": True}, {"stop_token_ids": [span[3]]}, {"min_tokens": 5}][i % 4]
        params.append(SamplingParams(**fields))
    outputs = {}
    for eager in (True, False):
        llm = LLM(
            path,
            device="cuda",
            dtype="float32",
            max_model_len=256,
            speculative_config=spec,
            enforce_eager=eager,
            cuda_graph_max_tokens=128,  # 16 x (1 + 4) tokens: no draft trimming to fit a graph
        )
        generated = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        outputs[eager] = [
            (
                o.token_ids,
                o.finish_reason,
                o.stop_reason,
                o.spec_stats["num_draft_tokens"],
                o.spec_stats["num_accepted_tokens"],
            )
            for o in generated
        ]
        if not eager:
            graphs = llm.engine.runner.graphs
            assert graphs is not None and graphs.num_tail_replays > 5
    assert outputs[False] == outputs[True]
    reasons = [finish for _, finish, *_ in outputs[True]]
    assert "stop" in reasons and "length" in reasons  # EOS mid-draft: tests/services/engine/test_post_step.py
