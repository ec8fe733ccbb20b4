"""The speculative loop end to end: lossless methods never change greedy output, policies bound
acceptance, stops / penalties / logprobs behave as in plain decoding."""

from __future__ import annotations

import pytest
import torch

from services.engine.engine import RequestError
from services.engine.llm import LLM
from shared.sampling_params import SamplingParams
from shared.speculative_config import SpeculativeOverride
from tests.services.engine.spec_decode.helpers import GREEDY, repetitive_prompts


def spec_llm(target: str, **spec) -> LLM:
    """Adaptive k is off unless asked for: on a loaded machine the timing-based controller may
    rightly stop drafting, and these tests need drafts to go through verification."""
    spec.setdefault("adaptive", False)
    return LLM(target, device="cpu", max_model_len=192, speculative_config=spec)


METHODS = {
    "ngram": dict(method="ngram", num_speculative_tokens=4, prompt_lookup_max=3),
    "suffix": dict(method="suffix", num_speculative_tokens=6),
}


@pytest.mark.parametrize("strategy", ["rejection", "greedy", "target_match"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_model_free_methods_keep_greedy_output(target, naive_tokens, method: str, strategy: str) -> None:
    llm = spec_llm(target, verify_strategy=strategy, **METHODS[method])
    outputs = llm.generate(prompt_token_ids=repetitive_prompts(), sampling_params=GREEDY)
    assert [o.token_ids for o in outputs] == naive_tokens
    assert sum(o.spec_stats["num_accepted_tokens"] for o in outputs) > 0


def test_draft_model_keeps_greedy_output_and_accepts_itself(target, naive_tokens) -> None:
    """With the target as its own draft model every greedy draft must pass: a check that the
    draft cache stays aligned with the target's through acceptance and rollback."""
    llm = spec_llm(target, method="draft_model", model=target, num_speculative_tokens=3)
    outputs = llm.generate(prompt_token_ids=repetitive_prompts(), sampling_params=GREEDY)
    assert [o.token_ids for o in outputs] == naive_tokens
    for o in outputs:
        assert o.spec_stats["acceptance_per_position"] == [1.0, 1.0, 1.0]


def test_small_draft_model_keeps_greedy_output(make_checkpoint, target, naive_tokens) -> None:
    draft = str(
        make_checkpoint(
            "llama",
            seed=3,
            num_hidden_layers=1,
            hidden_size=48,
            num_attention_heads=3,
            num_key_value_heads=1,
            intermediate_size=64,
        )
    )
    llm = spec_llm(target, method="draft_model", model=draft, num_speculative_tokens=2)
    outputs = llm.generate(prompt_token_ids=repetitive_prompts(), sampling_params=GREEDY)
    assert [o.token_ids for o in outputs] == naive_tokens


def test_preemption_under_speculation_keeps_greedy_output(target, naive_tokens) -> None:
    llm = LLM(
        target,
        device="cpu",
        max_model_len=96,
        num_kv_blocks=14,
        block_size=8,
        speculative_config=dict(method="ngram", num_speculative_tokens=5),
    )
    outputs = llm.generate(prompt_token_ids=repetitive_prompts(), sampling_params=GREEDY)
    assert [o.token_ids for o in outputs] == naive_tokens
    assert llm.engine.scheduler.num_preemptions > 0


def test_mixed_methods_in_one_batch(target, naive_tokens) -> None:
    llm = spec_llm(target, method="ngram", num_speculative_tokens=5)
    overrides = [
        SpeculativeOverride(method="suffix"),
        SpeculativeOverride(enabled=False),
        None,
        SpeculativeOverride(num_speculative_tokens=2),
        SpeculativeOverride(method="naive"),
        SpeculativeOverride(method="suffix", num_speculative_tokens=3),
    ]
    params = [GREEDY.model_copy(update={"speculative": o}) for o in overrides]
    outputs = llm.generate(prompt_token_ids=repetitive_prompts(), sampling_params=params)
    assert [o.token_ids for o in outputs] == naive_tokens
    assert [o.spec_stats["method"] for o in outputs] == [
        "suffix",
        "naive",
        "ngram",
        "ngram",
        "naive",
        "suffix",
    ]
    assert outputs[1].spec_stats["num_draft_tokens"] == 0


def test_accept_all_accepts_every_draft_and_reject_all_emits_one_token_per_step(target) -> None:
    prompts = repetitive_prompts(3)
    accept_all = spec_llm(target, method="ngram", num_speculative_tokens=4, accept_policy="accept_all")
    for o in accept_all.generate(prompt_token_ids=prompts, sampling_params=GREEDY):
        stats = o.spec_stats
        assert stats["num_draft_tokens"] > 0
        assert stats["num_accepted_tokens"] == stats["num_draft_tokens"]
    reject_all = spec_llm(target, method="ngram", num_speculative_tokens=4, accept_policy="reject_all")
    engine = reject_all.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt_token_ids=prompt, params=GREEDY)
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert len(out.new_token_ids) == 1
            assert out.spec_stats["num_accepted_tokens"] == 0


def test_stop_token_inside_accepted_drafts_ends_at_that_token(target, naive_tokens) -> None:
    prompts = repetitive_prompts()
    llm = spec_llm(target, method="draft_model", model=target, num_speculative_tokens=4)
    for prompt, expected in zip(prompts, naive_tokens):
        stop_id = expected[9]
        first = expected.index(stop_id)
        params = GREEDY.model_copy(update={"stop_token_ids": [stop_id]})
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
        assert out.token_ids == expected[: first + 1]
        assert out.finish_reason == "stop"
    short = llm.generate(
        prompt_token_ids=prompts, sampling_params=GREEDY.model_copy(update={"max_tokens": 7})
    )
    assert [o.token_ids for o in short] == [t[:7] for t in naive_tokens]


def test_penalties_min_tokens_and_logprobs_equal_naive(target) -> None:
    params = SamplingParams(
        temperature=0.0,
        max_tokens=30,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.2,
        min_tokens=10,
        stop_token_ids=[7],
        logprobs=3,
    )
    prompts = repetitive_prompts(4, seed=5)
    naive = LLM(target, device="cpu", max_model_len=192).generate(
        prompt_token_ids=prompts, sampling_params=params
    )
    spec = spec_llm(target, method="draft_model", model=target, num_speculative_tokens=3)
    drafted = spec.generate(prompt_token_ids=prompts, sampling_params=params)
    for a, b in zip(naive, drafted):
        assert a.token_ids == b.token_ids
        assert b.spec_stats["num_accepted_tokens"] > 0
        assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token_id == y.token_id
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert list(x.top) == list(y.top)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_seeded_sampling_is_identical_with_and_without_model_free_speculation(target, method: str) -> None:
    """Randomness is keyed by (seed, output position) and a model-free draft is accepted exactly
    when it equals the target's own sample, so speculation cannot change a seeded output."""
    params = SamplingParams(temperature=0.7, top_k=20, seed=7, max_tokens=30, ignore_eos=True)
    prompts = repetitive_prompts(4)
    naive = LLM(target, device="cpu", max_model_len=192).generate(
        prompt_token_ids=prompts, sampling_params=params
    )
    llm = spec_llm(target, **METHODS[method])
    for _ in range(2):  # the second round drafts from the first round's outputs (suffix: global tree)
        drafted = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in drafted] == [o.token_ids for o in naive]
    if method == "suffix":
        stats = [o.spec_stats for o in drafted]
        assert (
            sum(s["num_accepted_tokens"] for s in stats) > 0.8 * sum(s["num_draft_tokens"] for s in stats) > 0
        )


