"""Token-level stops decided by the post-step update, on the path the engine takes.

Drafts are planted and accepted whatever they are (accept policy `accept_all`), so a step emits
tokens past an EOS, a stop id or max_tokens, and the post-step update must cut them there. (The
tail graph's own step is checked against this path in test_cuda_graph.py.)
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.post_step_ref import LENGTH
from services.engine.llm import LLM
from shared.sampling_params import SamplingParams

A, B, C, D = 11, 12, 13, 14
"""Ordinary tokens to plant as drafts."""


@pytest.fixture(scope="module")
def target(make_checkpoint) -> str:
    return str(make_checkpoint("llama", num_hidden_layers=2))


@pytest.fixture(scope="module")
def llm(target: str) -> LLM:
    return LLM(
        target,
        device="cpu",
        max_model_len=128,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 5,
            "accept_policy": "accept_all",
            "adaptive": False,
        },
        async_scheduling=False,  # drafts are planted on the host, which a step launched ahead does not read
    )


def generate_with_drafts(llm: LLM, params: SamplingParams, drafts: list[int]) -> list:
    """Runs one request whose first decode step verifies `drafts` (all accepted: the step emits
    them and a bonus token) and that verifies no drafts after; returns its outputs step by step."""
    engine = llm.engine
    planned = [list(drafts)]
    engine.add_request("planted", prompt_token_ids=[5, 6, 7, 8, 9, 10], params=params)
    outputs = []
    while engine.has_unfinished_requests():
        seq = engine.sequences["planted"]
        if seq.is_decoding:  # in place of the proposer's drafts
            seq.spec.draft_token_ids = planned.pop() if planned else []
        outputs += engine.step()
    assert not planned, "the planted drafts were never verified"
    return outputs


def greedy(**fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, **({"max_tokens": 20} | fields))


def eos_of(llm: LLM) -> int:
    return min(llm.engine.eos_token_ids)


def test_eos_inside_accepted_drafts_drops_the_tokens_after_it(llm: LLM) -> None:
    eos = eos_of(llm)
    prefill, step = generate_with_drafts(llm, greedy(), [A, eos, B, C])
    assert prefill.new_token_ids != [eos]
    assert step.new_token_ids == [A, eos]  # B, C and the bonus token are dropped
    assert step.token_ids == prefill.token_ids + [A, eos]
    assert (step.finished, step.finish_reason, step.stop_reason) == (True, "stop", None)
    assert step.spec_stats["num_accepted_tokens"] == 4  # what verification accepted, stop or not


def test_stop_id_inside_accepted_drafts_ends_there(llm: LLM) -> None:
    _, step = generate_with_drafts(llm, greedy(stop_token_ids=[C, B]), [A, B, C, D])
    assert step.new_token_ids == [A, B]
    assert (step.finish_reason, step.stop_reason) == ("stop", B)


def test_max_tokens_cuts_a_step_mid_draft(llm: LLM) -> None:
    prefill, step = generate_with_drafts(llm, greedy(max_tokens=3), [A, B, C, D])
    assert step.new_token_ids == [A, B]
    assert step.token_ids == prefill.token_ids + [A, B]
    assert step.finish_reason == "length"


def test_eos_before_min_tokens_is_kept_and_does_not_stop(llm: LLM) -> None:
    eos = eos_of(llm)
    _, step = generate_with_drafts(llm, greedy(min_tokens=3), [eos, A, eos, B])
    assert step.new_token_ids == [eos, A, eos]  # output tokens 2, 3 and 4: only the second EOS counts
    assert step.finish_reason == "stop"


def test_ignore_eos_keeps_every_accepted_draft(llm: LLM) -> None:
    eos = eos_of(llm)
    outputs = generate_with_drafts(llm, greedy(ignore_eos=True, max_tokens=12), [A, eos, B])
    assert outputs[1].new_token_ids[:3] == [A, eos, B] and len(outputs[1].new_token_ids) == 4
    assert len(outputs[-1].token_ids) == 12 and outputs[-1].finish_reason == "length"


def test_stop_string_still_ends_before_the_post_step_stop(llm: LLM) -> None:
    """Stop strings stay on the host: one inside the kept tokens ends the request earlier."""
    eos = eos_of(llm)
    stop = llm.tokenizer.decode([B])
    assert stop
    _, step = generate_with_drafts(llm, greedy(stop=[stop]), [A, B, eos, C])
    assert step.token_ids[-2:] == [A, B] and step.finish_reason == "stop"
    assert step.stop_reason == stop


def test_the_engine_takes_the_post_step_verdict(llm: LLM, monkeypatch) -> None:
    """The host does not recompute token-level stops: a verdict of LENGTH after one kept token
    ends the request there, whatever the tokens and max_tokens say."""
    real = kernels.post_step_update_slots

    def one_token_then_length(*args):
        num_kept, finish, stop_token, num_output = real(*args)
        drafted = args[5] > 0  # num_accepted: the step with the planted drafts
        return torch.where(drafted, 1, num_kept), torch.where(drafted, LENGTH, finish), stop_token, num_output

    monkeypatch.setattr(kernels, "post_step_update_slots", one_token_then_length)
    _, step = generate_with_drafts(llm, greedy(max_tokens=50, ignore_eos=True), [A, B])
    assert step.new_token_ids == [A] and step.finish_reason == "length"
