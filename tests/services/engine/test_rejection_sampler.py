"""Rejection sampling (Leviathan et al. 2023) is lossless: what it emits is distributed as the target."""

from __future__ import annotations

import pytest
import torch

from services.engine.rejection_sampler import RejectionSampler, VerifyRequest
from services.engine.sampler import SamplingBatch
from shared.sampling_params import SamplingParams

VOCAB = 6
TARGET_LOGITS = torch.tensor([2.0, 0.5, -1.0, 1.0, 0.0, -0.5])
DRAFT_PROBS = torch.tensor([0.05, 0.40, 0.30, 0.05, 0.15, 0.05])  # far from the target on purpose
NUM_REQUESTS = 20_000
TOLERANCE = 0.02  # the empirical TV of 20k samples is ~0.004; a wrong rule is off by 0.1 or more


def total_variation(samples: list[int], expected: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=VOCAB).float()
    return 0.5 * (counts / counts.sum() - expected).abs().sum().item()


def run(k: int, draft_probs: torch.Tensor | None, strategy: str = "rejection", seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0)
    proposal = DRAFT_PROBS if draft_probs is not None else torch.full((VOCAB,), 1.0 / VOCAB)
    drafts = torch.multinomial(proposal, NUM_REQUESTS * k, replacement=True, generator=generator).view(
        NUM_REQUESTS, k
    )
    requests = [
        VerifyRequest(
            params,
            seed * NUM_REQUESTS + i,
            0,
            drafts[i].tolist(),
            draft_probs.expand(k, VOCAB) if draft_probs is not None else None,
        )
        for i in range(NUM_REQUESTS)
    ]
    num_rows = NUM_REQUESTS * (k + 1)
    rows = SamplingBatch([params] * num_rows, [[]] * num_rows, [[]] * num_rows, [[]] * num_rows)
    logits = TARGET_LOGITS.expand(num_rows, VOCAB).contiguous()
    return RejectionSampler(strategy)(logits, rows, requests)


TARGET = torch.softmax(TARGET_LOGITS, dim=-1)


@pytest.mark.parametrize("draft_probs", [DRAFT_PROBS, None], ids=["sampled-draft", "one-hot-draft"])
def test_first_token_follows_the_target(draft_probs) -> None:
    results = run(k=1, draft_probs=draft_probs)
    assert total_variation([r.token_ids[0] for r in results], TARGET) < TOLERANCE
    # the test has power: the drafts alone are far from the target
    assert 0.5 * (DRAFT_PROBS - TARGET).abs().sum().item() > 0.3


def test_every_position_follows_the_target_with_several_drafts() -> None:
    results = run(k=3, draft_probs=DRAFT_PROBS, seed=1)
    for position in range(3):
        tokens = [r.token_ids[position] for r in results if len(r.token_ids) > position]
        assert len(tokens) > 1000
        assert total_variation(tokens, TARGET) < 2.5 * TOLERANCE


def test_acceptance_rate_matches_theory() -> None:
    """P(accept) = sum_x min(p(x), q(x)) for a draft x ~ q."""
    results = run(k=1, draft_probs=DRAFT_PROBS, seed=2)
    rate = sum(r.num_accepted for r in results) / NUM_REQUESTS
    assert rate == pytest.approx(torch.minimum(TARGET, DRAFT_PROBS).sum().item(), abs=0.015)


def test_target_match_is_lossless_too() -> None:
    results = run(k=1, draft_probs=None, strategy="target_match", seed=3)
    assert total_variation([r.token_ids[0] for r in results], TARGET) < TOLERANCE


def test_topp_accepts_drafts_inside_the_nucleus_only() -> None:
    """topp (lossy, FastDeploy's): a draft passes when it is in the target's top-p set."""
    params = SamplingParams(temperature=1.0, top_p=0.7)
    logits = TARGET_LOGITS.expand(2, VOCAB).contiguous()  # nucleus at 0.7: tokens 0 and 3
    rows = SamplingBatch([params] * 2, [[]] * 2, [[]] * 2, [[]] * 2)
    inside = RejectionSampler("topp")(logits, rows, [VerifyRequest(params, 1, 0, [3])])
    outside = RejectionSampler("topp")(logits, rows, [VerifyRequest(params, 1, 0, [1])])
    assert inside[0].num_accepted == 1 and inside[0].token_ids[0] == 3
    assert outside[0].num_accepted == 0 and outside[0].token_ids[0] in (0, 3)


def test_greedy_requests_verify_greedily_under_every_strategy() -> None:
    params = SamplingParams(temperature=0.0)
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 4.0, 0.0, 0.0]])
    rows = SamplingBatch([params] * 2, [[]] * 2, [[]] * 2, [[]] * 2)
    for strategy in ("rejection", "greedy", "target_match", "topp"):
        accepted = RejectionSampler(strategy)(logits, rows, [VerifyRequest(params, 0, 0, [1])])[0]
        rejected = RejectionSampler(strategy)(logits, rows, [VerifyRequest(params, 0, 0, [2])])[0]
        assert accepted.token_ids == [1, 3] and rejected.token_ids == [1]


@pytest.mark.parametrize("strategy", ["greedy", "target_match", "rejection"])
def test_fused_path_inputs_give_the_torch_path_results(monkeypatch, strategy: str) -> None:
    """The host side of the fused path (per-row inputs packed for the kernel, results unpacked),
    run here with the kernel's torch twin in its place, gives what the torch path gives."""
    import kernels.verify
    from kernels.verify_ref import verify_sample_ref

    def twin(*args, max_rows=None, request_of_row=None):
        return verify_sample_ref(*args)

    monkeypatch.setattr(kernels.verify, "verify_sample_cuda", twin, raising=False)
    generator = torch.Generator().manual_seed(3)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=5, seed=1),
        SamplingParams(temperature=1.2, top_p=0.7, min_p=0.05, seed=2),
    ]
    drafts = [[3, 4], [], [7, 8, 9]]
    requests = [VerifyRequest(p, 11 + i, 5 * i, d) for i, (p, d) in enumerate(zip(params, drafts))]
    rows = SamplingBatch(params=[], prompt_token_ids=[], output_token_ids=[], suppressed_token_ids=[])
    for request in requests:
        for _ in range(request.num_rows):
            rows.params.append(request.params)
            rows.prompt_token_ids.append([])
            rows.output_token_ids.append([])
            rows.suppressed_token_ids.append([])
    logits = torch.randn(len(rows.params), 16, generator=generator)
    logits[0, 3] = logits[1, 4] = 10.0  # make the greedy request accept its drafts
    sampler = RejectionSampler(strategy)
    fused = sampler._verify_fused(logits, rows, requests)
    reference = sampler(logits, rows, requests)  # no CUDA here: the torch path
    assert [(r.token_ids, r.num_accepted) for r in fused] == [
        (r.token_ids, r.num_accepted) for r in reference
    ]
    assert fused[0].num_accepted == 2