def test_request_overrides_beyond_server_limits_are_refused(target) -> None:
    llm = spec_llm(target, method="ngram", num_speculative_tokens=3)
    with pytest.raises(RequestError, match="limit of 3"):
        llm.generate(
            prompt_token_ids=[[5, 6]],
            sampling_params=GREEDY.model_copy(
                update={"speculative": SpeculativeOverride(num_speculative_tokens=9)}
            ),
        )
    with pytest.raises(RequestError, match="not loaded"):
        llm.generate(
            prompt_token_ids=[[5, 6]],
            sampling_params=GREEDY.model_copy(update={"speculative": SpeculativeOverride(method="mtp")}),
        )
    locked = spec_llm(target, method="ngram", num_speculative_tokens=3, allow_request_override=False)
    with pytest.raises(RequestError, match="does not allow"):
        locked.generate(
            prompt_token_ids=[[5, 6]],
            sampling_params=GREEDY.model_copy(update={"speculative": SpeculativeOverride(enabled=False)}),
        )


def test_bad_speculative_configs_say_what_to_change(target) -> None:
    with pytest.raises(ValueError, match="needs 'model'"):
        spec_llm(target, method="draft_model")
    with pytest.raises(ValueError, match="at most 5"):
        spec_llm(target, method="draft_model", model=target, num_speculative_tokens=8)


@pytest.fixture(scope="module")
def mtp_head(target, tmp_path_factory) -> str:
    """An MTP head trained for a few seconds on the target's own greedy continuations."""
    from training.train_mtp import TrainMTPConfig, train_mtp

    llm = LLM(target, device="cpu", max_model_len=192)
    outputs = llm.generate(prompt_token_ids=repetitive_prompts(8, seed=9), sampling_params=GREEDY)
    corpus = torch.tensor([t for o in outputs for t in o.prompt_token_ids + o.token_ids] * 4)
    out = tmp_path_factory.mktemp("mtp")
    torch.save(corpus, out / "corpus.pt")
    train_mtp(
        TrainMTPConfig(
            base=target,
            out=out / "head",
            data_tokens=out / "corpus.pt",
            steps=150,
            batch_size=8,
            seq_len=32,
            lr=1e-2,
            warmup_steps=10,
            eval_every=1000,
            device="cpu",
            progress=False,
        )
    )
    return str(out / "head")


