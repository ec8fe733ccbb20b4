"""The speculative loop end to end: lossless methods never change greedy output, policies bound
acceptance, stops / penalties / logprobs behave as in plain decoding."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from services.engine.engine import RequestError
from services.engine.llm import LLM
from shared.sampling_params import SamplingParams
from shared.speculative_config import SpeculativeOverride
from tests.services.engine.spec_decode.helpers import GREEDY, SMALL_DRAFT_MODEL, repetitive_prompts


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
    draft = str(make_checkpoint("llama", **SMALL_DRAFT_MODEL))
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
            if out.finished:  # statistics come with a request's last output
                assert out.spec_stats["num_draft_tokens"] > 0 and out.spec_stats["num_accepted_tokens"] == 0


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


@pytest.mark.parametrize("method", [*sorted(METHODS), "mtp", "draft_model"])
def test_seeded_sampling_is_identical_with_and_without_speculation(target, mtp_head, method: str) -> None:
    """Randomness is keyed by (seed, output position), drafting models sample their drafts with the
    target's noise, and a draft is accepted exactly when it equals the target's own sample: so
    speculation, whatever the method, cannot change a seeded output."""
    params = SamplingParams(temperature=0.7, top_k=20, seed=7, max_tokens=30, ignore_eos=True)
    prompts = repetitive_prompts(4)
    naive = LLM(target, device="cpu", max_model_len=192).generate(
        prompt_token_ids=prompts, sampling_params=params
    )
    models = {
        "mtp": dict(method="mtp", model=mtp_head, num_speculative_tokens=3, mtp_strategy="with_ngram"),
        "draft_model": dict(method="draft_model", model=target, num_speculative_tokens=3),
    }
    llm = spec_llm(target, adaptive=True, **{**METHODS, **models}[method])
    for _ in range(2):  # the second round drafts from the first round's outputs (suffix: global tree)
        drafted = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in drafted] == [o.token_ids for o in naive]
    stats = [o.spec_stats for o in drafted]
    if method in ("suffix", "draft_model"):  # the global tree, and the target as its own draft model
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


def test_mtp_drafts_follow_the_accepted_tokens(target, mtp_head) -> None:
    """After every step (accepting, rejecting, rolling back), the drafts the head chained from its
    KV cache equal a from-scratch dense pass of the head over the request's verified tokens,
    extended draft by draft with its own output."""
    llm = spec_llm(target, method="mtp", model=mtp_head, num_speculative_tokens=3, num_model_steps=3)
    engine = llm.engine
    head = engine.runner.mtp_head
    engine.add_request("r", prompt_token_ids=repetitive_prompts(1, seed=4)[0], params=GREEDY)
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        seq = engine.sequences.get("r")
        if seq is None:
            break
        tokens = seq.token_ids
        with torch.inference_mode():
            hidden = engine.runner.model.forward_dense(torch.tensor([tokens[:-1]]))  # h_0 .. h_{n-2}
            ids = tokens[1:]  # t_{i+1} beside each h_i
            expected = []
            for _ in range(len(seq.spec.draft_token_ids)):
                out = head.forward_dense(torch.tensor([ids]), hidden)[:, -1:]
                expected.append(int(head.logits(out[0, -1]).argmax()))
                ids, hidden = ids + [expected[-1]], torch.cat([hidden, out], dim=1)
        assert seq.spec.draft_token_ids == expected
        checked += bool(expected)
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
    plan = engine.drafter.plan(batch, num_running=len(batch.seqs))
    step = engine.runner.prepare(batch, plan)
    assert batch.num_new_tokens == [1 + drafts[s.request_id] for s in batch.seqs]
    assert len(step.logits_indices) == sum(1 + drafts[s.request_id] for s in batch.seqs)
    assert step.num_tokens == len(step.logits_indices)
    assert step.is_decode
    assert step.draft_ids.tolist() == [d for s in batch.seqs for d in s.spec.draft_token_ids + [-1]]


@pytest.mark.parametrize(
    ("method", "stream"), [("mtp", False), ("draft_model", False), ("mtp", True), ("draft_model", True)]
)
def test_split_prefill_decode_keeps_greedy_output_and_drafts(
    target, naive_tokens, mtp_head, method: str, stream: bool
) -> None:
    """The prefill instance hands over the drafting model's KV with the target's, so the decode
    instance drafts as a mixed one would: the MTP head what it drafts after the same tokens, the
    target as its own draft model only drafts that are accepted. Streamed (`stream`), the target's
    layers go as the prefill computes them and the drafting model's with the export."""
    from services.engine.engine import LLMEngine
    from services.engine.kv_export import KVLayers
    from shared.config import EngineConfig

    spec = {**DRAFTING[method](mtp_head, target), "adaptive": False}
    config = EngineConfig(model=target, device="cpu", max_model_len=192, speculative_config=spec)
    mixed_drafts: dict[tuple[int, ...], list[int]] = {}
    mixed = LLMEngine(config)
    for i, prompt in enumerate(repetitive_prompts()):
        mixed.add_request(f"r{i}", prompt_token_ids=prompt, params=GREEDY)
    while mixed.has_unfinished_requests():
        mixed.step()
        record_drafts(mixed, mixed_drafts)
    prefill, decode = LLMEngine(config), LLMEngine(config)
    tokens: dict[str, list[int]] = {}
    streamed: list[KVLayers] = []
    if stream:
        assert prefill.stream_kv(lambda m: streamed.append(m) if isinstance(m, KVLayers) else None)
    for i, prompt in enumerate(repetitive_prompts()):
        decode.reserve(f"r{i}", prompt, GREEDY)
        prefill.add_request(f"r{i}", prompt_token_ids=prompt, params=GREEDY, handoff=True)
    while prefill.has_unfinished_requests():
        prefill.step()
        for layers in streamed:  # whole layers: every prompt runs in one step
            assert set(layers.first_blocks) == {0}
            for request_id, key, value in zip(layers.request_ids, layers.keys, layers.values):
                decode.import_kv(request_id, "target", layers.index, key, value)
        streamed.clear()
        for export in prefill.handoffs:
            caches = {DRAFT_CACHE[method]} if stream else {"target", DRAFT_CACHE[method]}
            assert {cache for cache, *_ in export.layers} == caches and export.streamed == stream
            for cache, index, key, value in export.layers:
                decode.import_kv(export.request_id, cache, index, key, value)
            decode.activate(export.request_id, export.first_token_id)
            tokens[export.request_id] = [export.first_token_id]
        prefill.handoffs.clear()
    compared, stats = 0, []
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens[out.request_id] += out.new_token_ids
            stats += [out.spec_stats] if out.finished else []
        compared += record_drafts(decode, mixed_drafts)
    assert [tokens[f"r{i}"] for i in range(len(naive_tokens))] == naive_tokens
    if method == "mtp":
        assert compared > 0
    else:
        assert all(s["acceptance_per_position"] == [1.0, 1.0, 1.0] for s in stats)


