"""Fused verify + accept + sample: CUDA kernel vs torch reference vs the engine's RejectionSampler."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.sampling_noise_ref import STREAM_ACCEPT, STREAM_TARGET, exponential_noise_ref, uniform_ref
from kernels.verify_ref import POLICIES, STRATEGIES, verify_sample_ref
from services.engine.rejection_sampler import RejectionSampler, VerifyRequest
from services.engine.sampler import SamplingBatch
from shared.sampling_params import SamplingParams
from tests.kernels.helpers import needs_cuda, poison_allocator

SETTINGS = [
    dict(temperature=0.0),
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=20),
    dict(temperature=1.3, top_p=0.9),
    dict(temperature=0.9, top_k=50, top_p=0.8, min_p=0.01),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.5, top_p=0.5),
    dict(temperature=2.0, top_k=1),
]


def random_requests(
    num_reqs: int, vocab: int, rng: random.Random, logits: torch.Tensor | None = None
) -> list[VerifyRequest]:
    requests = []
    for _ in range(num_reqs):
        params = SamplingParams(**rng.choice(SETTINGS), seed=rng.randrange(2**62))
        k = rng.randrange(0, 6)
        requests.append(
            VerifyRequest(
                params, params.seed or 0, rng.randrange(0, 500), [rng.randrange(vocab) for _ in range(k)]
            )
        )
    return requests


def row_tensors(requests: list[VerifyRequest], device: str) -> dict[str, torch.Tensor]:
    rows = [(r, j) for r in requests for j in range(r.num_rows)]
    cu = [0]
    for r in requests:
        cu.append(cu[-1] + r.num_rows)
    return dict(
        temperature=torch.tensor(
            [0.0 if r.params.greedy else r.params.temperature for r, _ in rows], device=device
        ),
        top_k=torch.tensor([max(r.params.top_k, 0) for r, _ in rows], dtype=torch.int32, device=device),
        top_p=torch.tensor([r.params.top_p for r, _ in rows], device=device),
        min_p=torch.tensor([r.params.min_p for r, _ in rows], device=device),
        seeds=torch.tensor([r.seed for r, _ in rows], dtype=torch.long, device=device),
        positions=torch.tensor([r.position + j for r, j in rows], dtype=torch.long, device=device),
        draft_ids=torch.tensor(
            [(r.draft_token_ids + [-1])[j] for r, j in rows], dtype=torch.int32, device=device
        ),
        cu_num_rows=torch.tensor(cu, dtype=torch.int32, device=device),
    )


def plant_drafts(requests: list[VerifyRequest], logits: torch.Tensor) -> None:
    """Makes half of the drafts the row's argmax, so that acceptance chains of every length occur."""
    row = 0
    for r in requests:
        for j in range(len(r.draft_token_ids)):
            if (row + j) % 2 == 0:
                r.draft_token_ids[j] = int(logits[row + j].argmax())
        row += r.num_rows


def sampler_batch(requests: list[VerifyRequest]) -> SamplingBatch:
    params = [r.params for r in requests for _ in range(r.num_rows)]
    return SamplingBatch(params, [[] for _ in params], [[] for _ in params], [[] for _ in params])


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_reference_matches_rejection_sampler(strategy: str, policy: str) -> None:
    """The kernel's reference computes what the engine's torch sampler computes."""
    rng = random.Random(hash((strategy, policy)) % 1000)
    vocab = 300
    requests = random_requests(12, vocab, rng)
    logits = (
        torch.randn(sum(r.num_rows for r in requests), vocab, generator=torch.Generator().manual_seed(5)) * 3
    )
    plant_drafts(requests, logits)
    expected = RejectionSampler(strategy, policy)(logits, sampler_batch(requests), requests)
    token_ids, num_accepted, *_ = verify_sample_ref(
        logits, **row_tensors(requests, "cpu"), strategy=STRATEGIES[strategy], policy=POLICIES[policy]
    )
    for i, result in enumerate(expected):
        assert int(num_accepted[i]) == result.num_accepted
        assert token_ids[i, : result.num_accepted + 1].tolist() == result.token_ids


@pytest.mark.gpu
@needs_cuda
def test_cuda_noise_is_bit_exact() -> None:
    from kernels.verify import sampling_noise_cuda

    seeds = torch.randint(0, 2**62, (9,), dtype=torch.long, device="cuda")
    positions = torch.randint(0, 10**6, (9,), dtype=torch.long, device="cuda")
    for stream in (STREAM_TARGET, STREAM_ACCEPT):
        uniforms, exponentials = sampling_noise_cuda(seeds, positions, 50_000, stream)
        assert torch.equal(uniforms, uniform_ref(seeds, positions, stream))
        assert torch.equal(exponentials, exponential_noise_ref(seeds, positions, 50_000, stream))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("vocab", [384, 32_000, 128_256])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_cuda_verify_matches_reference(vocab: int, strategy: str) -> None:
    from kernels.verify import verify_sample_cuda

    rng = random.Random(vocab + len(strategy))
    for policy in sorted(POLICIES):
        requests = random_requests(rng.choice([1, 7, 33]), vocab, rng)
        num_rows = sum(r.num_rows for r in requests)
        logits = (torch.randn(num_rows, vocab, device="cuda") * rng.choice([1.0, 4.0])).contiguous()
        plant_drafts(requests, logits)
        rows = row_tensors(requests, "cuda")
        expected = verify_sample_ref(logits, **rows, strategy=STRATEGIES[strategy], policy=POLICIES[policy])
        poison_allocator((num_rows,), torch.int32, logits.device)
        got = verify_sample_cuda(logits, **rows, strategy=STRATEGIES[strategy], policy=POLICIES[policy])
        names = ["token_ids", "num_accepted", "greedy_ids", "sampled_ids", "passes"]
        for name, g, e in zip(names, got, expected):
            assert torch.equal(g.cpu(), e.cpu()), f"{name} differs (policy {policy})"


@pytest.mark.gpu
@needs_cuda
def test_fused_kernel_matches_the_torch_rejection_sampler() -> None:
    """What the step's tail verifies with (the CUDA kernel) equals what the torch path, which serves
    requests with penalties or logprobs, would emit."""
    from kernels.verify import verify_sample_cuda

    rng = random.Random(11)
    requests = random_requests(20, 1000, rng)
    logits = torch.randn(sum(r.num_rows for r in requests), 1000, device="cuda") * 2
    plant_drafts(requests, logits)
    rows = row_tensors(requests, "cuda")
    for strategy in sorted(STRATEGIES):
        token_ids, num_accepted, *_ = verify_sample_cuda(logits, **rows, strategy=STRATEGIES[strategy])
        fused = [(t[: n + 1].tolist(), n) for t, n in zip(token_ids.cpu(), num_accepted.tolist())]
        torch_path = RejectionSampler(strategy)(logits, sampler_batch(requests), requests)
        assert fused == [(r.token_ids, r.num_accepted) for r in torch_path], strategy
