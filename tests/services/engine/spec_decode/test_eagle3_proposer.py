"""`eagle3` end to end on the CPU: greedy output is the target's, seeded sampling is unchanged by
it, the head's chained drafts are those of its training-time unroll, bad configs are refused."""

from __future__ import annotations

import pytest
import torch

from services.engine.llm import LLM
from shared.model.config import ModelConfigError
from shared.sampling_params import SamplingParams
from tests.services.engine.spec_decode.helpers import GREEDY, repetitive_prompts
from training.train_eagle3 import unrolled_logits


def eagle3_llm(target: str, head: str, **spec) -> LLM:
    spec = {"method": "eagle3", "model": head, "adaptive": False, **spec}
    return LLM(target, device="cpu", max_model_len=192, speculative_config=spec)


@pytest.mark.parametrize("logprobs", [None, 2], ids=["fused-tail", "torch-verifier"])
@pytest.mark.parametrize("k", [1, 3])
def test_eagle3_keeps_greedy_output(target, naive_tokens, eagle3_head, k: int, logprobs: int | None) -> None:
    """Both tails: the fused verify kernel's, and the torch verifier's that logprobs take."""
    params = GREEDY.model_copy(update={"logprobs": logprobs})
    outputs = eagle3_llm(target, eagle3_head, num_speculative_tokens=k).generate(
        prompt_token_ids=repetitive_prompts(), sampling_params=params
    )
    assert [o.token_ids for o in outputs] == naive_tokens
    assert all(o.spec_stats["num_draft_tokens"] > 0 for o in outputs)
    assert sum(o.spec_stats["num_accepted_tokens"] for o in outputs) > 0


def test_seeded_sampling_is_unchanged_by_eagle3(target, eagle3_head) -> None:
    """The head samples its drafts with the target's noise (over its draft vocabulary, -inf
    elsewhere) and a draft is kept only where it is the target's own sample."""
    params = SamplingParams(temperature=0.7, top_k=20, seed=7, max_tokens=30, ignore_eos=True)
    prompts = repetitive_prompts(4)
    naive = LLM(target, device="cpu", max_model_len=192).generate(
        prompt_token_ids=prompts, sampling_params=params
    )
    llm = eagle3_llm(target, eagle3_head, num_speculative_tokens=3, adaptive=True)
    for _ in range(2):
        drafted = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in drafted] == [o.token_ids for o in naive]
    assert sum(o.spec_stats["num_draft_tokens"] for o in drafted) > 0


def test_eagle3_drafts_are_the_training_unroll(target, eagle3_head) -> None:
    """After every step (accepting, rejecting, rolling back), the drafts the head chained from its
    KV cache equal its training-time unroll over the request's tokens followed by those drafts:
    serving and training compute one function."""
    llm = eagle3_llm(target, eagle3_head, num_speculative_tokens=3)
    engine = llm.engine
    head, model = engine.runner.eagle3_head, engine.runner.model
    assert head is not None
    engine.add_request("r", prompt_token_ids=repetitive_prompts(1, seed=4)[0], params=GREEDY)
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        seq = engine.sequences.get("r")
        if seq is None or not seq.spec.draft_token_ids:
            continue
        drafts = seq.spec.draft_token_ids
        tokens = torch.tensor([seq.token_ids + drafts])
        with torch.inference_mode():
            _, aux = model.forward_dense_with_aux(tokens, head.aux_layers)
            logits = unrolled_logits(head, tokens, aux, len(drafts))
        start = len(seq.token_ids) - 2  # the row pairing the last verified position with the newest token
        expected = [int(head.target_ids[step[0, start].argmax()]) for step in logits]
        assert drafts == expected
        checked += 1
    assert checked > 5


def test_the_target_keeps_the_heads_streams_in_the_same_pass(target, eagle3_head) -> None:
    """forward_with_aux gives forward's hidden states bit for bit, and the streams the dense
    (training) pass sees."""
    llm = eagle3_llm(target, eagle3_head)
    runner = llm.engine.runner
    assert runner.aux_layers == runner.eagle3_head.aux_layers
    tokens = torch.tensor(repetitive_prompts(1, seed=2)[0])
    ids, positions, meta = runner._one_sequence(len(tokens), len(tokens))
    with torch.inference_mode():
        plain = runner.model(tokens, positions, runner.kv_caches, meta)
        hidden, aux = runner.model.forward_with_aux(tokens, positions, runner.kv_caches, meta, (1, 0, 1))
        dense, dense_aux = runner.model.forward_dense_with_aux(tokens[None], (1, 0, 1))
    assert torch.equal(hidden, plain)
    assert aux.shape == (len(tokens), 3 * runner.model_config.hidden_size)
    torch.testing.assert_close(aux, dense_aux[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(hidden, dense[0], atol=1e-4, rtol=1e-4)


def test_bad_eagle3_configs_say_what_to_change(target, eagle3_head, mtp_head) -> None:
    with pytest.raises(ValueError, match="needs 'model'.*EAGLE-3 head"):
        LLM(target, device="cpu", speculative_config={"method": "eagle3"})
    with pytest.raises(ValueError, match="at most 5"):
        eagle3_llm(target, eagle3_head, num_speculative_tokens=6)
    with pytest.raises(ValueError, match="eagle3_layers applies to method 'eagle3' only"):
        LLM(target, device="cpu", speculative_config={"method": "ngram", "eagle3_layers": [0, 1, 1]})
    with pytest.raises(ValueError, match="eagle3_layers"):
        eagle3_llm(target, eagle3_head, eagle3_layers=[0, -1, 1])
    with pytest.raises(ModelConfigError, match=r"layers 0\.\.1, not \[2\]"):
        eagle3_llm(target, eagle3_head, eagle3_layers=[0, 1, 2])
    with pytest.raises(ModelConfigError, match="not an EAGLE-3 head"):
        eagle3_llm(target, mtp_head)