@pytest.mark.parametrize("strategy", ["default", "with_ngram"])
def test_mtp_keeps_greedy_output(target, naive_tokens, mtp_head, strategy: str) -> None:
    llm = spec_llm(
        target,
        method="mtp",
        model=mtp_head,
        num_speculative_tokens=3,
        mtp_strategy=strategy,
        num_model_steps=2 if strategy == "with_ngram" else None,
    )
    outputs = llm.generate(prompt_token_ids=repetitive_prompts(), sampling_params=GREEDY)
    assert [o.token_ids for o in outputs] == naive_tokens
    assert all(o.spec_stats["num_draft_tokens"] > 0 for o in outputs)


def test_mtp_cache_follows_the_accepted_tokens(target, mtp_head) -> None:
    """After every step (accepting, rejecting, rolling back), the head's state for a request equals
    a from-scratch dense pass of the head over the request's verified tokens."""
    llm = spec_llm(target, method="mtp", model=mtp_head, num_speculative_tokens=3, num_model_steps=3)
    engine = llm.engine
    head, proposer = engine.runner.mtp_head, engine.drafter.mtp
    engine.add_request("r", prompt_token_ids=repetitive_prompts(1, seed=4)[0], params=GREEDY)
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        seq = engine.sequences.get("r")
        if seq is None:
            break
        tokens = torch.tensor([seq.token_ids])
        n = seq.num_computed_tokens
        with torch.inference_mode():
            target_hidden = engine.runner.model.forward_dense(tokens[:, :n])
            expected = head.forward_dense(tokens[:, 1 : n + 1], target_hidden)[0, -1]
        torch.testing.assert_close(proposer.last_hidden["r"], expected, rtol=1e-4, atol=1e-3)
        checked += 1
    assert checked > 5


def test_mtp_under_preemption_and_sampling(target, mtp_head) -> None:
    llm = LLM(
        target,
        device="cpu",
        max_model_len=96,
        num_kv_blocks=14,
        block_size=8,
        speculative_config=dict(method="mtp", model=mtp_head, num_speculative_tokens=2),
    )
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=40, ignore_eos=True)
    first = llm.generate(prompt_token_ids=repetitive_prompts(), sampling_params=params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert all(len(o.token_ids) == 40 for o in first)


def test_verification_scores_only_the_last_token_and_drafts(target) -> None:
    """One forward over 1 + k tokens per request; only those k + 1 rows reach the LM head."""
    llm = spec_llm(target, method="ngram", num_speculative_tokens=4)
    engine = llm.engine
    for i, prompt in enumerate(repetitive_prompts(3)):
        engine.add_request(f"r{i}", prompt_token_ids=prompt, params=GREEDY)
    drafts: dict[str, int] = {}
    for _ in range(20):  # until the outputs repeat themselves and n-gram drafts appear
        engine.step()
        drafts = {seq.request_id: len(seq.spec.draft_token_ids) for seq in engine.scheduler.running}
        if sum(drafts.values()) > 0:
            break
    assert sum(drafts.values()) > 0
    batch = engine.scheduler.schedule()
    inputs = engine.runner.prepare_inputs(batch)
    assert batch.num_new_tokens == [1 + drafts[s.request_id] for s in batch.seqs]
    assert len(inputs.host.logits_indices) == sum(1 + drafts[s.request_id] for s in batch.seqs)
    assert inputs.host.num_tokens == len(inputs.host.logits_indices)
    assert inputs.host.is_decode


def test_split_prefill_decode_with_mtp_keeps_greedy_output(target, naive_tokens, mtp_head) -> None:
    """The prefill instance hands over the MTP head's KV and last hidden state with the target's."""
    from services.engine.engine import LLMEngine
    from shared.config import EngineConfig

    spec = dict(method="mtp", model=mtp_head, num_speculative_tokens=2)
    prefill = LLMEngine(EngineConfig(model=target, device="cpu", max_model_len=192, speculative_config=spec))
    decode = LLMEngine(EngineConfig(model=target, device="cpu", max_model_len=192, speculative_config=spec))
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(repetitive_prompts()):
        decode.reserve(f"r{i}", prompt, GREEDY)
        prefill.add_request(f"r{i}", prompt_token_ids=prompt, params=GREEDY, handoff=True)
    while prefill.has_unfinished_requests():
        prefill.step()
        for export in prefill.handoffs:
            assert "mtp_hidden" in export.tensors
            assert {cache for cache, *_ in export.layers} == {"target", "mtp"}
            for cache, index, key, value in export.layers:
                decode.import_kv(export.request_id, cache, index, key, value)
            decode.activate(export.request_id, export.first_token_id, export.tensors["mtp_hidden"])
            tokens[export.request_id] = [export.first_token_id]
        prefill.handoffs.clear()
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens[out.request_id] += out.new_token_ids
    assert [tokens[f"r{i}"] for i in range(len(naive_tokens))] == naive_tokens
