"""Fused verify + accept + sample: CUDA kernel vs torch reference vs the engine's RejectionSampler."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kernels.sampling_noise_ref import STREAM_ACCEPT, STREAM_TARGET, exponential_noise_ref, uniform_ref
from kernels.verify_ref import (
    POLICIES,
    REJECTION,
    STRATEGIES,
    allowed_tokens_ref,
    num_mask_words,
    truncated_probs_ref,
    verify_sample_ref,
)
from services.engine.rejection_sampler import RejectionSampler, VerifyRequest
from services.engine.sampler import SamplingBatch
from shared.sampling_params import SamplingParams
from tests.kernels.helpers import (
    assemble_sm90,
    needs_cuda,
    needs_gxx,
    needs_nvcc,
    poison_allocator,
    run_threads_on_host,
)

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


def sampler_batch(requests: list[VerifyRequest], bitmask: torch.Tensor | None = None) -> SamplingBatch:
    params = [r.params for r in requests for _ in range(r.num_rows)]
    return SamplingBatch(params, [[] for _ in params], [[] for _ in params], [[] for _ in params], bitmask)


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """[num_rows, num_words] int32 bitmask of an [num_rows, vocab_size] bool tensor of allowed tokens."""
    num_rows, vocab = allowed.shape
    bits = torch.zeros(num_rows, num_mask_words(vocab) * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    words = (bits.view(num_rows, -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def random_allowed(logits: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """[num_rows, vocab_size] bool: a random subset of tokens per row that leaves out the row's
    argmax (so that greedy choices change) and holds at least one token."""
    num_rows, vocab = logits.shape
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    allowed = torch.rand(num_rows, vocab, generator=generator) < rng.choice([0.05, 0.3, 0.8])
    allowed[torch.arange(num_rows), logits.argmax(dim=-1).cpu()] = False
    allowed[torch.arange(num_rows), torch.randint(vocab, (num_rows,), generator=generator)] = True
    return allowed


def random_masks(
    logits: torch.Tensor, requests: list[VerifyRequest], rng: random.Random
) -> tuple[torch.Tensor, torch.Tensor]:
    """(bitmask [num_rows, num_words] int32, masked_rows [num_rows] int32) on `logits`' device: the
    rows of about half the requests carry `random_allowed` masks; the other rows' words are zero,
    which an unmarked row must never read."""
    masked = torch.tensor(
        [int(flag) for r in requests for flag in [rng.random() < 0.5] * r.num_rows], dtype=torch.int32
    )
    bitmask = torch.where(masked[:, None].bool(), pack_bitmask(random_allowed(logits, rng)), 0)
    return bitmask.to(logits.device), masked.to(logits.device)


def sampler_bitmask(bitmask: torch.Tensor, masked_rows: torch.Tensor) -> torch.Tensor:
    """The torch sampler's form of the same masks: every token allowed on unmarked rows."""
    return torch.where(masked_rows[:, None].bool(), bitmask, -1).cpu()


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


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_masked_reference_matches_the_torch_path(strategy: str, policy: str) -> None:
    """With grammar masks the reference verifies as today's torch path (the RejectionSampler with
    the mask in its batch) does, while the rows without a grammar read nothing of theirs."""
    rng = random.Random(hash(("mask", strategy, policy)) % 1000)
    vocab = 300
    requests = random_requests(12, vocab, rng)
    logits = (
        torch.randn(sum(r.num_rows for r in requests), vocab, generator=torch.Generator().manual_seed(7)) * 3
    )
    plant_drafts(requests, logits)
    bitmask, masked_rows = random_masks(logits, requests, rng)
    batch = sampler_batch(requests, sampler_bitmask(bitmask, masked_rows))
    expected = RejectionSampler(strategy, policy)(logits, batch, requests)
    token_ids, num_accepted, *_ = verify_sample_ref(
        logits,
        **row_tensors(requests, "cpu"),
        strategy=STRATEGIES[strategy],
        policy=POLICIES[policy],
        bitmask=bitmask,
        masked_rows=masked_rows,
    )
    assert bool(masked_rows.any()) and not bool(masked_rows.all())
    for i, result in enumerate(expected):
        assert int(num_accepted[i]) == result.num_accepted
        assert token_ids[i, : result.num_accepted + 1].tolist() == result.token_ids


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_a_draft_the_grammar_refuses_is_rejected_at_its_row(strategy: str) -> None:
    """Drafts that are each row's unmasked argmax, refused by the mask of their row: none passes,
    and every emitted token is one the grammar allows."""
    rng = random.Random(3)
    vocab = 200
    requests = [r for r in random_requests(16, vocab, rng) if r.draft_token_ids]
    logits = (
        torch.randn(sum(r.num_rows for r in requests), vocab, generator=torch.Generator().manual_seed(9)) * 4
    )
    row = 0
    for r in requests:
        r.draft_token_ids = [int(logits[row + j].argmax()) for j in range(len(r.draft_token_ids))]
        row += r.num_rows
    bitmask = pack_bitmask(random_allowed(logits, rng))
    masked_rows = torch.ones(len(logits), dtype=torch.int32)
    token_ids, num_accepted, _, _, passes = verify_sample_ref(
        logits,
        **row_tensors(requests, "cpu"),
        strategy=STRATEGIES[strategy],
        bitmask=bitmask,
        masked_rows=masked_rows,
    )
    assert not passes.any() and not num_accepted.any()
    allowed = allowed_tokens_ref(bitmask, vocab)
    starts = row_tensors(requests, "cpu")["cu_num_rows"][:-1]
    assert allowed[starts, token_ids[:, 0].long()].all()


