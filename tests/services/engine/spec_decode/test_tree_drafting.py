"""Tree drafting end to end on the CPU (`speculative_config.tree`, MTP and EAGLE-3 heads, with and
without an n-gram branch): greedy output is the target's, seeded sampling is unchanged by it,
trees accept more than chains of the same depth, tree steps replayed through the CUDA graphs'
static buffers emit the eager tokens, bad configs are refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.engine.cuda_graph import DecodeGraphs, HostStep
from services.engine.llm import LLM
from services.engine.spec_decode.adaptive import StepCost
from services.engine.spec_decode.mtp import MTPProposer
from services.engine.spec_decode.proposer import DraftBatch
from shared.sampling_params import SamplingParams
from shared.speculative_config import SpeculativeConfig, SpeculativeOverride
from tests.services.engine.spec_decode.helpers import GREEDY, repetitive_prompts
from tests.services.engine.test_cuda_graph import with_eager_graphs

TREE = [3, 2, 1]


def head_llm(target: str, method: str, head: str, **spec) -> LLM:
    spec = {"method": method, "model": head, "adaptive": False, **spec}
    return LLM(target, device="cpu", max_model_len=192, speculative_config=spec)


@pytest.fixture(params=["mtp", "eagle3"])
def method_head(request, mtp_head, eagle3_head) -> tuple[str, str]:
    return request.param, mtp_head if request.param == "mtp" else eagle3_head


def mean_accepted(outputs) -> float:
    """Accepted drafts per verify step, plus its own token."""
    steps = sum(o.spec_stats["num_verify_steps"] for o in outputs)
    return 1 + sum(o.spec_stats["num_accepted_tokens"] for o in outputs) / steps


@pytest.mark.parametrize("logprobs", [None, 2], ids=["tree-verifier", "with-torch-verifier"])
def test_tree_drafting_keeps_greedy_output(target, naive_tokens, method_head, logprobs: int | None) -> None:
    """Requests with logprobs draft nothing on a tree server (the torch verifier takes them) and
    share steps with requests that draft trees."""
    method, head = method_head
    llm = head_llm(target, method, head, tree=TREE)
    params = [GREEDY.model_copy(update={"logprobs": logprobs if i % 2 else None}) for i in range(6)]
    outputs = llm.generate(prompt_token_ids=repetitive_prompts(), sampling_params=params)
    assert [o.token_ids for o in outputs] == naive_tokens
    tree_outputs = outputs[::2]
    assert all(o.spec_stats["num_draft_tokens"] > 0 for o in tree_outputs)
    if logprobs is not None:
        assert all(o.spec_stats["num_draft_tokens"] == 0 for o in outputs[1::2])


def test_the_torch_verifier_sees_only_the_requests_the_tree_rule_cannot_verify(
    target, naive_tokens, mtp_head
) -> None:
    """A tree step beside requests with logprobs: the torch `RejectionSampler` gets those requests
    and their logit rows only, never a request that verifies a tree; greedy output stays naive's."""
    llm = head_llm(target, "mtp", mtp_head, tree=TREE, with_ngram=True)
    runner = llm.engine.runner
    verifier = runner.verifier
    seen: list[tuple[int, list[bool]]] = []

    def recorded(logits: torch.Tensor, batch, requests):
        seen.append((logits.shape[0], [r.params.logprobs is not None for r in requests]))
        assert logits.shape[0] == sum(r.num_rows for r in requests)
        return verifier(logits, batch, requests)

    runner.verifier = recorded  # type: ignore[assignment]
    params = [GREEDY.model_copy(update={"logprobs": 2 if i % 3 == 0 else None}) for i in range(6)]
    outputs = llm.generate(prompt_token_ids=repetitive_prompts(), sampling_params=params)
    assert [o.token_ids for o in outputs] == naive_tokens
    assert len(seen) > 10 and all(all(with_logprobs) for _, with_logprobs in seen)
    assert sum(o.spec_stats["num_draft_tokens"] for i, o in enumerate(outputs) if i % 3) > 0


