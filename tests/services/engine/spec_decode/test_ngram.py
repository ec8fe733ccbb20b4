"""N-gram drafting against a brute-force statement of the rule."""

from __future__ import annotations

import random

import pytest
import torch

from services.engine.input_batch import InputBatch
from services.engine.sequence import Sequence
from services.engine.spec_decode.ngram import NgramProposer
from services.engine.spec_decode.proposer import DraftBatch
from shared.sampling_params import SamplingParams


def propose(proposer: NgramProposer, tokens: list[int], k: int) -> list[int]:
    """The proposer's drafts for one request whose token row holds `tokens`."""
    inputs = InputBatch(1, len(tokens) + 8, proposer.max_num_drafts, torch.device("cpu"))
    seq = Sequence("r", tokens, SamplingParams(), frozenset())
    slots = torch.tensor([inputs.add(seq)])
    batch = DraftBatch(
        inputs, [seq], slots, torch.tensor([0]), torch.tensor([k], dtype=torch.int32), [k], 0, None
    )
    drafts = proposer.propose(batch)
    return drafts.token_ids[0, : int(drafts.num_drafts[0])].tolist()


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_copies_what_followed_the_repeated_span() -> None:
    tokens = [5, 6, 7, 8, 9, 10, 1, 2, 5, 6, 7]
    assert propose(NgramProposer(1, 3, 5), tokens, 3) == [8, 9, 10]


def test_prefers_longer_matches_then_most_recent() -> None:
    tokens = [1, 2, 3, 40, 9, 2, 3, 50, 1, 2, 3]
    assert propose(NgramProposer(1, 3, 5), tokens, 1) == [40]  # the 3-gram "1 2 3" beats the later 2-gram
    assert propose(NgramProposer(1, 2, 5), tokens, 1) == [50]  # among 2-grams "2 3", the most recent


@pytest.mark.parametrize("seed", range(20))
def test_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
    k, min_n, max_n = rng.randrange(1, 6), rng.randrange(1, 3), rng.randrange(3, 6)
    assert propose(NgramProposer(min_n, max_n, 5), tokens, k) == brute_force(tokens, k, min_n, max_n)


def test_no_match_no_drafts() -> None:
    assert propose(NgramProposer(2, 4, 5), [1, 2, 3, 4, 5], 4) == []
    assert propose(NgramProposer(1, 4, 5), [7], 4) == []


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2, 5)
