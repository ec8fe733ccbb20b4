"""N-gram drafting against a brute-force statement of the rule."""

from __future__ import annotations

import random

import pytest

from services.engine.spec_decode.ngram import NgramProposer


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
    assert NgramProposer(1, 3).propose(tokens, 3) == [8, 9, 10]


def test_prefers_longer_matches_then_most_recent() -> None:
    tokens = [1, 2, 3, 40, 9, 2, 3, 50, 1, 2, 3]
    assert NgramProposer(1, 3).propose(tokens, 1) == [40]  # the 3-gram "1 2 3" beats the later 2-gram
    assert NgramProposer(1, 2).propose(tokens, 1) == [50]  # among 2-grams "2 3", the most recent


@pytest.mark.parametrize("seed", range(20))
def test_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
    k, min_n, max_n = rng.randrange(1, 6), rng.randrange(1, 3), rng.randrange(3, 6)
    assert NgramProposer(min_n, max_n).propose(tokens, k) == brute_force(tokens, k, min_n, max_n)


def test_no_match_no_drafts() -> None:
    assert NgramProposer(2, 4).propose([1, 2, 3, 4, 5], 4) == []
    assert NgramProposer(1, 4).propose([7], 4) == []


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2)