def test_sampling_under_a_mask_is_the_masked_target_distribution() -> None:
    """Lossless under the grammar: with rejection sampling and drafts drawn from an unmasked draft
    distribution (often outside the grammar), the first emitted token of many seeded requests is
    distributed as the target restricted to the allowed tokens and renormalised."""
    vocab, num_reqs = 12, 20_000
    generator = torch.Generator().manual_seed(1)
    target_logits = torch.randn(vocab, generator=generator)
    allowed = torch.tensor([i % 3 != 0 for i in range(vocab)])
    draft_probs = torch.softmax(torch.randn(vocab, generator=generator) * 2, dim=-1)
    drafts = torch.multinomial(draft_probs, num_reqs, replacement=True, generator=generator)
    rows = num_reqs * 2  # one draft and the bonus row each
    word = int(sum(1 << i for i in range(vocab) if allowed[i]))
    token_ids, num_accepted, *_ = verify_sample_ref(
        target_logits.expand(rows, vocab).contiguous(),
        temperature=torch.ones(rows),
        top_k=torch.zeros(rows, dtype=torch.int32),
        top_p=torch.ones(rows),
        min_p=torch.zeros(rows),
        seeds=torch.arange(num_reqs, dtype=torch.long).repeat_interleave(2),
        positions=torch.tensor([0, 1], dtype=torch.long).repeat(num_reqs),
        draft_ids=torch.stack([drafts.int(), torch.full_like(drafts.int(), -1)], dim=1).ravel(),
        cu_num_rows=torch.arange(0, rows + 1, 2, dtype=torch.int32),
        strategy=REJECTION,
        bitmask=torch.full((rows, 1), word, dtype=torch.int32),
        masked_rows=torch.ones(rows, dtype=torch.int32),
    )
    expected = torch.softmax(target_logits.masked_fill(~allowed, float("-inf")), dim=-1)
    seen = torch.bincount(token_ids[:, 0].long(), minlength=vocab).double() / num_reqs
    assert seen[~allowed].sum() == 0
    assert 0 < float(num_accepted.float().mean()) < 1
    assert float((seen - expected).abs().sum()) / 2 < 0.02  # total variation; about 0.01 expected by chance


def test_masks_that_do_not_fit_are_refused() -> None:
    requests = random_requests(3, 40, random.Random(2))
    logits = torch.randn(sum(r.num_rows for r in requests), 40)
    rows = row_tensors(requests, "cpu")
    marked = torch.ones(len(logits), dtype=torch.int32)
    with pytest.raises(ValueError, match="both or neither"):
        verify_sample_ref(logits, **rows, strategy=0, masked_rows=marked)
    with pytest.raises(ValueError, match=r"bitmask must be int32 \[\d+, 2\]"):
        verify_sample_ref(
            logits,
            **rows,
            strategy=0,
            bitmask=torch.zeros(len(logits), 1, dtype=torch.int32),
            masked_rows=marked,
        )