DRAFTING = {
    "mtp": lambda mtp_head, target: dict(method="mtp", model=mtp_head, num_speculative_tokens=3),
    "draft_model": lambda mtp_head, target: dict(
        method="draft_model", model=target, num_speculative_tokens=3
    ),
}
DRAFT_CACHE = {"mtp": "mtp", "draft_model": "draft"}


def record_drafts(engine, seen: dict[tuple[int, ...], list[int]]) -> int:
    """Checks each running request's drafts against those seen before after the same tokens (a
    shorter k is a prefix of a longer one), records them; returns how many were compared."""
    compared = 0
    for seq in engine.scheduler.running:
        drafts, context = seq.spec.draft_token_ids, tuple(seq.token_ids)
        before = seen.setdefault(context, drafts)
        shorter = min(len(before), len(drafts))
        assert drafts[:shorter] == before[:shorter], len(context)
        compared += bool(shorter) and before is not drafts
        if len(drafts) > len(before):
            seen[context] = drafts
    return compared


def random_ks(
    rng: random.Random,
    seqs: list,
    num_other_tokens: int,
    mixed: bool = False,
    backlogs: list[int] | None = None,
) -> list[int]:
    """A controller that pauses and resumes drafting at random."""
    return [rng.choice([0, 0, 1, 3]) for _ in seqs]


@pytest.mark.parametrize("method", ["mtp", "draft_model"])
def test_drafts_depend_only_on_the_context(target, mtp_head, method: str) -> None:
    """A drafting model's drafts are a function of the request's tokens alone: alone or in a batch
    of 16, and with drafting paused and resumed at random (as the adaptive controller does), the
    drafts proposed after the same tokens agree. So acceptance cannot move with the batch or with
    pauses."""
    prompts = repetitive_prompts(8, seed=5)
    seen: dict[tuple[int, ...], list[int]] = {}
    for max_num_seqs, paused in [(1, False), (16, False), (16, True)]:
        spec = {**DRAFTING[method](mtp_head, target), "adaptive": False}
        llm = LLM(target, device="cpu", max_model_len=192, max_num_seqs=max_num_seqs, speculative_config=spec)
        engine = llm.engine
        if paused:
            engine.drafter.adaptive.choose = functools.partial(random_ks, random.Random(max_num_seqs))
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt_token_ids=prompt, params=GREEDY)
        compared = 0
        while engine.has_unfinished_requests():
            engine.step()
            compared += record_drafts(engine, seen)
        assert compared > 0 or max_num_seqs == 1


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_logit_bias_applies_to_every_verified_row(target, naive_tokens, method: str) -> None:
    """A token banned by logit_bias is never emitted, though drafts propose it (the target as its
    own unbiased draft model proposes exactly the unbiased greedy tokens): the verifier biases each
    draft row as plain decoding biases each step, so the output is plain biased decoding's."""
    prompts = repetitive_prompts()
    params = [
        GREEDY.model_copy(update={"logit_bias": {expected[5]: -100.0, expected[7]: 5.0}})
        for expected in naive_tokens
    ]
    plain = LLM(target, device="cpu", max_model_len=192)
    biased = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    spec = dict(model=target, num_speculative_tokens=3) if method == "draft_model" else METHODS["ngram"]
    llm = spec_llm(target, **{**spec, "method": method})
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outputs] == biased
    assert sum(o.spec_stats["num_draft_tokens"] for o in outputs) > 0
    for output, expected in zip(outputs, naive_tokens):
        assert expected[5] not in output.token_ids and output.token_ids != expected
