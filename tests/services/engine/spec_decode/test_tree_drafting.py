"""Tree drafting end to end on the CPU (`speculative_config.tree`, MTP and EAGLE-3 heads): greedy
output is the target's, seeded sampling is unchanged by it, trees accept more than chains of the
same depth, bad configs are refused."""

from __future__ import annotations

import pytest
import torch

from services.engine.llm import LLM
from shared.sampling_params import SamplingParams
from shared.speculative_config import SpeculativeConfig, SpeculativeOverride
from tests.services.engine.spec_decode.helpers import GREEDY, repetitive_prompts

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


def test_adaptive_tree_drafting_keeps_greedy_output(target, naive_tokens, mtp_head) -> None:
    """Adaptive speculation picks each request's depth (pricing a tree by its nodes)."""
    llm = head_llm(target, "mtp", mtp_head, tree=TREE, adaptive=True)
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tree_drafting_on_cuda_keeps_greedy_output(target, method_head) -> None:
    """The CUDA kernels' tree attention (target and head), fused verify and compaction, eagerly:
    naive's greedy tokens on the same device, with drafts accepted."""
    method, head = method_head
    spec = {"method": method, "model": head, "adaptive": False, "tree": TREE}
    naive = LLM(target, device="cuda", dtype="float32", max_model_len=192).generate(
        prompt_token_ids=repetitive_prompts(), sampling_params=GREEDY
    )
    llm = LLM(target, device="cuda", dtype="float32", max_model_len=192, speculative_config=spec)
    outputs = llm.generate(prompt_token_ids=repetitive_prompts(), sampling_params=GREEDY)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in naive]
    assert sum(o.spec_stats["num_accepted_tokens"] for o in outputs) > 0