def accepted_past(outputs, depth: int) -> int:
    """Verify steps that accepted more than `depth` drafts."""
    return sum(sum(o.spec_stats["accepted_per_position"][depth : depth + 1]) for o in outputs)


def test_an_ngram_branch_keeps_greedy_output(target, naive_tokens, method_head) -> None:
    """with_ngram: the n-gram branch, merged into the head's tree and grafted where it parts, is
    verified in the same forward as the head's nodes."""
    method, head = method_head
    llm = head_llm(target, method, head, tree=TREE, with_ngram=True)
    outputs = llm.generate(prompt_token_ids=repetitive_prompts(), sampling_params=GREEDY)
    assert [o.token_ids for o in outputs] == naive_tokens
    assert sum(o.spec_stats["num_accepted_tokens"] for o in outputs) > 0


def branch_of_the_targets_tokens(llm: LLM, sequences: list[list[int]]) -> None:
    """Makes the server's n-gram branch an oracle: each request's next tokens in `sequences`
    (prompt and greedy output), found by the tokens it has."""
    proposer = llm.engine.drafter.proposers[llm.engine.drafter.config.method]
    assert isinstance(proposer, MTPProposer)

    def oracle(batch: DraftBatch) -> torch.Tensor:
        branch = torch.full((len(batch.seq_slots), proposer.num_branch), -1, dtype=torch.int32)
        for i, slot in enumerate(batch.seq_slots.tolist()):
            length = int(batch.inputs.num_tokens[slot])
            row = batch.inputs.token_rows[slot, :length].tolist()
            full = next((s for s in sequences if s[:length] == row), row)
            following = full[length : length + proposer.num_branch]
            branch[i, : len(following)] = torch.tensor(following, dtype=torch.int32)
        return branch

    proposer._ngram_branch = oracle  # type: ignore[method-assign]


def test_a_branch_of_the_targets_own_tokens_is_accepted_past_the_heads_depth(
    target, naive_tokens, method_head
) -> None:
    """Where the branch holds what the target will say, steps accept it past the head's depth 3
    (its grafted nodes' KV compacted in the target's and the head's caches, the head catching up
    on them), and the output is still naive's."""
    method, head = method_head
    prompts = repetitive_prompts()
    llm = head_llm(target, method, head, tree=TREE, with_ngram=True, tree_budget=16 + 5)
    branch_of_the_targets_tokens(llm, [p + t for p, t in zip(prompts, naive_tokens)])
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.token_ids for o in outputs] == naive_tokens
    steps = sum(o.spec_stats["num_verify_steps"] for o in outputs)
    assert accepted_past(outputs, len(TREE)) > steps // 2
    assert mean_accepted(outputs) > len(TREE) + 1


def test_seeded_sampling_is_unchanged_by_an_ngram_branch(target, method_head) -> None:
    """The branch's drafts are point masses beside the head's top-k: the target's keyed sample
    is matched against every child alike, so a seeded request's tokens are naive's."""
    method, head = method_head
    params = SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=30, ignore_eos=True)
    prompts = repetitive_prompts(4)
    naive = LLM(target, device="cpu", max_model_len=192).generate(
        prompt_token_ids=prompts, sampling_params=params
    )
    drafted = head_llm(target, method, head, tree=[2, 1], with_ngram=True, tree_budget=12).generate(
        prompt_token_ids=prompts, sampling_params=params
    )
    assert [o.token_ids for o in drafted] == [o.token_ids for o in naive]
    assert sum(o.spec_stats["num_accepted_tokens"] for o in drafted) > 0


