"""The sampler's logit processing equals a plain per-row reference, and seeded sampling is reproducible."""

from __future__ import annotations

import math

import pytest
import torch

from services.engine.rejection_sampler import RejectionSampler, VerifyRequest
from services.engine.sampler import (
    SamplingBatch,
    apply_penalties,
    apply_temperature,
    truncated_probs,
)
from shared.sampling_params import SamplingParams

VOCAB = 50


def batch_of(params: list[SamplingParams], prompts=None, outputs=None, suppressed=None) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(
        params=params,
        prompt_token_ids=prompts or [[] for _ in range(n)],
        output_token_ids=outputs or [[] for _ in range(n)],
        suppressed_token_ids=suppressed or [[] for _ in range(n)],
    )


def sample(logits, batch: SamplingBatch, seeds: list[int], position: int = 0):
    """Plain sampling: the rejection sampler with no drafts."""
    requests = [VerifyRequest(p, seed, position, []) for p, seed in zip(batch.params, seeds)]
    results = RejectionSampler()(logits, batch, requests)
    return [r.token_ids[0] for r in results], [r.logprobs[0] for r in results]


def reference_distribution(
    logits: list[float], p: SamplingParams, prompt: list[int], output: list[int]
) -> list[float]:
    """Plain-Python statement of the documented order: penalties, temperature, min_p, top_k, top_p."""
    logits = list(logits)
    for t in set(prompt) | set(output):
        if p.repetition_penalty != 1.0:
            logits[t] = (
                logits[t] / p.repetition_penalty if logits[t] > 0 else logits[t] * p.repetition_penalty
            )
    for t in set(output):
        logits[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    temperature = p.temperature if p.temperature > 0 else 1.0
    logits = [x / temperature for x in logits]
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    total = sum(weights)
    probs = [w / total for w in weights]
    keep = [pr >= p.min_p * max(probs) for pr in probs]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    ranked = [i for i in order if keep[i]]
    if p.top_k > 0:
        ranked = ranked[: p.top_k]
    mass = sum(probs[i] for i in ranked)
    kept, before = [], 0.0
    for i in ranked:
        if before < p.top_p:
            kept.append(i)
        before += probs[i] / mass
    result = [0.0] * len(probs)
    kept_mass = sum(probs[i] for i in kept)
    for i in kept:
        result[i] = probs[i] / kept_mass
    return result


PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.7),
    SamplingParams(top_k=5),
    SamplingParams(top_p=0.6),
    SamplingParams(min_p=0.2),
    SamplingParams(temperature=1.3, top_k=8, top_p=0.8, min_p=0.05),
    SamplingParams(repetition_penalty=1.5),
    SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
    SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=1.1, top_k=10),
]


def test_processing_matches_plain_reference() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(len(PARAMS), VOCAB, generator=generator) * 2
    prompts = [torch.randint(0, VOCAB, (12,), generator=generator).tolist() for _ in PARAMS]
    outputs = [torch.randint(0, VOCAB, (9,), generator=generator).tolist() for _ in PARAMS]
    batch = batch_of(PARAMS, prompts, outputs)

    probs = truncated_probs(apply_temperature(apply_penalties(logits, batch), PARAMS), PARAMS)

    for i, p in enumerate(PARAMS):
        expected = reference_distribution(logits[i].tolist(), p, prompts[i], outputs[i])
        assert probs[i].tolist() == pytest.approx(expected, abs=1e-6), p


def test_suppressed_ids_are_never_sampled() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 4] = 50.0  # overwhelmingly likely, but suppressed
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)]
    token_ids, _ = sample(logits, batch_of(params, suppressed=[[4], [4]]), [0, 1])
    assert 4 not in token_ids


def test_sampled_frequencies_follow_the_processed_distribution() -> None:
    p = SamplingParams(temperature=0.9, top_k=6, top_p=0.9)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5))
    expected = torch.tensor(reference_distribution(logits[0].tolist(), p, [], []))
    num_samples = 4000
    counts = torch.zeros(VOCAB)
    rows = logits.expand(num_samples, VOCAB)
    tokens, _ = sample(rows, batch_of([p] * num_samples), list(range(num_samples)))
    counts.index_add_(0, torch.tensor(tokens), torch.ones(num_samples))
    total_variation = 0.5 * (counts / num_samples - expected).abs().sum().item()
    assert total_variation < 0.05
    assert counts[expected == 0].sum() == 0


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    p = SamplingParams(temperature=1.0, seed=1234)
    logits = torch.randn(32, VOCAB, generator=torch.Generator().manual_seed(9))

    def first_token(rows: list[int], position: int) -> int:
        batch = batch_of([p if r == 0 else SamplingParams() for r in rows])
        return sample(logits[rows], batch, [1234] + [len(rows) + r for r in rows[1:]], position)[0][0]

    alone = [first_token([0], position) for position in range(20)]
    in_batch = [first_token(list(range(32)), position) for position in range(20)]
    assert alone == in_batch
    assert len(set(alone)) > 1  # positions draw different noise


def test_logprobs_report_sampled_token_and_top_n() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(temperature=0.0, logprobs=3)
    _, logprobs = sample(logits, batch_of([p]), [0])
    entry = logprobs[0]
    expected = torch.log_softmax(logits[0], dim=-1)
    assert entry.token_id == int(logits[0].argmax())
    assert entry.logprob == pytest.approx(expected.max().item(), abs=1e-6)
    assert list(entry.top) == expected.topk(3).indices.tolist()


def test_logit_bias_is_added_before_penalties_and_bans_at_minus_100() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5], [1.0, 2.0, 3.0, 0.5]])
    biased = SamplingParams(logit_bias={2: -100.0, 3: 2.0})
    penalised = SamplingParams(logit_bias={0: 1.0}, repetition_penalty=2.0)
    batch = SamplingBatch(
        params=[biased, penalised],
        prompt_token_ids=[[], [0]],
        output_token_ids=[[], []],
        suppressed_token_ids=[[], []],
    )
    out = apply_penalties(logits, batch)
    assert out[0].tolist() == pytest.approx([1.0, 2.0, -97.0, 2.5])
    assert out[1].tolist() == pytest.approx([1.0, 2.0, 3.0, 0.5])  # (1 + 1) / 2: biased, then penalised
    assert logits[0, 2] == 3.0  # the caller's logits are left alone
    assert int(out[0].argmax()) == 3


def test_logit_bias_outside_its_range_is_refused() -> None:
    with pytest.raises(ValueError, match="less than or equal to 100"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        SamplingParams(logit_bias={-1: 1.0})


def test_top_p_of_one_keeps_the_tail_whatever_the_batch() -> None:
    """top_p = 1 is no cut. On peaked logits (randn * 4 over 384 tokens) the float32 cumulative mass
    reaches 1 before the tail; a top_p = 1 row still keeps every token when another row of its batch
    turns the top_k / top_p masks on."""
    logits = torch.randn(8, 384, generator=torch.Generator().manual_seed(0)) * 4
    params = [SamplingParams(temperature=1.0)] * 7 + [SamplingParams(temperature=1.0, top_p=0.9)]
    probs = truncated_probs(logits, params)
    assert bool((probs[:7] > 0).all())
    assert torch.equal(probs[:7], truncated_probs(logits[:7], params[:7]))