def peaked_logits(num_rows: int, vocab: int) -> torch.Tensor:
    """randn * 4: rows whose float32 cumulative mass, sorted, reaches 1 before the tail (most rows
    at 384 tokens: tens of tokens of probability about 1e-9 lie past that point)."""
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(0)) * 4


def test_top_p_of_one_keeps_every_token() -> None:
    """top_p = 1 is no cut (the kernel skips its top_p pass): the reference keeps the tail that lies
    past the point where the float32 cumsum of the sorted mass reaches 1."""
    logits = peaked_logits(16, 384)
    ones, zeros = torch.ones(16), torch.zeros(16)
    probs = truncated_probs_ref(logits, ones, zeros.int(), ones, zeros)
    assert bool((probs > 0).all())


@needs_gxx
def test_a_tail_draft_passes_top_p_of_one_on_the_host(host_verify: Any) -> None:
    """Under the topp strategy a top_p = 1 row's least likely token is inside the (untruncated) set:
    the kernel run on the host and the reference both pass it, with and without a grammar mask."""
    vocab = 384
    logits = peaked_logits(2, vocab)
    params = SamplingParams(temperature=1.0, seed=7)
    requests = [VerifyRequest(params, 7, 40, [int(logits[0].argmin())])]
    rows = row_tensors(requests, "cpu")
    allowed = torch.ones(2, vocab, dtype=torch.bool)
    allowed[:, 1::3] = False
    allowed[0, int(logits[0].argmin())] = True
    for masks in (None, (pack_bitmask(allowed), torch.ones(2, dtype=torch.int32))):
        args: dict[str, Any] = dict(strategy=STRATEGIES["topp"])
        if masks is not None:
            args.update(bitmask=masks[0], masked_rows=masks[1])
        expected = verify_sample_ref(logits, **rows, **args)
        got = host_verify(logits, rows, STRATEGIES["topp"], masks, vocab, False)
        for name, g, e in zip(("tokens", "accepted", "greedy", "sampled", "passes"), got, expected):
            assert torch.equal(g, e), (name, masks is not None)
        assert expected[4].tolist() == [1, 0]


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
        generator = torch.Generator().manual_seed(rng.randrange(2**31))  # a failure replays on the host
        logits = (torch.randn(num_rows, vocab, generator=generator) * rng.choice([1.0, 4.0])).cuda()
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


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("vocab", [384, 1001, 32_000, 128_256])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_cuda_masked_verify_matches_reference(vocab: int, strategy: str) -> None:
    """The kernel under grammar masks (vocabularies a multiple of 4 and not, of 32 and not) gives
    the reference's every output; unmarked rows, whose words are zero, read none of them."""
    from kernels.verify import verify_sample_cuda

    rng = random.Random(vocab * 7 + len(strategy))
    for policy in sorted(POLICIES):
        requests = random_requests(rng.choice([1, 7, 33]), vocab, rng)
        num_rows = sum(r.num_rows for r in requests)
        generator = torch.Generator().manual_seed(rng.randrange(2**31))  # a failure replays on the host
        logits = (torch.randn(num_rows, vocab, generator=generator) * rng.choice([1.0, 4.0])).cuda()
        plant_drafts(requests, logits)
        bitmask, masked_rows = random_masks(logits, requests, rng)
        rows = row_tensors(requests, "cuda")
        args = dict(
            strategy=STRATEGIES[strategy], policy=POLICIES[policy], bitmask=bitmask, masked_rows=masked_rows
        )
        expected = verify_sample_ref(logits, **rows, **args)
        poison_allocator((num_rows,), torch.int32, logits.device)
        got = verify_sample_cuda(logits, **rows, **args)
        names = ["token_ids", "num_accepted", "greedy_ids", "sampled_ids", "passes"]
        for name, g, e in zip(names, got, expected):
            assert torch.equal(g.cpu(), e.cpu()), f"{name} differs (policy {policy})"


