"""Verification is lossless: what it emits is distributed as the target, whatever the drafts, and
drafts sampled with the target's noise are accepted as the Gumbel-max coupling promises."""

from __future__ import annotations

import pytest
import torch

from kernels.verify_ref import STRATEGIES, verify_sample_ref
from services.engine.input_batch import InputBatch
from services.engine.rejection_sampler import RejectionSampler, VerifyRequest, VerifyResult
from services.engine.sampler import SamplingBatch
from services.engine.spec_decode.draft_sampling import sample_drafts
from shared.sampling_params import SamplingParams

VOCAB = 6
TARGET_LOGITS = torch.tensor([2.0, 0.5, -1.0, 1.0, 0.0, -0.5])
DRAFT_PROBS = torch.tensor([0.05, 0.40, 0.30, 0.05, 0.15, 0.05])  # far from the target on purpose
NUM_REQUESTS = 20_000
TOLERANCE = 0.02  # the empirical TV of 20k samples is ~0.004; a wrong rule is off by 0.1 or more


def total_variation(samples: list[int], expected: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=VOCAB).float()
    return 0.5 * (counts / counts.sum() - expected).abs().sum().item()


def coupled_drafts(draft_logits: torch.Tensor, seeds: torch.Tensor, k: int) -> torch.Tensor:
    """[len(seeds), k] drafts sampled from softmax(draft_logits) the way drafting models do
    (services/engine/spec_decode/draft_sampling.py): with the target's noise at each position."""
    num = len(seeds)
    inputs = InputBatch(num, 4, k, torch.device("cpu"))
    inputs.host.temperature[:num] = 1.0
    inputs.host.seeds[:num] = seeds.numpy()
    inputs._dirty = True
    inputs.flush()
    slots = torch.arange(num)
    logits = draft_logits.expand(num, VOCAB).contiguous()
    columns = [sample_drafts(logits, inputs, slots, j) for j in range(k)]
    return torch.stack(columns, dim=1) if columns else torch.empty(num, 0, dtype=torch.long)


def run(
    k: int,
    drafts: str = "coupled",
    strategy: str = "rejection",
    seed: int = 0,
    draft_logits: torch.Tensor | None = None,
) -> list[VerifyResult]:
    """Verifies k drafts for each of NUM_REQUESTS requests at temperature 1: drafts sampled from the
    draft distribution with the target's noise (coupled), or independently of it. `draft_logits`
    of coupled drafts: DRAFT_PROBS's unless given."""
    params = SamplingParams(temperature=1.0)
    seeds = torch.arange(NUM_REQUESTS) + seed * NUM_REQUESTS
    if drafts == "coupled":
        draft_ids = coupled_drafts(DRAFT_PROBS.log() if draft_logits is None else draft_logits, seeds, k)
    else:
        generator = torch.Generator().manual_seed(seed)
        draft_ids = torch.multinomial(DRAFT_PROBS, NUM_REQUESTS * k, replacement=True, generator=generator)
        draft_ids = draft_ids.view(NUM_REQUESTS, k)
    requests = [VerifyRequest(params, int(seeds[i]), 0, draft_ids[i].tolist()) for i in range(NUM_REQUESTS)]
    num_rows = NUM_REQUESTS * (k + 1)
    rows = SamplingBatch([params] * num_rows, [[]] * num_rows, [[]] * num_rows, [[]] * num_rows)
    logits = TARGET_LOGITS.expand(num_rows, VOCAB).contiguous()
    return RejectionSampler(strategy)(logits, rows, requests)


TARGET = torch.softmax(TARGET_LOGITS, dim=-1)
TV = 0.5 * (DRAFT_PROBS - TARGET).abs().sum().item()


@pytest.mark.parametrize("drafts", ["coupled", "independent"])
def test_first_token_follows_the_target(drafts: str) -> None:
    results = run(k=1, drafts=drafts)
    assert total_variation([r.token_ids[0] for r in results], TARGET) < TOLERANCE
    assert TV > 0.3  # the test has power: the drafts alone are far from the target


def test_every_position_follows_the_target_with_several_drafts() -> None:
    results = run(k=3, seed=1)
    for position in range(3):
        tokens = [r.token_ids[position] for r in results if len(r.token_ids) > position]
        assert len(tokens) > 1000
        assert total_variation(tokens, TARGET) < 2.5 * TOLERANCE


