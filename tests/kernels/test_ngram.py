"""Batched n-gram match: CUDA kernel vs reference vs a brute-force statement of the rule."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.ngram_ref import ngram_match_ref
from tests.kernels.helpers import needs_cuda, poison_allocator


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest suffix of `tokens` (max_n down to min_n) found earlier, most recent match first:
    the up to k tokens that followed it."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + k]
    return []


def random_histories(
    num_reqs: int, max_len: int, vocab: int, rng: random.Random
) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = [rng.randrange(0, max_len + 1) for _ in range(num_reqs)]
    lengths[0] = max_len
    history = torch.full((num_reqs, max_len + 3), -5, dtype=torch.int32)
    for b, n in enumerate(lengths):
        history[b, :n] = torch.tensor([rng.randrange(vocab) for _ in range(n)], dtype=torch.int32)
    return history, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 3), (2, 5)])
def test_reference_matches_brute_force(min_n: int, max_n: int) -> None:
    rng = random.Random(min_n * 10 + max_n)
    history, lengths = random_histories(40, 60, 4, rng)
    ks = torch.tensor([rng.randrange(0, 6) for _ in range(40)], dtype=torch.int32)
    drafts, num_drafts = ngram_match_ref(history, lengths, min_n, max_n, ks)
    for b in range(40):
        expected = brute_force(history[b, : lengths[b]].tolist(), int(ks[b]), min_n, max_n)
        assert drafts[b, : num_drafts[b]].tolist() == expected
        assert (drafts[b, num_drafts[b] :] == -1).all()


def test_reference_budget_grants_in_request_order() -> None:
    history = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]] * 3, dtype=torch.int32)
    lengths = torch.tensor([8, 8, 8], dtype=torch.int32)
    _, unlimited = ngram_match_ref(history, lengths, 1, 3, 3)
    assert unlimited.tolist() == [3, 3, 3]
    _, num = ngram_match_ref(history, lengths, 1, 3, 3, budget=5)
    assert num.tolist() == [3, 2, 0]


def test_reference_row_ids_pick_history_rows() -> None:
    rng = random.Random(3)
    history, lengths = random_histories(10, 30, 3, rng)
    row_ids = torch.tensor([7, 2, 2, 9], dtype=torch.long)
    by_row = ngram_match_ref(history, lengths[row_ids], 1, 3, 4, row_ids=row_ids)
    gathered = ngram_match_ref(history[row_ids], lengths[row_ids], 1, 3, 4)
    assert all(torch.equal(a, b) for a, b in zip(by_row, gathered))


@pytest.mark.gpu
@needs_cuda
def test_cuda_ngram_row_ids_match_reference() -> None:
    """Requests read their own rows of a larger history (as the CUDA-graph step does)."""
    from kernels.ngram import ngram_match_cuda

    rng = random.Random(8)
    history, lengths = random_histories(300, 500, 4, rng)
    row_ids = torch.tensor(rng.sample(range(300), 64), dtype=torch.long)
    ks = torch.tensor([rng.randrange(0, 7) for _ in range(64)], dtype=torch.int32)
    expected = ngram_match_ref(history, lengths[row_ids], 1, 4, ks, row_ids=row_ids)
    poison_allocator((64, 6), torch.int32, torch.device("cuda"))
    got = ngram_match_cuda(
        history.cuda(), lengths[row_ids].cuda(), 1, 4, ks.cuda(), max_k=6, row_ids=row_ids.cuda()
    )
    assert torch.equal(got[1].cpu(), expected[1])
    assert torch.equal(got[0].cpu()[:, : expected[0].shape[1]], expected[0])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_reqs,max_len", [(1, 10), (7, 100), (64, 2000), (256, 8192)])
@pytest.mark.parametrize("min_n,max_n", [(1, 3), (2, 2), (3, 8)])
def test_cuda_ngram_matches_reference(num_reqs: int, max_len: int, min_n: int, max_n: int) -> None:
    from kernels.ngram import ngram_match_cuda

    rng = random.Random(num_reqs + max_len + min_n + max_n)
    for vocab in (3, 50):
        history, lengths = random_histories(num_reqs, max_len, vocab, rng)
        ks = torch.tensor([rng.randrange(0, 9) for _ in range(num_reqs)], dtype=torch.int32)
        for budget in (None, 3 * num_reqs, 7):
            expected = ngram_match_ref(history, lengths, min_n, max_n, ks, budget)
            poison_allocator((num_reqs, int(ks.max()) or 1), torch.int32, torch.device("cuda"))
            got = ngram_match_cuda(history.cuda(), lengths.cuda(), min_n, max_n, ks.cuda(), budget)
            assert torch.equal(got[1].cpu(), expected[1]), (
                f"num_drafts differ (vocab {vocab}, budget {budget})"
            )
            assert torch.equal(got[0].cpu(), expected[0]), f"drafts differ (vocab {vocab}, budget {budget})"