def test_adaptive_prices_a_tree_with_its_ngram_branch_by_its_tokens(
    target, naive_tokens, mtp_head, monkeypatch
) -> None:
    """A depth's price is the head's nodes to it and the branch's; greedy output stays naive's."""
    llm = head_llm(target, "mtp", mtp_head, tree=TREE, adaptive=True, with_ngram=True, tree_budget=20)
    assert llm.engine.drafter.adaptive.tree_tokens["mtp"] == [0, 3 + 4, 9 + 4, 15 + 4]
    with_a_gpus_step_cost(llm, monkeypatch)
    outputs = llm.generate(prompt_token_ids=repetitive_prompts(), sampling_params=GREEDY)
    assert [o.token_ids for o in outputs] == naive_tokens
    assert sum(o.spec_stats["num_accepted_tokens"] for o in outputs) > 0


def test_the_shipped_model_with_an_eagle3_tree_and_ngram_branch_keeps_greedy_output() -> None:
    """The reference model and its EAGLE-3 head on code-editing prompts, a 16-token tree with an
    n-gram branch: the output is naive's."""
    from benchmarks.workloads import load_workload
    from shared.reference import EAGLE3_HEAD, reference_dir

    prompts = [r.prompt for r in load_workload("code_editing")[:2]]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    naive = LLM(str(reference_dir()), device="cpu", max_model_len=2048).generate(prompts, params)
    spec = {"method": "eagle3", "model": str(reference_dir(EAGLE3_HEAD)), "adaptive": False}
    spec |= {"tree": [2, 2, 1], "with_ngram": True, "tree_budget": 16}
    llm = LLM(str(reference_dir()), device="cpu", max_model_len=2048, speculative_config=spec)
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in naive]
    assert sum(o.spec_stats["num_accepted_tokens"] for o in outputs) > 0


def run_engine(llm: LLM, requests: dict[str, tuple[dict, SamplingParams]]) -> dict[str, list[int]]:
    """Every request added at once (`prompt` or `prompt_token_ids`), stepped to the end: tokens by id."""
    engine = llm.engine
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, params=params, **prompt)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return tokens


@pytest.mark.parametrize("logprobs", [None, 2], ids=["tree-verifier", "with-torch-verifier"])
def test_grammar_requests_beside_trees_keep_their_tokens(target, naive_tokens, mtp_head, logprobs) -> None:
    """A grammar request drafts nothing on a tree server and shares steps with tree requests: its
    row is masked by its grammar in the tree verifier, and in the torch sampler where a request
    with logprobs beside it sends the step there."""
    from tests.services.engine.spec_decode.test_structured_output import PROMPTS, constrained

    requests = {
        f"json-{i}": ({"prompt": p}, constrained(GREEDY, "json_schema")) for i, p in enumerate(PROMPTS[:2])
    }
    with_logprobs = GREEDY.model_copy(update={"logprobs": logprobs})
    plain = {
        f"plain-{i}": ({"prompt_token_ids": p}, with_logprobs if i == 0 else GREEDY)
        for i, p in enumerate(repetitive_prompts())
    }
    naive = run_engine(LLM(target, device="cpu", max_model_len=256), dict(requests))
    tokens = run_engine(head_llm(target, "mtp", mtp_head, tree=TREE), {**requests, **plain})
    assert [tokens[f"json-{i}"] for i in range(2)] == [naive[f"json-{i}"] for i in range(2)]
    assert [tokens[f"plain-{i}"] for i in range(len(plain))] == naive_tokens


def tree_query_lens(llm: LLM) -> list[int]:
    """The query lengths of the requests of every step the engine launches ahead from now on."""
    runner = llm.engine.runner
    query_lens: list[int] = []
    launch_ahead = runner.launch_ahead

    def recorded(batch, plan):
        query_lens.extend(batch.num_new_tokens)
        return launch_ahead(batch, plan)

    runner.launch_ahead = recorded  # type: ignore[method-assign]
    return query_lens