@pytest.mark.gpu
@needs_cuda
def test_cuda_masked_verify_matches_the_torch_rejection_sampler() -> None:
    """What the step's tail verifies grammar requests with equals today's torch path for them."""
    from kernels.verify import verify_sample_cuda

    rng = random.Random(12)
    requests = random_requests(20, 1000, rng)
    logits = torch.randn(sum(r.num_rows for r in requests), 1000, device="cuda") * 2
    plant_drafts(requests, logits)
    bitmask, masked_rows = random_masks(logits, requests, rng)
    rows = row_tensors(requests, "cuda")
    batch = sampler_batch(requests, sampler_bitmask(bitmask, masked_rows))
    for strategy in sorted(STRATEGIES):
        token_ids, num_accepted, *_ = verify_sample_cuda(
            logits, **rows, strategy=STRATEGIES[strategy], bitmask=bitmask, masked_rows=masked_rows
        )
        fused = [(t[: n + 1].tolist(), n) for t, n in zip(token_ids.cpu(), num_accepted.tolist())]
        torch_path = RejectionSampler(strategy)(logits, batch, requests)
        assert fused == [(r.token_ids, r.num_accepted) for r in torch_path], strategy


# ---- rows split over several blocks (`split_chunks`) ----


@pytest.mark.parametrize("vocab", [384, 1001, 32_000, 128_256])
def test_split_chunks_cover_the_row_in_aligned_nonempty_chunks(
    vocab: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kernels.verify import MIN_CHUNK_ENV, SPLIT_ENV, split_chunks

    for min_chunk in (None, "128", "1000000"):
        if min_chunk is not None:
            monkeypatch.setenv(MIN_CHUNK_ENV, min_chunk)
        for num_rows in (1, 2, 16, 64, 200):
            chunks, chunk_len = split_chunks(num_rows, vocab, 132)
            assert 1 <= chunks <= max(1, 132 // num_rows)
            assert chunks == 1 or chunk_len % 128 == 0
            assert (chunks - 1) * chunk_len < vocab <= chunks * chunk_len  # none empty
    monkeypatch.delenv(MIN_CHUNK_ENV)
    assert split_chunks(1, 128_256, 132)[0] > 8  # batch 1 on an H100 / H200: many blocks
    monkeypatch.setenv(SPLIT_ENV, "off")
    assert split_chunks(1, 128_256, 132) == (1, 128_256)


def greedy_requests(num_reqs: int, vocab: int, rng: random.Random) -> list[VerifyRequest]:
    params = SamplingParams(temperature=0.0)
    return [
        VerifyRequest(params, 0, rng.randrange(500), [rng.randrange(vocab) for _ in range(rng.randrange(6))])
        for _ in range(num_reqs)
    ]


def replays_match_reference(requests: list, vocab: int, strategy: str) -> Iterator[torch.Tensor]:
    """Captures one CUDA verify launch for `requests`, replays it four times on new logits and
    checks each replay against the reference; yields the captured logits after each replay."""
    from kernels.verify import verify_sample_cuda

    static = torch.zeros(sum(r.num_rows for r in requests), vocab, device="cuda")
    rows = row_tensors(requests, "cuda")
    request_of_row = torch.repeat_interleave(
        torch.arange(len(requests), dtype=torch.int32), torch.tensor([r.num_rows for r in requests])
    ).cuda()
    call = dict(
        strategy=STRATEGIES[strategy],
        max_rows=max(r.num_rows for r in requests),
        request_of_row=request_of_row,
    )
    verify_sample_cuda(static, **rows, **call)  # warm-up: buffers exist before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = verify_sample_cuda(static, **rows, **call)
    for _ in range(4):
        static.copy_(torch.randn_like(static) * 4)
        graph.replay()
        torch.cuda.synchronize()
        expected = verify_sample_ref(static, **rows, strategy=STRATEGIES[strategy])
        for g, e in zip(replayed, expected):
            assert torch.equal(g.cpu(), e.cpu())
        yield static


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("vocab", [1001, 32_000, 128_256])
def test_cuda_split_greedy_rows_match_reference(vocab: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy rows at batch 1-16 (split over blocks; small chunks forced so that odd vocabularies
    and grammar masks split too), mixed with sampled rows (one block each), equal the reference,
    the unsplit kernel, and repeated graph replays (the row counters are left zero)."""
    from kernels.verify import MIN_CHUNK_ENV, SPLIT_ENV, verify_sample_cuda

    rng = random.Random(vocab)
    monkeypatch.setenv(MIN_CHUNK_ENV, "128")
    for num_reqs, greedy_only in ((1, True), (2, True), (16, True), (5, False)):
        # row 0 greedy: a tie at a sampled row's top_k / top_p cut keeps every tied token in the
        # kernel, one of them in the reference (the mixed case's first request had top_k = 1)
        requests = greedy_requests(1, vocab, rng)
        requests += (
            greedy_requests(num_reqs - 1, vocab, rng)
            if greedy_only
            else random_requests(num_reqs - 1, vocab, rng)
        )
        num_rows = sum(r.num_rows for r in requests)
        logits = (torch.randn(num_rows, vocab, device="cuda") * 4).contiguous()
        logits[0, vocab // 2] = logits[0, vocab - 1] = logits[0].max() + 1  # a tie across chunks
        plant_drafts(requests, logits)
        rows = row_tensors(requests, "cuda")
        for masks in (None, random_masks(logits, requests, rng)):
            args = dict(strategy=STRATEGIES["greedy"])
            if masks is not None:
                args.update(bitmask=masks[0], masked_rows=masks[1])
            expected = verify_sample_ref(logits, **rows, **args)
            got = verify_sample_cuda(logits, **rows, **args)
            monkeypatch.setenv(SPLIT_ENV, "off")
            unsplit = verify_sample_cuda(logits, **rows, **args)
            monkeypatch.delenv(SPLIT_ENV)
            for g, e, u in zip(got, expected, unsplit):
                assert torch.equal(g.cpu(), e.cpu()) and torch.equal(g, u)
    for _ in replays_match_reference(greedy_requests(3, vocab, rng), vocab, "greedy"):
        pass


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("vocab", [1001, 32_000, 128_256])
def test_cuda_split_sampled_rows_match_reference(vocab: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampled and greedy rows at batch 1-8 split over blocks (default chunks and forced small
    ones), with and without grammar masks, for each strategy, equal the reference, sampled rows in
    one block (SPECMESH_VERIFY_SPLIT=greedy) and no split at all (`off`); the row counters are left
    zero."""
    from kernels.verify import _CHUNK_SCRATCH, MIN_CHUNK_ENV, SPLIT_ENV, verify_sample_cuda

    rng = random.Random(vocab + 1)
    for min_chunk in (None, "128"):
        if min_chunk is not None:
            monkeypatch.setenv(MIN_CHUNK_ENV, min_chunk)
        for num_reqs in (1, 2, 8):
            requests = random_requests(num_reqs, vocab, rng)
            num_rows = sum(r.num_rows for r in requests)
            logits = (torch.randn(num_rows, vocab, device="cuda") * rng.choice([1.0, 4.0])).contiguous()
            plant_drafts(requests, logits)
            rows = row_tensors(requests, "cuda")
            for strategy in sorted(STRATEGIES):
                masks = random_masks(logits, requests, rng) if strategy in ("greedy", "topp") else None
                args: dict[str, Any] = dict(strategy=STRATEGIES[strategy])
                if masks is not None:
                    args.update(bitmask=masks[0], masked_rows=masks[1])
                expected = verify_sample_ref(logits, **rows, **args)
                got = verify_sample_cuda(logits, **rows, **args)
                baselines = []
                for mode in ("greedy", "off"):
                    monkeypatch.setenv(SPLIT_ENV, mode)
                    baselines.append(verify_sample_cuda(logits, **rows, **args))
                    monkeypatch.delenv(SPLIT_ENV)
                names = ["token_ids", "num_accepted", "greedy_ids", "sampled_ids", "passes"]
                for i, (name, g, e) in enumerate(zip(names, got, expected)):
                    assert torch.equal(g.cpu(), e.cpu()), (name, strategy, num_reqs, min_chunk)
                    assert all(torch.equal(g, b[i]) for b in baselines), (name, strategy, num_reqs, min_chunk)
                torch.cuda.synchronize()
                assert not _CHUNK_SCRATCH[logits.device].tensors[2].any(), "row counters left zero"


@pytest.mark.gpu
@needs_cuda
def test_cuda_split_sampled_rows_under_graph_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """A captured launch with split sampled rows (top_k / top_p / min_p) replayed on new logits
    gives the reference's outputs each time and leaves the row and request counters zero."""
    from kernels.verify import _CHUNK_SCRATCH, MIN_CHUNK_ENV, scratch_counters

    monkeypatch.setenv(MIN_CHUNK_ENV, "2048")
    vocab, rng = 128_256, random.Random(12)
    for static in replays_match_reference(random_requests(3, vocab, rng), vocab, "target_match"):
        assert not _CHUNK_SCRATCH[static.device].tensors[2].any()
        assert not scratch_counters(3, static.device).any()


@needs_nvcc
def test_verify_kernel_assembles_for_sm90_without_spills(tmp_path) -> None:
    from kernels.verify import SOURCE, THREADS

    assert "verify_sample" in assemble_sm90(SOURCE, {"THREADS": THREADS}, tmp_path)


# ---- the kernel run on the host with every block at once (the split rows' barriers need that) ----

HOST_THREADS = 32


@pytest.fixture(scope="module")
def host_verify(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Runs the verify kernel on the host: (logits, row tensors, strategy, masks, chunk_len,
    split_sampled) -> (token_ids, num_accepted, greedy, sampled, passes) as the wrapper returns them,
    checking that every counter is left zero."""
    from kernels.verify import SOURCE

    library_dir = tmp_path_factory.mktemp("verify_host")

    def run(
        logits: torch.Tensor,
        rows: dict[str, torch.Tensor],
        strategy: int,
        masks: tuple[torch.Tensor, torch.Tensor] | None,
        chunk_len: int,
        split_sampled: bool,
        policy: int = 0,
    ) -> tuple[torch.Tensor, ...]:
        num_rows, vocab = logits.shape
        counts = rows["cu_num_rows"].diff()
        num_reqs, max_rows = len(counts), int(counts.max())
        request_of_row = torch.repeat_interleave(torch.arange(num_reqs, dtype=torch.int32), counts.long())
        chunks = -(-vocab // chunk_len)

        def shared(t: torch.Tensor) -> torch.Tensor:
            return t.clone().share_memory_()

        out = [shared(torch.full(shape, -7, dtype=torch.int32)) for shape in ((num_rows,),) * 3]
        counters, row_counters = (
            shared(torch.zeros(num_reqs, dtype=torch.int32)),
            shared(torch.zeros(num_rows, dtype=torch.int32)),
        )
        token_ids = shared(torch.full((num_reqs, max_rows), -7, dtype=torch.int32))
        num_accepted = shared(torch.full((num_reqs,), -7, dtype=torch.int32))
        args = [
            logits, rows["temperature"], rows["top_k"], rows["top_p"], rows["min_p"], rows["seeds"],
            rows["positions"], rows["draft_ids"], request_of_row, rows["cu_num_rows"], *out, counters,
            token_ids, num_accepted, masks[0] if masks else None, masks[1] if masks else None,
            shared(torch.full((num_rows * 2 * chunks * 256,), float("nan"))),
            shared(torch.full((num_rows * 2 * chunks,), -7, dtype=torch.int32)), row_counters,
            np.int32(vocab), np.int32(num_mask_words(vocab)), np.int32(max_rows), np.int32(strategy),
            np.int32(policy), np.int32(chunk_len), np.int32(split_sampled),
        ]  # fmt: skip
        grid, defines = (num_rows, chunks), {"THREADS": HOST_THREADS}
        run_threads_on_host(SOURCE, "verify_sample", defines, grid, HOST_THREADS, args, library_dir, True)
        assert not counters.any() and not row_counters.any(), "counters must be left zero"
        return token_ids, num_accepted, *out

    return run


def split_requests(vocab: int, rng: random.Random) -> list[VerifyRequest]:
    """Greedy and sampled requests (every setting of SETTINGS), 0-5 drafts each."""
    requests = greedy_requests(1, vocab, rng)
    for settings in SETTINGS[1:]:
        params = SamplingParams(**settings, seed=rng.randrange(2**62))
        drafts = [rng.randrange(vocab) for _ in range(rng.randrange(0, 2))]
        requests.append(VerifyRequest(params, params.seed or 0, rng.randrange(500), drafts))
    return requests


@needs_gxx
@pytest.mark.parametrize("vocab", [1000, 1001])
def test_split_verify_on_the_host_matches_reference(vocab: int, host_verify: Any) -> None:
    """The verify kernel's CUDA source run on the host, all blocks at once: greedy and sampled rows
    (temperatures, top_k, top_p, min_p) split over chunks of 128 / 256 logits, with and without
    grammar masks, for each strategy, give the reference's tokens, accepted counts, greedy and
    sampled ids and passes, as the unsplit kernel does (a tie across chunks on a greedy row: the
    lower index wins); the row and request counters are left zero."""
    rng = random.Random(vocab)
    requests = split_requests(vocab, rng)
    num_rows = sum(r.num_rows for r in requests)
    logits = (torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(vocab)) * 4).contiguous()
    logits[0, 130] = logits[0, vocab - 1] = logits[0].max() + 1  # a tie across chunks: the lower index wins
    plant_drafts(requests, logits)
    rows = row_tensors(requests, "cpu")
    for strategy in ("greedy", "target_match", "topp"):
        masks = random_masks(logits, requests, rng) if strategy != "greedy" else None
        args = dict(strategy=STRATEGIES[strategy])
        if masks is not None:
            args.update(bitmask=masks[0], masked_rows=masks[1])
        expected = verify_sample_ref(logits, **rows, **args)
        for chunk_len, split_sampled in (
            ((256, True),) if strategy != "greedy" else ((vocab, True), (128, True))
        ):
            got = host_verify(logits, rows, STRATEGIES[strategy], masks, chunk_len, split_sampled)
            for name, g, e in zip(("tokens", "accepted", "greedy", "sampled", "passes"), got, expected):
                assert torch.equal(g, e), (strategy, chunk_len, split_sampled, name)


@needs_gxx
def test_split_sampled_rows_keep_ties_at_the_cut_as_one_block_does(host_verify: Any) -> None:
    """Logits with many exact ties (integers): a top_k or top_p cut falls inside a group of equal
    probabilities, where the kernel keeps every tied token; the split rows sample exactly the token
    one block per row samples, and a top_k = 1 row samples one of the tied maxima."""
    vocab, rng = 1001, random.Random(3)
    settings = [
        dict(temperature=1.0, top_k=3),
        dict(temperature=0.7, top_k=1),
        dict(temperature=1.0, top_p=0.3),
        dict(temperature=1.5, top_k=40, top_p=0.6, min_p=0.05),
    ]
    requests = []
    for i, setting in enumerate(settings * 3):
        params = SamplingParams(**setting, seed=rng.randrange(2**62))
        requests.append(
            VerifyRequest(params, params.seed or 0, rng.randrange(500), [rng.randrange(vocab)] * (i % 3))
        )
    num_rows = sum(r.num_rows for r in requests)
    logits = torch.randint(-6, 3, (num_rows, vocab), generator=torch.Generator().manual_seed(1)).float()
    rows = row_tensors(requests, "cpu")
    for strategy in ("target_match", "topp"):
        one_block = host_verify(logits, rows, STRATEGIES[strategy], None, vocab, True)
        split = host_verify(logits, rows, STRATEGIES[strategy], None, 128, True)
        for g, e in zip(split, one_block):
            assert torch.equal(g, e), strategy
        top_k1 = rows["top_k"] == 1
        sampled = split[3].long()
        assert bool(
            (logits[top_k1].gather(1, sampled[top_k1, None])[:, 0] == logits[top_k1].max(1).values).all()
        )