def test_drafts_over_a_reduced_vocabulary_keep_the_target_distribution() -> None:
    """An EAGLE-3 head drafts over its draft vocabulary only (-inf elsewhere,
    `Eagle3Head.logits`): the target's most likely token is never drafted, yet every position
    still follows the target."""
    in_draft_vocabulary = torch.tensor([1, 2, 4])
    draft_logits = torch.full((VOCAB,), float("-inf")).index_copy_(
        0, in_draft_vocabulary, DRAFT_PROBS[in_draft_vocabulary].log()
    )
    results = run(k=2, seed=2, draft_logits=draft_logits)
    drafted = coupled_drafts(draft_logits, torch.arange(NUM_REQUESTS) + 2 * NUM_REQUESTS, 2)
    assert torch.isin(drafted, in_draft_vocabulary).all()
    for position in range(2):
        tokens = [r.token_ids[position] for r in results if len(r.token_ids) > position]
        assert len(tokens) > 1000
        assert total_variation(tokens, TARGET) < 2.5 * TOLERANCE
    assert TARGET[0] > 0.4  # the test has power: the token the drafts never propose is the likeliest


def test_coupled_drafts_are_accepted_as_the_gumbel_coupling_promises() -> None:
    """Drafts sampled with the target's own noise agree with the target's sample with probability
    at least (1 - TV) / (1 + TV) (the Gumbel-max coupling), far above independent drafts'
    sum_x p(x) q(x); at most 1 - TV (no coupling beats the maximal one)."""
    coupled = sum(r.num_accepted for r in run(k=1, seed=2)) / NUM_REQUESTS
    independent = sum(r.num_accepted for r in run(k=1, drafts="independent", seed=2)) / NUM_REQUESTS
    assert (1 - TV) / (1 + TV) - 0.015 < coupled < 1 - TV + 0.015
    assert independent == pytest.approx((TARGET * DRAFT_PROBS).sum().item(), abs=0.015)
    assert coupled > independent + 0.05


def test_a_seed_fixes_the_output_whatever_the_drafts() -> None:
    """Every emitted token is the target's own sample at its position: drafts change how many
    tokens a step emits, never which."""
    plain = run(k=0, seed=4)
    for drafts in ("coupled", "independent"):
        drafted = run(k=2, drafts=drafts, seed=4)
        assert [r.token_ids[0] for r in drafted] == [r.token_ids[0] for r in plain]


def test_target_match_is_lossless_too() -> None:
    results = run(k=1, drafts="independent", strategy="target_match", seed=3)
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


@pytest.mark.parametrize("strategy", ["greedy", "target_match", "rejection", "topp"])
def test_the_fused_kernel_gives_the_torch_path_results(strategy: str) -> None:
    """The fused verify kernel's contract (its torch twin, which the CUDA kernel is tested
    against) gives what the torch path gives, per-row parameters and all."""
    generator = torch.Generator().manual_seed(3)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=5, seed=1),
        SamplingParams(temperature=1.2, top_p=0.7, min_p=0.05, seed=2),
    ]
    drafts = [[3, 4], [], [7, 8, 9]]
    requests = [VerifyRequest(p, 11 + i, 5 * i, d) for i, (p, d) in enumerate(zip(params, drafts))]
    row_params = [r.params for r in requests for _ in range(r.num_rows)]
    num_rows = len(row_params)
    rows = SamplingBatch(row_params, [[]] * num_rows, [[]] * num_rows, [[]] * num_rows)
    logits = torch.randn(num_rows, 16, generator=generator)
    logits[0, 3] = logits[1, 4] = 10.0  # make the greedy request accept its drafts
    token_ids, num_accepted, *_ = verify_sample_ref(
        logits,
        torch.tensor([0.0 if p.greedy else p.temperature for p in row_params]),
        torch.tensor([max(p.top_k, 0) for p in row_params], dtype=torch.int32),
        torch.tensor([p.top_p for p in row_params]),
        torch.tensor([p.min_p for p in row_params]),
        torch.tensor([r.seed for r in requests for _ in range(r.num_rows)]),
        torch.tensor([r.position + j for r in requests for j in range(r.num_rows)]),
        torch.tensor([d for r in requests for d in r.draft_token_ids + [-1]], dtype=torch.int32),
        torch.tensor([0, 3, 4, 8], dtype=torch.int32),
        STRATEGIES[strategy],
    )
    reference = RejectionSampler(strategy)(logits, rows, requests)
    fused = [(row[: n + 1].tolist(), n) for row, n in zip(token_ids, num_accepted.tolist())]
    assert fused == [(r.token_ids, r.num_accepted) for r in reference]
    assert fused[0][1] == 2