@pytest.mark.parametrize("branch", [0, 5], ids=["tree", "tree-with-ngram"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_tree_steps_run_ahead_and_return_what_sync_steps_do(
    target, naive_tokens, method_head, branch: int, graphs: bool
) -> None:
    """Asynchronous scheduling launches tree steps ahead (their trees laid out on the device from
    the drafts' parents the step before kept: kernels/run_ahead_ref.py), through the graphs' static
    buffers too: each request's tokens are the synchronous engine's, and naive's. (Its drafts may
    differ near its end: a step ahead is planned before the step in flight lands.) Six requests of
    different lengths, some cutting the tree."""
    method, head = method_head
    extra = {"with_ngram": True, "tree_budget": 16 + branch} if branch else {}
    params = tree_params("greedy")
    outputs, query_lens = [], []
    for async_scheduling in (False, True):
        spec = {"method": method, "model": head, "adaptive": False, "tree": TREE, **extra}
        llm = LLM(
            target,
            device="cpu",
            max_model_len=192,
            speculative_config=spec,
            async_scheduling=async_scheduling,
        )
        if graphs:
            with_eager_graphs(llm, max_tokens=48)
        llm.engine.drafter.max_graph_tokens = 48  # drafts trimmed alike with and without graphs
        query_lens = tree_query_lens(llm)
        generated = llm.generate(prompt_token_ids=repetitive_prompts(), sampling_params=params)
        outputs.append([(o.token_ids, o.spec_stats) for o in generated])
        assert bool(query_lens) == async_scheduling
        engine = llm.engine
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    naive = [tokens[: p.max_tokens] for tokens, p in zip(naive_tokens, params)]
    assert [tokens for tokens, _ in outputs[1]] == [tokens for tokens, _ in outputs[0]] == naive
    assert sum(stats["num_accepted_tokens"] for _, stats in outputs[1]) > 0
    trees = {1 + 3 + branch, 1 + 9 + branch, 1 + 15 + branch}  # queries of a tree cut at depth 1, 2, 3
    assert set(query_lens) & trees, set(query_lens)
    counts = engine.step_counts  # N of M steps launched ahead (the prefill steps and a few after them wait)
    assert counts.num_ahead > counts.num_steps * 2 // 3, (counts.num_ahead, counts.num_steps)


def with_a_gpus_step_cost(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> LLM:
    """`llm` with its controller fitting a GPU's step, where drafts are nearly free (on this CPU a
    step's time grows with every token, and the controller soon stops drafting)."""
    step_cost = llm.engine.drafter.adaptive.cost
    monkeypatch.setattr(step_cost, "fit", lambda: StepCost(fixed_s=2e-3, verify_s=1e-7))
    return llm


def test_adaptive_tree_drafting_keeps_greedy_output(target, naive_tokens, mtp_head, monkeypatch) -> None:
    """Adaptive speculation picks each request's depth (pricing a tree by its nodes)."""
    llm = head_llm(target, "mtp", mtp_head, tree=TREE, adaptive=True)
    with_a_gpus_step_cost(llm, monkeypatch)
    outputs = llm.generate(prompt_token_ids=repetitive_prompts(), sampling_params=GREEDY)
    assert [o.token_ids for o in outputs] == naive_tokens
    assert sum(o.spec_stats["num_accepted_tokens"] for o in outputs) > 0


def test_a_tree_accepts_more_than_the_chain_of_its_depth(target, mtp_head) -> None:
    chain = head_llm(target, "mtp", mtp_head, num_speculative_tokens=3).generate(
        prompt_token_ids=repetitive_prompts(), sampling_params=GREEDY
    )
    tree = head_llm(target, "mtp", mtp_head, tree=[4, 2, 1]).generate(
        prompt_token_ids=repetitive_prompts(), sampling_params=GREEDY
    )
    assert mean_accepted(tree) > mean_accepted(chain)


def test_seeded_sampling_is_unchanged_by_tree_drafting(target, method_head) -> None:
    """Every emitted token is the target's own keyed sample at its position (tree_verify's rule)."""
    method, head = method_head
    params = SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=30, ignore_eos=True)
    prompts = repetitive_prompts(4)
    naive = LLM(target, device="cpu", max_model_len=192).generate(
        prompt_token_ids=prompts, sampling_params=params
    )
    llm = head_llm(target, method, head, tree=TREE)
    for _ in range(2):
        drafted = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in drafted] == [o.token_ids for o in naive]
    assert sum(o.spec_stats["num_accepted_tokens"] for o in drafted) > 0


def test_a_smaller_k_cuts_the_tree(target, naive_tokens, mtp_head) -> None:
    """A request's num_speculative_tokens is the depth it drafts: [3, 2, 1] cut at depth 1 is 3 drafts."""
    llm = head_llm(target, "mtp", mtp_head, tree=TREE)
    params = GREEDY.model_copy(update={"speculative": SpeculativeOverride(num_speculative_tokens=1)})
    outputs = llm.generate(prompt_token_ids=repetitive_prompts(), sampling_params=params)
    assert [o.token_ids for o in outputs] == naive_tokens
    drafts = sum(o.spec_stats["num_draft_tokens"] for o in outputs)
    steps = sum(o.spec_stats["num_verify_steps"] for o in outputs)
    assert 0 < drafts <= 3 * steps


def recorded_keys(graphs: DecodeGraphs) -> list[tuple[int, int]]:
    """The (bucket, query class) of every step `graphs` replays from now on."""
    keys: list[tuple[int, int]] = []
    replay = graphs.replay_forward

    def record(step: HostStep, key: tuple[int, int], *rest: Any) -> None:
        keys.append(key)
        replay(step, key, *rest)

    graphs.replay_forward = record  # type: ignore[method-assign]
    return keys


def tree_params(sampling: str) -> list[SamplingParams]:
    """Six requests of different lengths; some cut the tree at depth 1 or 2 (query classes 4, 10)."""
    params = []
    for i in range(6):
        fields: dict = {"temperature": 0.0, "max_tokens": 12 + 5 * i, "ignore_eos": True}
        if sampling == "seeded":
            fields |= {"temperature": 0.8, "top_k": 20, "seed": 5}
        if i % 3:
            fields["speculative"] = SpeculativeOverride(num_speculative_tokens=i % 3)
        params.append(SamplingParams(**fields))
    return params


@pytest.mark.parametrize(("sampling", "branch"), [("greedy", 0), ("seeded", 0), ("greedy", 5)])
def test_tree_steps_replay_the_eager_tokens(target, method_head, sampling: str, branch: int) -> None:
    """Tree steps go through the graphs' static buffers (tree masks and parent arrays among them,
    padded to buckets, one query class per depth the tree is cut at, its n-gram branch's drafts
    added where it has one) and the captured tail (tree verification, the accepted paths' KV
    compacted in the target's and the head's caches, the next trees drafted): the eager engine's
    tokens and acceptance."""
    method, head = method_head
    prompts = repetitive_prompts()
    extra = {"with_ngram": True, "tree_budget": 16 + branch} if branch else {}
    outputs, keys = [], []
    for graphs in (False, True):
        llm = head_llm(target, method, head, tree=TREE, **extra)
        fake = with_eager_graphs(llm, max_tokens=48) if graphs else None
        llm.engine.drafter.max_graph_tokens = 48  # drafts trimmed alike with and without graphs
        keys = recorded_keys(fake) if fake is not None else []
        generated = llm.generate(prompt_token_ids=prompts, sampling_params=tree_params(sampling))
        outputs.append([(o.token_ids, o.spec_stats["num_accepted_tokens"]) for o in generated])
        if fake is not None:
            assert fake.query_lens == sorted({1, 4, 4 + branch, 10 + branch, 16 + branch})  # 4: chains
            assert fake.chain_lengths == [0, 3]  # depths 1 and 2 replay the tail of depth 3
            assert fake.num_tail_replays > 10
    assert outputs[1] == outputs[0]
    assert sum(accepted for _, accepted in outputs[1]) > 0
    query_classes = {query_class for _, query_class in keys}
    # with the branch, the 48-token graphs trim a whole 21-token tree beside other requests' (fit_draft_budget)
    assert ({4 + branch, 10 + branch} if branch else {4, 10, 16}) <= query_classes


def test_tree_steps_beside_prefill_chunks_and_logprobs_replay_the_eager_tokens(target, mtp_head) -> None:
    """Three requests run at a time out of six, so prefill chunks share steps with trees (the
    prefill class, every token's mask causal but the trees'); a request with logprobs sends its
    steps' tails to the torch verifier after the forward's replay."""
    prompts = repetitive_prompts()
    params = [
        p.model_copy(update={"logprobs": 2 if i == 1 else None}) for i, p in enumerate(tree_params("greedy"))
    ]
    outputs = []
    for graphs in (False, True):
        llm = LLM(
            target,
            device="cpu",
            max_model_len=192,
            speculative_config={"method": "mtp", "model": mtp_head, "adaptive": False, "tree": TREE},
            max_num_seqs=3,
            max_num_batched_tokens=48,
        )
        fake = with_eager_graphs(llm, max_tokens=48, prefill_len=48) if graphs else None
        llm.engine.drafter.max_graph_tokens = 40
        generated = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        outputs.append([(o.token_ids, o.spec_stats["num_accepted_tokens"]) for o in generated])
        if fake is not None:
            assert fake.num_mixed_replays > 3
            assert fake.num_replays > fake.num_tail_replays > 3  # some tails ran eagerly (logprobs)
    assert outputs[1] == outputs[0]
    assert sum(accepted for _, accepted in outputs[1]) > 0


def test_tree_graphs_refuse_a_step_without_tree_inputs(target, mtp_head) -> None:
    llm = head_llm(target, "mtp", mtp_head, tree=TREE)
    graphs = with_eager_graphs(llm, max_tokens=16)
    llm.engine.runner.tree = None  # the runner stops building tree inputs
    with pytest.raises(ValueError, match="tree inputs"):
        llm.generate(prompt_token_ids=repetitive_prompts(1), sampling_params=GREEDY)
    assert graphs.num_replays == 0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"method": "ngram", "tree": [2]}, "mtp or eagle3"),
        ({"method": "mtp", "model": "m", "tree": [2, 2], "num_speculative_tokens": 3}, "depth"),
        ({"method": "mtp", "model": "m", "tree": [2, 2], "verify_strategy": "topp"}, "losslessly"),
        ({"method": "mtp", "model": "m", "tree": [2, 2], "verify_strategy": "greedy"}, "losslessly"),
        ({"method": "mtp", "model": "m", "tree": []}, "at least one depth"),
        ({"method": "mtp", "model": "m", "tree": [2, 0], "adaptive": False}, ">= 1"),
        ({"method": "eagle3", "model": "m", "tree": [8, 4, 2], "adaptive": False}, "at most 64"),
        ({"method": "mtp", "model": "m", "with_ngram": True}, "set 'tree'"),
        ({"method": "mtp", "model": "m", "tree": [2, 2], "mtp_strategy": "with_ngram"}, "use with_ngram"),
        ({"method": "mtp", "model": "m", "tree": [3, 2, 1], "tree_budget": 20}, "set with_ngram"),
        (
            {"method": "eagle3", "model": "m", "tree": [3, 2, 1], "with_ngram": True, "tree_budget": 16},
            "leaving",
        ),
        (
            {"method": "eagle3", "model": "m", "tree": [2], "with_ngram": True, "tree_budget": 65},
            "less than or equal",
        ),
    ],
)
def test_bad_tree_configs_are_refused(spec: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.model_validate(spec)


def test_tree_budget_is_its_node_count() -> None:
    config = SpeculativeConfig.model_validate(
        {"method": "mtp", "model": "m", "tree": TREE, "adaptive": False}
    )
    assert config.k == 3 and config.max_num_drafts == 3 + 6 + 6


def test_a_tree_with_an_ngram_branch_shares_its_budget() -> None:
    """The branch gets what the head's tree leaves of tree_budget (default: 5 drafts)."""
    spec = {"method": "eagle3", "model": "m", "tree": [2, 2, 1], "with_ngram": True}
    config = SpeculativeConfig.model_validate({**spec, "tree_budget": 16})
    assert config.k == 3 and config.ngram_branch_drafts == 16 - 1 - (2 + 4 + 4) == 5
    assert config.max_num_drafts == 15
    default = SpeculativeConfig.model_validate(spec)
    assert default.tree_budget == 1 + 10 + 5 and default.ngram_branch_drafts == 5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("with_ngram", [False, True], ids=["tree", "tree-with-ngram"])
def test_tree_drafting_on_cuda_keeps_greedy_output(target, method_head, with_ngram: bool) -> None:
    """The CUDA kernels' tree attention (target and head), fused verify and compaction, eagerly:
    naive's greedy tokens on the same device, with drafts accepted (with an n-gram branch too)."""
    method, head = method_head
    spec = {"method": method, "model": head, "adaptive": False, "tree": TREE, "with_ngram": with_ngram}
    naive = LLM(target, device="cuda", dtype="float32", max_model_len=192).generate(
        prompt_token_ids=repetitive_prompts(), sampling_params=GREEDY
    )
    llm = LLM(target, device="cuda", dtype="float32", max_model_len=192, speculative_config=spec)
    outputs = llm.generate(prompt_token_ids=repetitive_prompts(), sampling_params=GREEDY)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in naive]
    assert sum(o.spec_stats["num_accepted_tokens"] for o in outputs) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("sampling", ["greedy", "seeded", "logprobs", "with-ngram"])
def test_tree_graph_replay_gives_the_eager_tokens(target, method_head, sampling: str) -> None:
    """Tree steps replayed from CUDA graphs (the forward with tree masks, the tail with tree
    verification, KV compaction and the next trees' drafting, captured without a host sync) emit
    the eager tree path's tokens, with steps across buckets and every query class of the tree;
    a request with logprobs sends its steps' tails to the torch verifier after the forward's replay;
    an n-gram branch (5 drafts) adds its drafts to every query class."""
    method, head = method_head
    branch = 5 if sampling == "with-ngram" else 0
    spec = {"method": method, "model": head, "adaptive": False, "tree": TREE}
    if branch:
        spec |= {"with_ngram": True, "tree_budget": 16 + branch}
    params = tree_params("seeded" if sampling == "seeded" else "greedy")
    if sampling == "logprobs":
        params[1] = params[1].model_copy(update={"logprobs": 2})
    outputs = {}
    for eager in (True, False):
        llm = LLM(
            target,
            device="cuda",
            dtype="float32",
            max_model_len=192,
            speculative_config=spec,
            enforce_eager=eager,
            cuda_graph_max_tokens=128,
            max_num_seqs=8,
        )
        generated = llm.generate(prompt_token_ids=repetitive_prompts(), sampling_params=params)
        outputs[eager] = [o.token_ids for o in generated]
        graphs = llm.engine.runner.graphs
        if eager:
            assert graphs is None
            continue
        assert graphs is not None and graphs.trees
        assert graphs.query_lens == sorted({1, 4, 4 + branch, 10 + branch, 16 + branch, 128})  # 4: chains
        assert graphs.num_replays > 10
        if sampling == "logprobs":
            assert graphs.num_replays > graphs.num_tail_replays
        else:
            assert graphs.num_tail_replays == graphs.num_replays
        assert sum(o.spec_stats["num_accepted_tokens"] for o in generated) > 0
    assert outputs[False] == outputs[True]
